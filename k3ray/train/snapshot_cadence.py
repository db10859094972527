"""When the step loop takes an in-memory snapshot (`SnapshotCadence`, asked by k3ray.train.boundary): every
`fault_tolerance.snapshot_every` steps (at its multiples), or with "auto" a number of steps after the last one taken
that k3ray.policies.snapshot_cadence decides from what the job's latest snapshots cost (their stall, the optimizer's
wait for their live reads, their arrival in the store) and what its steps take. Until a snapshot has been measured,
auto takes the first FIRST_AUTO steps after the job's start point (the workers warm their stores meanwhile). With
auto, a snapshot due while the previous one still arrives is taken at the first boundary after it arrived; where the
store holds one snapshot at a time, snapshots are spaced so that few steps fall while one arrives (the policy's
window)."""
from __future__ import annotations

import statistics
from collections import deque

from k3ray.config.train import FaultToleranceConfig
from k3ray.policies.snapshot_cadence import snapshot_interval

FIRST_AUTO = 5  # steps from the start point to auto's first snapshot
MEASURED = 3  # auto decides from this many latest snapshots (their median cost, their longest arrival)
STEPS_MEASURED = 20  # ... and the median of this many latest steps


class SnapshotCadence:
    def __init__(self, ft: FaultToleranceConfig):
        self.every, self.budget = ft.snapshot_every, ft.snapshot_budget
        self.interval = FIRST_AUTO if self.every == "auto" else self.every
        self.last: int | None = None  # the start point's step, then the latest snapshot's
        self.step_seconds: deque[float] = deque(maxlen=STEPS_MEASURED)
        self.decided_after = 0  # snapshots committed when the interval was last decided

    @property
    def auto(self) -> bool:
        """Whether a snapshot due while the previous one still arrives waits for the next boundary (auto), rather
        than being skipped (a fixed snapshot_every keeps its multiples)."""
        return self.every == "auto"

    def start_at(self, step: int) -> None:
        """The job's start point is at the boundary before `step`."""
        self.last = step

    def due(self, step: int) -> bool:
        if not self.auto:
            return step % self.every == 0
        return self.last is not None and step - self.last >= self.interval

    def taken(self, step: int) -> None:
        self.last = step

    def after_step(self, step_s: float | None, snapshots) -> None:
        """A step was accepted (`step_s`: its workers' time, None when not reported); with auto, once a further
        snapshot has committed, the interval is decided again from the latest ones (`snapshots`: k3ray.grid.
        snapshots.Snapshots, its per-snapshot stall and optimizer wait, and the steps each took to arrive)."""
        if step_s is not None:
            self.step_seconds.append(step_s)
        committed = len(snapshots.total_seconds)
        if not self.auto or committed == self.decided_after or not self.step_seconds:
            return
        self.decided_after = committed
        stall = statistics.median(snapshots.stall_seconds[-MEASURED:])
        wait = statistics.median(snapshots.read_wait_seconds[-MEASURED:]) if snapshots.read_wait_seconds else 0.0
        arrival = max(snapshots.arrival_steps[-MEASURED:])
        self.interval = snapshot_interval(stall + wait, statistics.median(self.step_seconds), arrival, self.budget,
                                          one_at_a_time=snapshots.one_at_a_time)
