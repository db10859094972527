"""The failure ladder for blow-ups: what to do when the guards reject the same step again and again.

A pure decision over the attempt count; the controller carries it out (restore the snapshot, skip the batches, set
the learning-rate scale, or stop the job with a report). Each trip skips `skip_growth ** (attempt - 1)` batches from
the one that tripped (fresh data after a bad batch); from the second trip on the learning rate is also lowered by
`lr_backoff`; past `max_retries_per_step` trips the job stops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from k3ray.config import FaultToleranceConfig


@dataclass(frozen=True)
class TripDecision:
    action: Literal["rollback", "stop"]
    skip: tuple[int, ...]  # batch indices never to train on
    lr_scale: float  # the learning-rate scale from now on


def on_trip(attempt: int, batch: int, lr_scale: float, ft: FaultToleranceConfig) -> TripDecision:
    """`attempt` counts the trips of this step (1 for the first); `batch` is the batch the step ran on."""
    skip = tuple(batch + i for i in range(ft.skip_growth ** (attempt - 1)))
    if attempt > ft.max_retries_per_step:
        return TripDecision("stop", skip, lr_scale)
    return TripDecision("rollback", skip, lr_scale * ft.lr_backoff if attempt >= 2 else lr_scale)
