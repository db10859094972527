"""AdamW, the learning-rate schedule and global-norm clipping, shared by the reference trainer and the workers.

The optimizer keeps its state by parameter name, so expert shards can carry their rows of it when they move
(`take_rows` / `set_state`), and a worker can rebuild its parameters without losing moments.
"""
from __future__ import annotations

import math

import torch

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


class AdamW:
    def __init__(self, cfg: OptimizerConfig):
        self.cfg = cfg
        self.steps = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, params: dict[str, torch.nn.Parameter], lr: float, grad_scale: float = 1.0) -> None:
        self.steps += 1
        b1, b2 = self.cfg.betas
        bc1, bc2 = 1 - b1 ** self.steps, 1 - b2 ** self.steps
        for name, p in params.items():
            if p.grad is None:
                continue
            g = p.grad.float() * grad_scale
            st = self.state.get(name)
            if st is None:
                st = self.state[name] = {"m": torch.zeros_like(g), "v": torch.zeros_like(g)}
            st["m"].mul_(b1).add_(g, alpha=1 - b1)
            st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
            update = (st["m"] / bc1) / ((st["v"] / bc2).sqrt() + self.cfg.eps)
            if p.ndim >= 2 and self.cfg.weight_decay > 0:
                p.mul_(1 - lr * self.cfg.weight_decay)
            p.add_(update.to(p.dtype), alpha=-lr)

    def take_rows(self, name: str, rows: list[int]) -> dict[str, torch.Tensor] | None:
        st = self.state.get(name)
        return None if st is None else {k: v[rows].clone() for k, v in st.items()}

    def set_state(self, name: str, state: dict[str, torch.Tensor] | None) -> None:
        if state is None:
            self.state.pop(name, None)
        else:
            self.state[name] = state
