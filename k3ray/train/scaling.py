"""The controller's scaling part: at a step boundary it asks the resize policy (k3ray.policies.resize) whether to
resize (a `k3ray scale` asked for, or a grow-back due) and carries out the `ResizeDecision` as a bounded handler of
the state machine (resizing): from a snapshot of this boundary, down as after a loss (the kept EP columns regrouped
in place; the workers left out stand by as spares), up in place (ready spares fill the added places first; the others
are placed before the grid in use changes). A placement that does not fit leaves the grid as it was, and the job
trains on at its size. It owns the sizes: the EP size asked for (`target_ep`) and when the job last shrank."""
from __future__ import annotations

import time

import torch

from k3ray.grid.calls import TopologyError
from k3ray.policies import resize
from k3ray.policies.resize import ResizeDecision
from k3ray.train.state import JobState


class Scaling:
    def __init__(self, job):
        """job: the controller (k3ray.train.controller), whose grid, snapshots and checkpoints a resize acts on."""
        self.job = job
        self.target_ep = job.cfg.parallel.ep  # the size grow-back returns to: the last one a `k3ray scale` applied
        self.shrunk_at: int | None = None  # step at which the job last shrank (None: at the size asked for)
        self.grow_back_failures = 0  # grow-backs in a row whose placement failed

    def at_boundary(self, step: int, asked: int | None) -> None:
        """The resize `asked` for (`request_scale`), then a grow-back if one is due and the cluster has room."""
        job = self.job
        table = job.table
        if asked is not None:
            decision = resize.on_scale_request(asked, table.ep, torch.tensor(table.home),
                                               table.expert_load(job.last_report))
            if decision is not None:
                self._resize(step, decision)
        decision = resize.on_grow_back(step, self.shrunk_at, table.ep, self.target_ep, job.cfg.model.n_experts,
                                       self.grow_back_failures, job.cfg.fault_tolerance)
        added = 0 if decision is None else job.cfg.parallel.pp * (decision.ep - decision.old_ep)
        if decision is not None and job.group.alive_nodes.room_for(added):
            self._resize(step, decision)

    def after_recovery(self, step: int, ep: int) -> None:
        """A recovery at the boundary of `step` left `ep` EP ranks: shrunk below the size asked for, or not."""
        self.shrunk_at = step if ep < self.target_ep else None

    def _resize(self, step: int, decision: ResizeDecision) -> None:
        job, ft = self.job, self.job.cfg.fault_tolerance
        t0 = time.perf_counter()
        # the workers taking their places in the resized grid drop the parts they are writing: commit them first
        job.checkpoints.commit_pending(job.group)
        verb = "scaling" if decision.why == "scale" else "growing back"
        job.machine.to(JobState.RESIZING, f"{verb} to ep={decision.ep}")
        job.snapshots.take(job.group, step, job.guard_state, wait=True)
        sources, home = job.snapshots.committed.sources(), decision.home.tolist()
        try:
            if decision.shrinks:
                job.table.reset(decision.ep, home)
                job.group.regroup(set(), decision.ep, home, list(range(decision.ep)), set(), sources, timeout_s=60.0)
            else:
                job.group.grow(decision.ep, home, sources, timeout_s=min(60.0, ft.wait_timeout_s),
                               use_spares=decision.why == "scale")
                job.table.reset(decision.ep, home)
        except TopologyError as err:  # nothing changed: the grid trains on at its size
            self._did_not_fit(step, decision, err)
            return
        job.joined()
        if decision.why == "scale":
            self.target_ep = decision.ep  # the size asked for: a later loss grows back to it, not beyond
        else:
            self.grow_back_failures = 0
        self.shrunk_at = None
        job.incidents.write(job.incidents.record("scaled" if decision.why == "scale" else "grow_back", step=step,
                                                 ep=[decision.old_ep, decision.ep],
                                                 seconds=time.perf_counter() - t0))
        job.machine.to(JobState.RUNNING, f"{'scaled' if decision.why == 'scale' else 'grown back'} to "
                                         f"{job.group.size} workers")

    def _did_not_fit(self, step: int, decision: ResizeDecision, err: TopologyError) -> None:
        job, ep = self.job, [decision.old_ep, decision.ep]
        if decision.why == "scale":
            job.incidents.write(job.incidents.record("scale_failed", step=step, ep=ep, why=str(err)))
            job.machine.to(JobState.RUNNING, f"scaling to ep={decision.ep} did not fit ({err})")
            return
        self.grow_back_failures += 1
        self.shrunk_at = step  # the next try after grow_back_after_steps more steps
        job.incidents.write(job.incidents.record("grow_back_failed", step=step, rule="grow_back_failed", ep=ep,
                                                 why=str(err), attempt=self.grow_back_failures))
        stay = self.grow_back_failures >= job.cfg.fault_tolerance.grow_back_attempts
        job.machine.to(JobState.RUNNING, f"grow-back did not fit ({err}); "
                                         + ("staying shrunk" if stay else "trying again later"))
