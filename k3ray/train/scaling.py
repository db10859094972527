"""The controller's scaling part: at a step boundary it asks the resize policy (k3ray.policies.resize) whether to
resize (a `k3ray scale` asked for, or a grow-back due) and carries out the `ResizeDecision` as a bounded handler of
the state machine (resizing): from a snapshot of this boundary, down as after a loss (the kept EP columns regrouped
in place; the workers left out stand by as spares), up in place (ready spares, the workers a shrink left standing by
among them, fill the added places first, then slots lost workers left; the others are placed before the grid in use
changes). A placement that does not fit leaves the grid as it was, and the job trains on at its size. It owns the
sizes: a resize asked for and not yet applied (`asked`), the EP size grow-back returns to (`target_ep`) and when the
job last shrank."""
from __future__ import annotations

import time

import torch

from k3ray.config import JobConfig
from k3ray.grid.calls import TopologyError
from k3ray.grid.snapshots import Snapshots
from k3ray.jobs.incidents import IncidentLog
from k3ray.policies import resize
from k3ray.policies.resize import ResizeDecision
from k3ray.train.checkpointing import DurableCheckpoints
from k3ray.train.grid import TrainingGrid
from k3ray.train.placement import Placement
from k3ray.train.progress import TrainingProgress
from k3ray.train.state import JobState, StateMachine


class Scaling:
    def __init__(self, cfg: JobConfig, progress: TrainingProgress, grid: TrainingGrid, table: Placement,
                 machine: StateMachine, snapshots: Snapshots, checkpoints: DurableCheckpoints, incidents: IncidentLog):
        """The controller's parts a resize acts on: the grid it resizes from a snapshot of the boundary (the
        progress's guard statistics with it), the placement table, the state machine, the pending checkpoint it
        commits first and the incidents it records."""
        self.cfg, self.progress, self.grid, self.table, self.machine = cfg, progress, grid, table, machine
        self.snapshots, self.checkpoints, self.incidents = snapshots, checkpoints, incidents
        self.asked: int | None = None  # EP size asked for (`request`), applied at the next step boundary
        self.target_ep = cfg.parallel.ep  # the size grow-back returns to: the last one a `k3ray scale` applied
        self.shrunk_at: int | None = None  # step at which the job last shrank (None: at the size asked for)
        self.grow_back_failures = 0  # grow-backs in a row whose placement failed

    def request(self, ep, step: int) -> dict:
        """Resize the grid to pp x ep at the next step boundary (`k3ray scale --ep N`), through the recovery's paths
        with the global batch kept, so the results do not change. ValueError naming the field for a bad ep."""
        full = self.cfg.parallel.ep
        if isinstance(ep, bool) or not isinstance(ep, int) or not 1 <= ep <= full:
            raise ValueError(f"ep: must be a whole number from 1 to parallel.ep={full} (the data-parallel width), "
                             f"got {ep!r}")
        self.asked = ep
        return {"ep": [self.table.ep, ep], "applies_at_step": step}

    def at_boundary(self, step: int) -> None:
        """The resize asked for (`request`), then a grow-back if one is due and the cluster has room."""
        table, cfg = self.table, self.cfg
        asked, self.asked = self.asked, None
        if asked is not None:
            decision = resize.on_scale_request(asked, table.ep, torch.tensor(table.home),
                                               table.expert_load(self.progress.last_report))
            if decision is not None:
                self._resize(step, decision)
        decision = resize.on_grow_back(step, self.shrunk_at, table.ep, self.target_ep, cfg.model.n_experts,
                                       self.grow_back_failures, cfg.fault_tolerance)
        if decision is not None and self.grid.room_for(cfg.parallel.pp * (decision.ep - decision.old_ep)):
            self._resize(step, decision)

    def after_recovery(self, step: int, ep: int) -> None:
        """A recovery at the boundary of `step` left `ep` EP ranks: shrunk below the size asked for, or not."""
        self.shrunk_at = step if ep < self.target_ep else None

    def _resize(self, step: int, decision: ResizeDecision) -> None:
        ft, group = self.cfg.fault_tolerance, self.grid.group
        t0 = time.perf_counter()
        # the workers taking their places in the resized grid drop the parts they are writing: commit them first
        self.checkpoints.commit_pending(group)
        verb = "scaling" if decision.why == "scale" else "growing back"
        self.machine.to(JobState.RESIZING, f"{verb} to ep={decision.ep}")
        self.snapshots.take(group, step, self.progress.guard_state, wait=True)
        sources, home = self.snapshots.committed.sources(), decision.home.tolist()
        try:
            if decision.shrinks:
                self.table.reset(decision.ep, home)
                group.regroup(set(), decision.ep, home, list(range(decision.ep)), set(), sources, timeout_s=60.0)
            else:
                group.grow(decision.ep, home, sources, timeout_s=min(60.0, ft.wait_timeout_s))
                self.table.reset(decision.ep, home)
        except TopologyError as err:  # nothing changed: the grid trains on at its size
            self._did_not_fit(step, decision, err)
            return
        self.grid.joined()
        if decision.why == "scale":
            self.target_ep = decision.ep  # the size asked for: a later loss grows back to it, not beyond
        else:
            self.grow_back_failures = 0
        self.shrunk_at = None
        self.incidents.add("scaled" if decision.why == "scale" else "grow_back", step=step,
                           ep=[decision.old_ep, decision.ep], seconds=time.perf_counter() - t0)
        self.machine.to(JobState.RUNNING, f"{'scaled' if decision.why == 'scale' else 'grown back'} to "
                                          f"{self.grid.group.size} workers")

    def _did_not_fit(self, step: int, decision: ResizeDecision, err: TopologyError) -> None:
        ep = [decision.old_ep, decision.ep]
        if decision.why == "scale":
            self.incidents.add("scale_failed", step=step, ep=ep, why=str(err))
            self.machine.to(JobState.RUNNING, f"scaling to ep={decision.ep} did not fit ({err})")
            return
        self.grow_back_failures += 1
        self.shrunk_at = step  # the next try after grow_back_after_steps more steps
        self.incidents.add("grow_back_failed", step=step, rule="grow_back_failed", ep=ep, why=str(err),
                           attempt=self.grow_back_failures)
        stay = self.grow_back_failures >= self.cfg.fault_tolerance.grow_back_attempts
        self.machine.to(JobState.RUNNING, f"grow-back did not fit ({err}); "
                                          + ("staying shrunk" if stay else "trying again later"))
