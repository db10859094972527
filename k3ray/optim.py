"""AdamW, the learning-rate schedule and global-norm clipping, shared by the reference trainer and the workers.

The optimizer keeps its state by parameter name, so expert shards can carry their rows of it when they move
(`take_rows` / `set_state`), and a worker can rebuild its parameters without losing moments. Parameters stored
below fp32 (bf16 training) get an fp32 master copy in their state ("master"): the update is applied to it and the
parameter is its rounding, so small updates are not lost to bf16's 8-bit mantissa. On CUDA the step is one fused kernel
per parameter (k3ray.kernels.adamw: torch's fused AdamW arithmetic, the bf16 gradient read directly, 28 bytes moved
per parameter, 20 with bf16 moments: optimizer.moments_dtype); elsewhere torch's own multi-tensor Adam
(`torch.optim.adam.adam`, decoupled weight decay).
"""
from __future__ import annotations

import math

import torch
from torch.optim.adam import adam

from k3ray.config import OptimizerConfig


def lr_at(cfg: OptimizerConfig, step: int, total_steps: int, scale: float = 1.0) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < cfg.warmup_steps:
        return scale * cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return scale * cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def clip_coefficient(total_sq_norm: torch.Tensor, max_norm: float) -> torch.Tensor | float:
    """min(1, max_norm / (norm + 1e-6)) of the global squared norm, a 0-d tensor on its device (the optimizer
    reads it there: no host wait before the step); a NaN norm gives 1 (the update itself is then NaN, which the
    report shows). max_norm <= 0: no clipping (1.0)."""
    if max_norm <= 0:
        return 1.0
    ratio = max_norm / (total_sq_norm.sqrt() + 1e-6)
    return torch.where(ratio < 1.0, ratio, torch.ones_like(ratio))


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum of t^2 over every element of every tensor, as a 0-d tensor in fp32 (float64 for float64 tensors), on the
    tensors' device: one multi-tensor norm kernel over bf16 gradients, no widened copies and no host sync."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=wide)).square().sum()


