"""The controller's step boundaries (`StepBoundary`): what happens between two steps, in this order (a kill drill due
at the boundary, the object stores warmed after the job's first step, the queued policy changes pushed, a resize
asked for or a grow-back due, the snapshot and the durable checkpoint due), and at the job's end (the final checkpoint, written again by a recovered grid where a worker
is lost meanwhile). The step loop (k3ray.train.controller) calls it; the parts it drives do the work."""
from __future__ import annotations

import functools

from k3ray.config import JobConfig
from k3ray.grid.calls import WorkerLost
from k3ray.grid.snapshots import Snapshots
from k3ray.jobs.live_policies import LivePolicies
from k3ray.train.checkpointing import DurableCheckpoints
from k3ray.train.drills import FaultInjector
from k3ray.train.failures import Recovery
from k3ray.train.grid import TrainingGrid
from k3ray.train.placement import Placement
from k3ray.train.progress import TrainingProgress
from k3ray.train.scaling import Scaling
from k3ray.train.snapshot_cadence import SnapshotCadence


class StepBoundary:
    def __init__(self, cfg: JobConfig, progress: TrainingProgress, grid: TrainingGrid, table: Placement,
                 policies: LivePolicies, drills: FaultInjector, scaling: Scaling, snapshots: Snapshots,
                 cadence: SnapshotCadence, checkpoints: DurableCheckpoints, recovery: Recovery):
        self.cfg, self.progress, self.grid, self.table, self.policies = cfg, progress, grid, table, policies
        self.drills, self.scaling, self.snapshots, self.checkpoints = drills, scaling, snapshots, checkpoints
        self.cadence, self.recovery = cadence, recovery

    def before(self, step: int) -> None:
        """Between steps, before `step`: queued policy changes, a resize asked for or growing back, the snapshot and
        checkpoint due. A worker lost in here raises WorkerLost (the step loop recovers and comes back here)."""
        grid = self.grid  # its group is the one in place at each line: a resize puts a new one there
        self.drills.kill_at(grid.group, step, "boundary", settle=lambda: self.snapshots.commit(grid.group, wait=True))
        self.snapshots.warm_stores(grid.group, step)
        if self.policies.take_pending(step):
            grid.push_policies()
        self.scaling.at_boundary(step)
        if self._snapshot_due(step):
            if self.snapshots.take(grid.group, step, self.progress.guard_state, defer=self.cadence.auto):
                self.cadence.taken(step)
        self.checkpoints.boundary(grid.group, step, self._meta(step))

    def _snapshot_due(self, step: int) -> bool:
        return self.cadence.due(step) and not self.snapshots.holds(step)

    def takes_snapshot(self, step: int) -> bool:
        """Whether the boundary before `step` will take a snapshot, as things stand: one is due there and none is
        still arriving (that one would have it deferred or skipped, unless it arrives meanwhile)."""
        return self._snapshot_due(step) and not self.snapshots.arriving()

    def at_end(self, step: int) -> None:
        """The final checkpoint of the job at `step` (`DurableCheckpoints.at_end`); a worker lost meanwhile is
        recovered from once and the checkpoint written by the new grid."""
        try:
            self.checkpoints.at_end(self.grid.group, step, self._meta(step))
        except WorkerLost as lost:
            self.recovery.recover(step, lost, detected_after=0.0)
            self.checkpoints.at_end(self.grid.group, step, self._meta(step))

    def _meta(self, step: int):
        """What a checkpoint of `step` records beside the weights, computed when it is written."""
        return functools.partial(self.progress.checkpoint_meta, step, self.cfg, self.table)
