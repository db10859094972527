"""The job controller: one per job. It owns the topology and its parts, each with its own state:

    progress     step, data order, skipped batches, learning-rate scale, guard statistics (k3ray.train.progress)
    machine      JobState and the transition table (k3ray.train.state)
    table        the expert placement table and load history (k3ray.train.placement)
    policies     live policies, queued changes and their audit (k3ray.jobs.live_policies)
    snapshots    in-memory snapshots (k3ray.grid.snapshots)
    checkpoints  durable checkpoints (k3ray.train.checkpointing)
    drills       fault drills (k3ray.train.drills)
    grid         the worker group in use, a step run on it, the next group made (k3ray.train.grid)
    incidents    the incident log (k3ray.jobs.incidents)
    recovery     carries out the failure policies' decisions: rollback, lost workers (k3ray.train.failures)
    scaling      carries out the resize policy's decisions: `k3ray scale`, grow-back (k3ray.train.scaling)
    boundary     what happens between steps and at the end: policies, scaling, snapshot, checkpoint
                 (k3ray.train.boundary)

One step reads `train_step`: the boundary (`boundary.before`), the step on the grid (`grid.run`), the guards, and
on a trip or a lost worker the recovery part. The job's state is `machine.state`, its history `machine.history`.
Each part is handed the parts it acts on when it is made, never the controller. Decisions come from
k3ray.policies (guards, the failure ladder, shrink-or-restart, resize, re-homing); the controller and its parts
carry them out.
`Controller` is plain Python: its tests give it a fake worker group; `ControllerActor` is the same class as a Ray
actor, which is how jobs run it.
"""
from __future__ import annotations

import functools
import logging
import threading
import time

import ray

from k3ray.config import JobConfig
from k3ray.jobs.incidents import IncidentLog
from k3ray.jobs.live_policies import LivePolicies
from k3ray.train.boundary import StepBoundary
from k3ray.train.callbacks import Callback, ConsoleWarnings, notify
from k3ray.train.checkpointing import DurableCheckpoints
from k3ray.train.drills import FaultInjector
from k3ray.train.failures import GuardError, Recovery  # noqa: F401 - GuardError: API
from k3ray.train.grid import TrainingGrid
from k3ray.train.placement import Placement
from k3ray.train.progress import TrainingProgress
from k3ray.train.scaling import Scaling
from k3ray.train.snapshot_cadence import SnapshotCadence
from k3ray.grid.snapshots import Snapshots
from k3ray.train.state import JobState, StateMachine
from k3ray.grid.calls import WorkerLost
from k3ray.grid.worker_group import WorkerGroup
from k3ray.io.checkpoint import CheckpointError
from k3ray.policies import guards

log = logging.getLogger("k3ray.controller")