def needs_master(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


def moments_dtype(weight_dtype: torch.dtype, configured: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype of a parameter's moments: the configured one (optimizer.moments_dtype), float64 for float64
    parameters (the exact tests)."""
    return torch.float64 if weight_dtype == torch.float64 else configured


def fresh_state(weight: torch.Tensor, moments: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state of a parameter that has not been stepped yet: zero moments (`moments_dtype`), and its fp32
    master."""
    wide = moments_dtype(weight.dtype, moments)
    state = {"m": torch.zeros_like(weight, dtype=wide), "v": torch.zeros_like(weight, dtype=wide)}
    if needs_master(weight.dtype):
        state["master"] = weight.detach().float().clone()
    return state


class AdamW:
    def __init__(self, cfg: OptimizerConfig):
        self.cfg = cfg
        self.moments = getattr(torch, cfg.moments_dtype)
        self.steps = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def init_state(self, params: dict[str, torch.nn.Parameter]) -> None:
        """The state of every parameter that has none yet, as its first step would make it (zero moments, its
        master): a snapshot taken before the first step then has the size of every later one, so its buffers are
        sized once."""
        for name, p in params.items():
            if name not in self.state:
                self.state[name] = fresh_state(p, self.moments)

    def adopt(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A parameter's state from elsewhere (a checkpoint, a snapshot, another worker's rows) with its moments in
        this optimizer's dtype: a job can change optimizer.moments_dtype across a restart."""
        return {k: t.to(moments_dtype(t.dtype, self.moments)) if k in ("m", "v") else t for k, t in state.items()}

    @torch.no_grad()
    def step(self, params: dict[str, torch.nn.Parameter], lr: float,
             grad_scale: float | torch.Tensor = 1.0) -> None:
        """One AdamW step on every parameter with a gradient; grad_scale (a number or a 0-d tensor on the
        parameters' device, read there) multiplies the gradients (clipping). Weight decay applies to matrices only
        (ndim >= 2)."""
        self.steps += 1
        groups: dict[bool, list[tuple]] = {True: [], False: []}  # decayed? -> (param, master, grad, m, v)
        for name, p in params.items():
            if p.grad is None:
                continue
            st = self.state.get(name)
            if st is None:
                st = self.state[name] = fresh_state(p, self.moments)
            groups[p.ndim >= 2 and self.cfg.weight_decay > 0].append((p, st.get("master"), p.grad, st["m"], st["v"]))
        for decayed, entries in groups.items():
            if not entries:
                continue
            wd = self.cfg.weight_decay if decayed else 0.0
            if all(p.is_cuda for p, *_ in entries):
                self._fused(entries, lr, grad_scale, wd)
            else:
                self._foreach(entries, lr, grad_scale, wd)

    def _fused(self, entries: list[tuple], lr: float, grad_scale: float | torch.Tensor, wd: float) -> None:
        """One fused kernel per parameter (k3ray.kernels.adamw): the bf16 gradient read as it is, master, moments
        and the rounded parameter written in the same pass; the clip coefficient read on the device."""
        from k3ray.kernels.adamw import adamw_step_

        device = entries[0][0].device
        if isinstance(grad_scale, torch.Tensor):
            divisor = (1.0 / grad_scale.double()).float()
        else:
            divisor = torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=device)
        (b1, b2), eps = self.cfg.betas, self.cfg.eps
        for p, master, grad, m, v in entries:
            adamw_step_(p.data, master, grad.contiguous(), m, v, lr=lr, beta1=b1, beta2=b2, eps=eps,
                        weight_decay=wd, step=self.steps, grad_divisor=divisor)

    def _foreach(self, entries: list[tuple], lr: float, grad_scale: float | torch.Tensor, wd: float) -> None:
        """torch's multi-tensor AdamW (the CPU path, and the reference the fused kernel is tested against):
        gradients widened to their masters' dtype, the parameters then the rounding of their masters."""
        low, masters, grads, kept_ms, kept_vs = (list(t) for t in zip(*entries))
        targets = [p if master is None else master for p, master in zip(low, masters)]
        grads = [g if g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, targets)]
        # moments narrower than their parameter's master (moments_dtype bfloat16): the step in the master's dtype,
        # each moment rounded once when it is stored back, as the fused kernel does
        ms, vs = ([x if x.dtype == t.dtype else x.to(t.dtype) for x, t in zip(kept, targets)]
                  for kept in (kept_ms, kept_vs))
        if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
            torch._foreach_mul_(grads, grad_scale)
        steps = list(torch.full((len(targets),), float(self.steps - 1)).unbind())  # torch's adam advances these
        (b1, b2), eps = self.cfg.betas, self.cfg.eps
        adam(targets, grads, ms, vs, [], steps, foreach=True, decoupled_weight_decay=True, amsgrad=False, beta1=b1,
             beta2=b2, lr=lr, weight_decay=wd, eps=eps, maximize=False)
        for kept, wide in ((kept_ms, ms), (kept_vs, vs)):
            narrowed = [(k, w) for k, w in zip(kept, wide) if k is not w]
            if narrowed:
                torch._foreach_copy_([k for k, _ in narrowed], [w for _, w in narrowed])
        pairs = [(p, t) for p, t in zip(low, targets) if p is not t]
        if pairs:  # parameters below fp32: the rounding of their fp32 masters
            torch._foreach_copy_([p for p, _ in pairs], [t for _, t in pairs])

    def take_rows(self, name: str, rows: list[int]) -> dict[str, torch.Tensor] | None:
        st = self.state.get(name)
        return None if st is None else {k: v[rows].clone() for k, v in st.items()}

    def set_state(self, name: str, state: dict[str, torch.Tensor] | None) -> None:
        if state is None:
            self.state.pop(name, None)
        else:
            self.state[name] = self.adopt(state)
