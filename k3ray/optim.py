"""AdamW, the learning-rate schedule and global-norm clipping, shared by the reference trainer and the workers.

The optimizer keeps its state by parameter name, so expert shards can carry their rows of it when they move
(`take_rows` / `set_state`), and a worker can rebuild its parameters without losing moments. Parameters stored
below fp32 (bf16 training) get an fp32 master copy in their state ("master"): the update is applied to it and the
parameter is its rounding, so small updates are not lost to bf16's 8-bit mantissa. The arithmetic is torch's own
multi-tensor Adam (`torch.optim.adam.adam`, decoupled weight decay; fused kernels on CUDA).
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


def clip_coefficient(total_sq_norm: float, max_norm: float) -> float:
    norm = math.sqrt(total_sq_norm)
    return min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum of t^2 over every element of every tensor, as a 0-d tensor in fp32 (float64 for float64 tensors), on the
    tensors' device: one multi-tensor norm kernel over bf16 gradients, no widened copies and no host sync."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=wide)).square().sum()


def needs_master(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


def fresh_state(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state of a parameter that has not been stepped yet: zero moments (fp32 or wider), and its fp32 master."""
    wide = torch.float32 if needs_master(weight.dtype) else weight.dtype
    state = {"m": torch.zeros_like(weight, dtype=wide), "v": torch.zeros_like(weight, dtype=wide)}
    if needs_master(weight.dtype):
        state["master"] = weight.detach().float().clone()
    return state


WIDEN_CHUNK_BYTES = 1 << 30  # bf16 gradients are widened to fp32 for the fused step this many bytes at a time


def _widening_chunks(entries: list[tuple]):
    """(param, target, grad, m, v) entries in runs, in order, whose gradients widened to their targets' dtype take
    at most WIDEN_CHUNK_BYTES (a larger one alone): the fp32 copies of a bf16 model's gradients then never all exist
    at once (15.9 GiB for gpu2's 8 layers on one worker). Gradients already of their target's dtype count nothing."""
    run, widened = [], 0
    for entry in entries:
        _, target, grad = entry[:3]
        size = grad.numel() * target.element_size() if grad.dtype != target.dtype else 0
        if run and widened + size > WIDEN_CHUNK_BYTES:
            yield run
            run, widened = [], 0
        run.append(entry)
        widened += size
    if run:
        yield run


class AdamW:
    def __init__(self, cfg: OptimizerConfig):
        self.cfg = cfg
        self.steps = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def init_state(self, params: dict[str, torch.nn.Parameter]) -> None:
        """The state of every parameter that has none yet, as its first step would make it (zero moments, its
        master): a snapshot taken before the first step then has the size of every later one, so its buffers are
        sized once."""
        for name, p in params.items():
            if name not in self.state:
                self.state[name] = fresh_state(p)

    @torch.no_grad()
    def step(self, params: dict[str, torch.nn.Parameter], lr: float, grad_scale: float = 1.0) -> None:
        """One AdamW step on every parameter with a gradient; grad_scale multiplies the gradients (clipping).
        Weight decay applies to matrices only (ndim >= 2)."""
        self.steps += 1
        groups: dict[bool, list[tuple]] = {True: [], False: []}  # decayed? -> (param, target, grad, m, v)
        for name, p in params.items():
            if p.grad is None:
                continue
            st = self.state.get(name)
            if st is None:
                st = self.state[name] = fresh_state(p)
            target = st.get("master", p)
            groups[p.ndim >= 2 and self.cfg.weight_decay > 0].append((p, target, p.grad, st["m"], st["v"]))
        b1, b2 = self.cfg.betas
        for decayed, entries in groups.items():
            for chunk in _widening_chunks(entries):
                self._adam(chunk, lr, grad_scale, decayed, b1, b2)

    def _adam(self, entries: list[tuple], lr: float, grad_scale: float, decayed: bool, b1: float, b2: float) -> None:
        """torch's AdamW over (param, target, grad, m, v) entries: bf16 gradients widened to their masters' fp32
        here (the fused kernel takes one dtype per tensor list), the parameters then the rounding of their masters."""
        low, targets, grads, ms, vs = (list(t) for t in zip(*entries))
        grads = [g if g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, targets)]
        fused = all(t.is_cuda for t in targets)
        # the fused kernel divides by its grad_scale as it reads each gradient: no separate pass over them
        divide_by = None
        if grad_scale != 1.0 and fused:
            divide_by = torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=targets[0].device)
        elif grad_scale != 1.0:
            torch._foreach_mul_(grads, grad_scale)
        steps = list(torch.full((len(targets),), float(self.steps - 1),  # torch's adam advances these
                                device=targets[0].device if fused else "cpu").unbind())
        adam(targets, grads, ms, vs, [], steps, foreach=not fused, fused=fused, grad_scale=divide_by,
             decoupled_weight_decay=True, amsgrad=False, beta1=b1, beta2=b2, lr=lr,
             weight_decay=self.cfg.weight_decay if decayed else 0.0, eps=self.cfg.eps, maximize=False)
        pairs = [(p, t) for p, t in zip(low, targets) if p is not t]
        if pairs:  # bf16 parameters: the rounding of their fp32 masters
            torch._foreach_copy_([p for p, _ in pairs], [t for _, t in pairs])

    def take_rows(self, name: str, rows: list[int]) -> dict[str, torch.Tensor] | None:
        st = self.state.get(name)
        return None if st is None else {k: v[rows].clone() for k, v in st.items()}

    def set_state(self, name: str, state: dict[str, torch.Tensor] | None) -> None:
        if state is None:
            self.state.pop(name, None)
        else:
            self.state[name] = state