def holding_the_grid(method):
    """One call at a time on the grid: the actor is threaded (the control API's calls run beside the step loop), and
    a call that reaches workers mid-step or mid-recovery would meet a grid being rebuilt."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self.grid_lock:
            return method(self, *args, **kwargs)
    return call


def go_back_to_checkpoint(snapshots: Snapshots, checkpoints: DurableCheckpoints, step: int) -> None:
    """A durable checkpoint of `step` committed: the state to go back to when no newer snapshot is held (one that
    does not load, damaged since its commit, is not: the older one stays)."""
    try:
        snapshots.durable(checkpoints.start_point(step))
    except CheckpointError as err:
        log.warning("checkpoint of step %d is no state to go back to: %s", step, err)


class Controller:
    def __init__(self, cfg: JobConfig | dict, callbacks: list[Callback] = (), group_factory=WorkerGroup):
        """group_factory: (cfg, ep, home, avoid_nodes) -> a worker group (the tests' fakes, or WorkerGroup)."""
        self.cfg = cfg if isinstance(cfg, JobConfig) else JobConfig.model_validate(cfg)
        cfg, ft = self.cfg, self.cfg.fault_tolerance
        self.incidents = IncidentLog(ft.incidents_file)
        self.callbacks = list(callbacks)
        self.machine = StateMachine({JobState.RECOVERING: ft.recovery_attempts}, backoff_s=ft.retry_backoff_s)
        self.table = Placement(cfg)
        self.policies = LivePolicies(cfg.policies)
        self.grid_lock = threading.RLock()  # see holding_the_grid
        self.snapshots = Snapshots(on_commit=lambda snap: notify(self.callbacks, "on_snapshot", snap.stall_seconds),
                                   on_skip=lambda step, arriving: self.incidents.add(
                                       "snapshot_skipped", step=step, still_arriving=arriving),
                                   timeout_s=ft.wait_timeout_s)
        self.drills = FaultInjector(ft.faults)
        self.checkpoints = DurableCheckpoints(
            cfg.checkpoint,
            on_commit=[self.drills.on_checkpoint, lambda *a: notify(self.callbacks, "on_checkpoint", *a),
                       lambda step, *_: go_back_to_checkpoint(self.snapshots, self.checkpoints, step)],
            on_incident=self.incidents.add,
            timeout_s=ft.wait_timeout_s, job=cfg.name)
        self.warnings = ConsoleWarnings(self.checkpoints.warnings, self.snapshots.warnings)
        self.progress = TrainingProgress(skip=set(cfg.data.skip_batches))
        self.grid = TrainingGrid(cfg, group_factory, self.table, self.progress, self.snapshots, self.drills)
        parts = (cfg, self.progress, self.grid, self.table, self.machine, self.snapshots, self.checkpoints,
                 self.incidents)
        self.scaling = Scaling(*parts)
        self.recovery = Recovery(*parts, self.scaling)
        self.cadence = SnapshotCadence(ft)
        self.boundary = StepBoundary(cfg, self.progress, self.grid, self.table, self.policies, self.drills,
                                     self.scaling, self.snapshots, self.cadence, self.checkpoints, self.recovery)

    # -- topology ------------------------------------------------------------------------------------------------
    @holding_the_grid
    def start(self, placement_timeout_s: float = 60.0, resume: bool = False, fresh: bool = False,
              resume_from: str | None = None) -> dict:
        """Launch the workers (from the newest verified checkpoint with `resume`: of this job's checkpoint folder, or
        of `resume_from`; `fresh`: from step 0 when none verifies). The status it returns carries the checkpoint
        warnings for the driver to show."""
        par = self.cfg.parallel
        why = f"pp={par.pp} ep={par.ep}"
        job = self.cfg.model_dump(mode="json")
        try:
            self.checkpoints.claim(job, resume_from)
            resumed = self.checkpoints.resume(job, fresh, resume_from) if resume or resume_from else None
        except CheckpointError:
            self.machine.to(JobState.ERRORED, "checkpoint folder refused")
            raise
        if resumed is not None:
            self.progress.resume(resumed.step, resumed.meta)
            why += f", resuming from {resumed.path} (step {resumed.step}, ep {resumed.meta['ep']} -> {self.table.ep})"
        self.machine.to(JobState.SCHEDULING, why)
        sources = None if resumed is None else resumed.sources
        backend = self.recovery.launch(placement_timeout_s, sources)
        self.snapshots.start_at(self.progress.step, self.progress.guard_state, sources)
        self.cadence.start_at(self.progress.step)
        self.grid.push_policies()
        if resumed is not None:
            self.grid.group.call("set_lr_scale", self.progress.lr_scale)
        self.machine.to(JobState.RUNNING, f"{self.grid.group.size} workers, backend {backend}")
        notify(self.callbacks, "on_start", self)
        return {**self.status(), "warnings": self.warnings.new()}

    # -- steps ---------------------------------------------------------------------------------------------------
    @holding_the_grid
    def train_step(self, step: int, batch_index: int | None = None, ahead: bool = False) -> dict:
        """Run `step` to an accepted report: snapshot on schedule, inject due fault drills, recover from lost
        workers, roll back and skip batches on a guard trip, grow back when capacity returns. `batch_index`, if
        given, must be the batch the controller's data order assigns (it owns the order because of skips).
        `ahead`: the caller's next call is the next step (no evaluation between): the workers may run its
        micro-batches while this step's report comes back (redone, the same, if the data order or anything else
        changes meanwhile).

        A worker lost anywhere in here (the boundary's policy push, grow-back, snapshot or checkpoint, the step,
        a rollback) is recovered from, and the boundary is done again on the new grid."""
        t0 = time.perf_counter()
        progress, grid = self.progress, self.grid
        attempts, at_boundary = 0, True
        # Not ahead of a snapshot: with the next step's work queued on the device, the staging at the next boundary
        # held training 334-340 ms (a step's forward and backward, H100), most likely waiting behind that work;
        # without it the work follows the staging's copies, and the step's report comes back ~10 ms later.
        ahead = ahead and not self.boundary.takes_snapshot(step + 1)
        while True:
            t_attempt = time.perf_counter()
            try:
                if at_boundary:
                    try:
                        self.boundary.before(step)
                    except CheckpointError:  # checkpoint.max_failures_in_a_row writes failed: the job stops
                        self.machine.to(JobState.ERRORED, "checkpoint writes keep failing")
                        raise
                    at_boundary = False
                self.drills.before_attempt(grid.group, step,
                                           settle=lambda: self.snapshots.commit(grid.group, wait=True))
                batch = progress.batch_for(step)
                if batch_index is not None and attempts == 0 and batch != batch_index:
                    raise ValueError(f"step {step}: batch {batch_index} requested, data order gives {batch}")
                try:
                    report = grid.run(step, batch, progress.batch_after(batch) if ahead else None)
                finally:
                    self.drills.after_attempt(grid.group)
                gp = self.cfg.policies.guards
                trip = guards.check(report, progress.guard_state, gp) if gp.enabled else None
                if trip is None:
                    break
                attempts += 1
                self.recovery.rollback(step, batch, trip, attempts)
            except WorkerLost as lost:
                self.recovery.recover(step, lost, detected_after=time.perf_counter() - t_attempt)
                at_boundary = True
        progress.accept(step, batch, report)
        self.snapshots.optimizer_waited(step, report["timings"].get("snapshot_wait", 0.0))
        self.recovery.resumed(since=t0)
        self.table.track(report)
        self.drills.kill_at(grid.group, step, "after_step")
        grid.after_step()
        try:
            self.snapshots.commit(grid.group, wait=False)
            self.table.rebalance_on_schedule(grid.group, progress.step, self.incidents)
        except WorkerLost as lost:  # after the step: the state to recover is the boundary before progress.step
            self.recovery.recover(progress.step, lost, detected_after=0.0)
        self.cadence.after_step(report["timings"].get("total"), self.snapshots)
        notify(self.callbacks, "on_step", self, report, time.perf_counter() - t0)
        warnings = self.warnings.new()
        return {**report, "warnings": warnings} if warnings else report

    # -- policies and placement ----------------------------------------------------------------------------------
    def get_policies(self, name: str | None = None) -> dict:
        return self.policies.get(name)

    def set_policy(self, name: str, params: dict, source: str = "python") -> dict:
        return self.policies.set(name, params, source, self.progress.step)

    def audit_log(self) -> list[dict]:
        return self.policies.audit_log()

    @holding_the_grid
    def move_experts(self, expert_ids: list[int], dst_ep_rank: int) -> dict:
        """Move experts' shards (weights and optimizer moments, every layer) to another EP rank of each stage."""
        new_home = list(self.table.home)
        for e in expert_ids:
            new_home[e] = dst_ep_rank
        self.table.rehome(self.grid.group, new_home)
        return self.placement()

    def request_scale(self, ep) -> dict:
        """Resize the grid to pp x ep at the next step boundary (`k3ray scale --ep N`, `Scaling.request`)."""
        return self.scaling.request(ep, self.progress.step)

    def request_checkpoint(self) -> dict:
        return self.checkpoints.request(self.progress.step)

    # -- views ---------------------------------------------------------------------------------------------------
    def status(self) -> dict:
        par, progress = self.cfg.parallel, self.progress
        out = {"name": self.cfg.name, "state": self.machine.state.value, "step": progress.step, "pp": par.pp,
               "ep": self.table.ep, "ep_configured": par.ep, "ep_target": self.scaling.target_ep,
               "workers": par.pp * self.table.ep, "device": par.device,
               **self.grid.holdings(),
               "skipped_batches": sorted(progress.skip), "lr_scale": progress.lr_scale,
               "loss": None if progress.last_report is None else progress.last_report["loss"],
               "api_url": None, "tokens_per_s": None,
               "snapshots": {**self.snapshots.summary(), "every": self.cadence.interval},
               "transitions": [{"time": t, "state": s, "why": w} for t, s, w in self.machine.history]}
        for callback in self.callbacks:
            out.update(callback.status())
        return out

    def placement(self) -> dict:
        return self.table.view(self.progress.last_report)

    def get_incidents(self) -> list[dict]:
        return list(self.incidents)

    def list_checkpoints(self) -> list[dict]:
        return list(self.checkpoints.committed)

    @holding_the_grid
    def evaluate(self) -> float:
        """The validation loss; a worker lost meanwhile is recovered from and the evaluation run again, at most
        `fault_tolerance.recovery_attempts` times."""
        ft = self.cfg.fault_tolerance
        for attempt in range(1, ft.recovery_attempts + 1):
            try:
                return self.grid.group.call("evaluate", timeout_s=ft.wait_timeout_s)[0]
            except WorkerLost as lost:
                if attempt == ft.recovery_attempts:
                    self.recovery.give_up(self.progress.step, f"evaluation lost workers {attempt} times (last: {lost})")
                self.recovery.recover(self.progress.step, lost, detected_after=0.0)

    @holding_the_grid
    def shutdown(self) -> None:
        """Commit the pending checkpoint, write the final one (`DurableCheckpoints.at_end`; a worker lost meanwhile
        is recovered from once and the checkpoint written by the new grid), stop the workers. Never raises for a
        checkpoint: the job may be stopping because of an error, which a second one must not mask."""
        step = self.progress.step
        try:
            if self.grid.group is not None and self.machine.state == JobState.RUNNING and step > 0:
                self.boundary.at_end(step)
        except (CheckpointError, WorkerLost) as err:
            log.warning("no final checkpoint: %s", err)
        finally:
            notify(self.callbacks, "on_shutdown", self)
            self.grid.close()
            if not self.machine.done:
                self.machine.to(JobState.FINISHED)


# The same class as a Ray actor: one per job, threaded so the control API's calls run beside the step loop.
ControllerActor = ray.remote(num_cpus=0, max_concurrency=8)(Controller)
