"""Whether and how to resize the grid at a step boundary: a resize asked for (`k3ray scale --ep N`), or growing a job
that shrank after a loss back to the size asked for. Pure decisions; the controller's scaling part
(k3ray.train.scaling) carries them out. The data-parallel width stays parallel.ep whatever the EP size, so the global
batch and the results do not change.

home [E] int64: the EP rank each expert lives on. load [E]: recent tokens per expert (any scale)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from k3ray.config import FaultToleranceConfig
from k3ray.policies.recovery import grow, shrink


@dataclass(frozen=True)
class ResizeDecision:
    """Go from `old_ep` to `ep` EP ranks per stage with experts at `home` [E]. `why`: "scale" (asked for) or
    "grow_back". Down keeps EP columns 0..ep-1 (the experts of the others re-homed by load, the workers left out stand
    by as spares); up places the configured contiguous homes."""
    why: Literal["scale", "grow_back"]
    old_ep: int
    ep: int
    home: torch.Tensor

    @property
    def shrinks(self) -> bool:
        return self.ep < self.old_ep


def on_scale_request(asked: int | None, ep: int, home: torch.Tensor, load: torch.Tensor) -> ResizeDecision | None:
    """The resize `asked` for (None: nothing asked) of a grid with `ep` EP ranks; None when there is nothing to do."""
    if asked is None or asked == ep:
        return None
    new_home = shrink(home, set(range(asked, ep)), load)[0] if asked < ep else grow(home.numel(), asked)
    return ResizeDecision("scale", ep, asked, new_home)


def on_grow_back(step: int, shrunk_at: int | None, ep: int, target_ep: int, num_experts: int, failures: int,
                 ft: FaultToleranceConfig) -> ResizeDecision | None:
    """Grow a job shrunk at step `shrunk_at` (None: not shrunk) back to `target_ep` at the boundary of `step`, if the
    resources are free: once `grow_back_after_steps` have passed, while fewer than `grow_back_attempts` tries in a row
    (`failures`) did not fit."""
    due = (ft.grow_back and shrunk_at is not None and ep < target_ep and step - shrunk_at >= ft.grow_back_after_steps
           and failures < ft.grow_back_attempts)
    return ResizeDecision("grow_back", ep, target_ep, grow(num_experts, target_ep)) if due else None
