"""The job controller: one per job. It owns the topology, the training progress (step, data order, skipped batches,
learning-rate scale, guard statistics) and its parts, each with its own state:

    machine      JobState and the transition table (k3ray.train.state)
    table        the expert placement table and load history (k3ray.train.placement)
    policies     live policies, queued changes and their audit (k3ray.train.live_policies)
    snapshots    in-memory snapshots (k3ray.grid.snapshots)
    checkpoints  durable checkpoints (k3ray.train.checkpointing)
    drills       fault drills (k3ray.train.drills)
    group        the worker grid, the only part that talks to workers (k3ray.grid.worker_group)
    incidents    the incident log (k3ray.train.incidents)
    recovery     carries out the failure policies' decisions: rollback, lost workers (k3ray.train.failures)
    scaling      carries out the resize policy's decisions: `k3ray scale`, grow-back (k3ray.train.scaling)

One step reads `train_step`: the boundary (`_boundary`: policies, scaling, snapshot, checkpoint), the step on the
grid (`run`), the guards, and on a trip or a lost worker the recovery part. Decisions come from k3ray.policies
(guards, the failure ladder, shrink-or-restart, resize, re-homing); the controller and its parts carry them out.
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
from k3ray.train.callbacks import Callback
from k3ray.train.checkpointing import DurableCheckpoints, Resumed
from k3ray.train.drills import FaultInjector
from k3ray.train.failures import GuardError, Recovery  # noqa: F401 - GuardError: API
from k3ray.train.incidents import IncidentLog
from k3ray.train.live_policies import LivePolicies
from k3ray.train.placement import Placement
from k3ray.train.scaling import Scaling
from k3ray.grid.snapshots import Snapshots
from k3ray.train.state import JobState, StateMachine
from k3ray.grid.calls import WorkerLost
from k3ray.grid.worker_group import WorkerGroup
from k3ray.io import checkpoint as ckpt
from k3ray.io.checkpoint import CheckpointError
from k3ray.parallel.step import StepReport
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


class Controller:
    def __init__(self, cfg: JobConfig | dict, callbacks: list[Callback] = (), group_factory=WorkerGroup):
        self.cfg = cfg if isinstance(cfg, JobConfig) else JobConfig.model_validate(cfg)
        cfg = self.cfg
        self.group_factory = group_factory  # (cfg, ep, home, avoid_nodes) -> a worker group
        self.group = None
        self.incidents = IncidentLog(cfg.fault_tolerance.incidents_file)
        self.callbacks = list(callbacks)
        ft = cfg.fault_tolerance
        self.machine = StateMachine({JobState.RECOVERING: ft.recovery_attempts}, backoff_s=ft.retry_backoff_s)
        self.table = Placement(cfg)
        self.policies = LivePolicies(cfg.policies)
        self.grid_lock = threading.RLock()  # see holding_the_grid
        self.snapshots = Snapshots(on_commit=lambda snap: self._notify("on_snapshot", snap.stall_seconds),
                                   on_skip=lambda step, arriving: self.incidents.write(self.incidents.record(
                                       "snapshot_skipped", step=step, still_arriving=arriving)),
                                   timeout_s=ft.wait_timeout_s)
        self.drills = FaultInjector(cfg.fault_tolerance.faults)
        self.checkpoints = DurableCheckpoints(
            cfg.checkpoint, on_commit=[self.drills.on_checkpoint, lambda *a: self._notify("on_checkpoint", *a)],
            on_incident=lambda kind, **fields: self.incidents.write(self.incidents.record(kind, **fields)),
            timeout_s=ft.wait_timeout_s, job=cfg.name)
        # training progress: what a replay, a snapshot or a checkpoint must reproduce
        self.step = 0
        self.skip: set[int] = set(cfg.data.skip_batches)  # batch indices never trained on
        self.batches: dict[int, int] = {}  # step -> batch index it trained on
        self.guard_state = guards.GuardState()
        self.lr_scale = 1.0
        self.last_report: dict | None = None
        self.scale_to: int | None = None  # EP size asked for (`request_scale`), applied at the next step boundary
        self.recovery = Recovery(self)
        self.scaling = Scaling(self)
        self._warned = (0, 0)  # checkpoint and snapshot warnings handed to the driver so far

    @property
    def state(self) -> JobState:
        return self.machine.state

    @property
    def transitions(self) -> list[tuple[float, str, str]]:
        return self.machine.history

    def _notify(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)

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
            self._resume_from(resumed)
            why += f", resuming from {resumed.path} (step {resumed.step}, ep {resumed.meta['ep']} -> {self.table.ep})"
        self.machine.to(JobState.SCHEDULING, why)
        backend = self.recovery.launch(placement_timeout_s, None if resumed is None else resumed.sources)
        self._push_policies()
        if resumed is not None:
            self.group.call("set_lr_scale", self.lr_scale)
        self.machine.to(JobState.RUNNING, f"{self.group.size} workers, backend {backend}")
        self._notify("on_start", self)
        return {**self.status(), "warnings": self._new_warnings()}

    def _new_warnings(self) -> list[str]:
        """Checkpoint and snapshot warnings not yet handed to the driver (which shows them on the user's console)."""
        new = self.checkpoints.warnings[self._warned[0]:] + self.snapshots.warnings[self._warned[1]:]
        self._warned = (len(self.checkpoints.warnings), len(self.snapshots.warnings))
        return new

    def _resume_from(self, resumed: Resumed) -> None:
        meta = resumed.meta
        self.step = resumed.step
        if meta["last_batch"] is not None:
            self.batches[resumed.step - 1] = meta["last_batch"]
        self.skip |= set(meta["skip"])
        self.lr_scale = meta["lr_scale"]
        self.guard_state = guards.GuardState(**{k: v for k, v in meta["guard_state"].items() if k != "history"})

    def _progress(self, step: int) -> dict:
        """What a checkpoint of the boundary before `step` records beside the workers' parts."""
        return {"pp": self.cfg.parallel.pp, "ep": self.table.ep, "home": list(self.table.home),
                "last_batch": self.batches.get(step - 1), "skip": sorted(self.skip), "lr_scale": self.lr_scale,
                "guard_state": {k: v for k, v in vars(self.guard_state).items() if k != "history"},
                "job": self.cfg.name, "config": self.cfg.model_dump(mode="json"),
                "model_hash": ckpt.model_hash(self.cfg.model_dump(mode="json")),
                # steps 0..step-1 each trained one global batch; skipped batches were read past, not trained on
                "tokens_consumed": step * self.cfg.global_batch_sequences * self.cfg.data.seq_len,
                "samples_read": (self.batches.get(step - 1, -1) + 1) * self.cfg.global_batch_sequences}

    # -- steps ---------------------------------------------------------------------------------------------------
    @holding_the_grid
    def train_step(self, step: int, batch_index: int | None = None) -> dict:
        """Run `step` to an accepted report: snapshot on schedule, inject due fault drills, recover from lost
        workers, roll back and skip batches on a guard trip, grow back when capacity returns. `batch_index`, if
        given, must be the batch the controller's data order assigns (it owns the order because of skips).

        A worker lost anywhere in here (the boundary's policy push, grow-back, snapshot or checkpoint, the step,
        a rollback) is recovered from, and the boundary is done again on the new grid."""
        t0 = time.perf_counter()
        attempts, at_boundary = 0, True
        while True:
            t_attempt = time.perf_counter()
            try:
                if at_boundary:
                    try:
                        self._boundary(step)
                    except CheckpointError:  # checkpoint.max_failures_in_a_row writes failed: the job stops
                        self.machine.to(JobState.ERRORED, "checkpoint writes keep failing")
                        raise
                    at_boundary = False
                self.drills.before_attempt(self.group, step,
                                           settle=lambda: self.snapshots.commit(self.group, wait=True))
                batch = self._batch_for(step)
                if batch_index is not None and attempts == 0 and batch != batch_index:
                    raise ValueError(f"step {step}: batch {batch_index} requested, data order gives {batch}")
                try:
                    report = self.run(step, batch)
                finally:
                    self.drills.after_attempt(self.group)
                gp = self.cfg.policies.guards
                trip = guards.check(report, self.guard_state, gp) if gp.enabled else None
                if trip is None:
                    break
                attempts += 1
                self.recovery.rollback(step, batch, trip, attempts)
            except WorkerLost as lost:
                self.recovery.recover(step, lost, detected_after=time.perf_counter() - t_attempt)
                at_boundary = True
        self.guard_state = guards.accept(report, self.guard_state)
        self.batches[step] = batch
        self.step = step + 1
        self.last_report = report
        self.table.track(report)
        self.drills.kill_at(self.group, step, "after_step")
        if len(self.group.spares) < self.cfg.fault_tolerance.spares:
            # spares that replaced lost workers (or found no room before): started once the step is done, so that
            # they do not slow the recovery they are started after
            self.group.start_spares()
        try:
            self.snapshots.commit(self.group, wait=False)
            rp = self.cfg.policies.replication
            if rp.enabled and self.step % rp.every_n_steps == 0:
                self._rebalance()
        except WorkerLost as lost:  # after the step: the state to recover is the boundary before self.step
            self.recovery.recover(self.step, lost, detected_after=0.0)
        self._notify("on_step", self, report, time.perf_counter() - t0)
        warnings = self._new_warnings()
        return {**report, "warnings": warnings} if warnings else report

    def _boundary(self, step: int) -> None:
        """What happens between steps: queued policy changes, growing back, the snapshot and checkpoint due."""
        self.drills.kill_at(self.group, step, "boundary")
        if self.policies.take_pending(step):
            self._push_policies()
        asked, self.scale_to = self.scale_to, None
        self.scaling.at_boundary(step, asked)
        if self.snapshots.due(step, self.cfg.fault_tolerance.snapshot_every):
            self.snapshots.take(self.group, step, self.guard_state)
        self.checkpoints.boundary(self.group, step, lambda: self._progress(step))

    def _batch_for(self, step: int) -> int:
        """The next batch index after the previous step's, passing over skipped ones."""
        b = self.batches[step - 1] + 1 if step - 1 in self.batches else step
        while b in self.skip:
            b += 1
        return b

    def run(self, step: int, batch: int) -> dict:
        """`step` on `batch` on the grid: the workers' reports merged into one (no guards, no bookkeeping)."""
        reports = self.group.run_step(step, batch, self.cfg.parallel.collective_timeout_s + 30.0)
        return merge_reports(step, batch, reports, self.table.ep, self.cfg.step_tokens()).to_dict()

    def _rebalance(self) -> None:
        before = self.table.copies
        moved, copies = self.table.rebalance(self.group)
        if moved or copies != before:
            self.incidents.record("rebalance", step=self.step, moved=moved, copies=copies)
            log.info("rebalance at step %d moved experts %s, copies %s", self.step, moved, copies)

    # -- policies and placement ----------------------------------------------------------------------------------
    def _push_policies(self) -> None:
        self.group.call("set_policies", self.cfg.policies.model_dump())

    def joined(self) -> None:
        """A grid that has just taken the snapshot's state (recovered or resized): drills due on it, live policies,
        the learning-rate scale, the neighbours' snapshot copies."""
        self.drills.kill_at(self.group, self.step, "relaunch")
        self._push_policies()
        self.group.call("set_lr_scale", self.lr_scale)
        snap = self.snapshots.committed
        self.group.transfer.hold_peer_snapshots(snap.step, snap.refs)  # re-pin on the new grid

    def get_policies(self, name: str | None = None) -> dict:
        return self.policies.get(name)

    def set_policy(self, name: str, params: dict, source: str = "python") -> dict:
        return self.policies.set(name, params, source, self.step)

    def audit_log(self) -> list[dict]:
        return self.policies.audit_log()

    @holding_the_grid
    def move_experts(self, expert_ids: list[int], dst_ep_rank: int) -> dict:
        """Move experts' shards (weights and optimizer moments, every layer) to another EP rank of each stage."""
        new_home = list(self.table.home)
        for e in expert_ids:
            new_home[e] = dst_ep_rank
        self.table.rehome(self.group, new_home)
        return self.placement()

    def request_scale(self, ep) -> dict:
        """Resize the grid to pp x ep at the next step boundary (`k3ray scale --ep N`), through the recovery's paths
        with the global batch kept, so the results do not change. ValueError naming the field for a bad ep."""
        full = self.cfg.parallel.ep
        if isinstance(ep, bool) or not isinstance(ep, int) or not 1 <= ep <= full:
            raise ValueError(f"ep: must be a whole number from 1 to parallel.ep={full} (the data-parallel width), "
                             f"got {ep!r}")
        self.scale_to = ep
        return {"ep": [self.table.ep, ep], "applies_at_step": self.step}

    def request_checkpoint(self) -> dict:
        return self.checkpoints.request(self.step)

    # -- views ---------------------------------------------------------------------------------------------------
    def status(self) -> dict:
        par = self.cfg.parallel
        out = {"name": self.cfg.name, "state": self.state.value, "step": self.step, "pp": par.pp,
               "ep": self.table.ep, "ep_configured": par.ep, "ep_target": self.scaling.target_ep,
               "workers": par.pp * self.table.ep, "device": par.device,
               "spares": 0 if self.group is None else len(self.group.spares),
               "skipped_batches": sorted(self.skip), "lr_scale": self.lr_scale,
               "loss": None if self.last_report is None else self.last_report["loss"],
               "api_url": None, "tokens_per_s": None,
               "transitions": [{"time": t, "state": s, "why": w} for t, s, w in self.transitions]}
        for callback in self.callbacks:
            out.update(callback.status())
        return out

    def placement(self) -> dict:
        return self.table.view(self.last_report)

    def get_incidents(self) -> list[dict]:
        return list(self.incidents)

    def list_checkpoints(self) -> list[dict]:
        return list(self.checkpoints.committed)

    @holding_the_grid
    def worker_states(self) -> list[dict]:
        """Every worker's current state (for inspection and tests)."""
        return self.group.call("state")

    @holding_the_grid
    def evaluate(self) -> float:
        """The validation loss; a worker lost meanwhile is recovered from and the evaluation run again, at most
        `fault_tolerance.recovery_attempts` times."""
        ft = self.cfg.fault_tolerance
        for attempt in range(1, ft.recovery_attempts + 1):
            try:
                return self.group.call("evaluate", timeout_s=ft.wait_timeout_s)[0]
            except WorkerLost as lost:
                if attempt == ft.recovery_attempts:
                    self.recovery.give_up(self.step, f"evaluation lost workers {attempt} times (last: {lost})")
                self.recovery.recover(self.step, lost, detected_after=0.0)

    @holding_the_grid
    def shutdown(self) -> None:
        """Commit the pending checkpoint, write the final one, stop the workers. Never raises for a checkpoint:
        the job may be stopping because of an error, which a second one must not mask."""
        try:
            if self.group is not None and self.state == JobState.RUNNING and self.step > 0:
                self._final_checkpoint()
        except CheckpointError as err:
            log.warning("no final checkpoint: %s", err)
        finally:
            self._notify("on_shutdown", self)
            if self.group is not None:
                self.group.close()
                self.group = None
            if not self.machine.done:
                self.machine.to(JobState.FINISHED)

    def _final_checkpoint(self) -> None:
        """Commit the pending checkpoint and write the final one (`checkpoint.at_end`); a worker lost meanwhile is
        recovered from once and the checkpoint written by the new grid."""
        for attempt in (1, 2):
            try:
                final = self.cfg.checkpoint.at_end and not any(c["step"] == self.step
                                                               for c in self.checkpoints.committed)
                if final or self.checkpoints.requested:
                    self.checkpoints.request(self.step)
                    self.checkpoints.boundary(self.group, self.step, lambda: self._progress(self.step))
                self.checkpoints.commit_pending(self.group)
                return
            except WorkerLost as lost:
                if attempt == 2:
                    log.warning("no final checkpoint: %s", lost)
                    return
                self.recovery.recover(self.step, lost, detected_after=0.0)


def merge_reports(step: int, batch_index: int, reports: list[dict], ep: int, tokens: int) -> StepReport:
    """The step report of a grid with `ep` EP ranks per stage from its workers' reports (world-rank order)."""
    tpe, rank_load, balance, acts = {}, {}, {}, {}
    for i, r in enumerate(reports):
        if i % ep == 0:  # every EP rank of a stage holds the same gathered counts
            tpe.update(r["tokens_per_expert"])
            rank_load.update(r["rank_load"])
            balance.update(r.get("balance", {}))
        for layer, a in r["activations"].items():
            prev = acts.get(layer)
            acts[layer] = a if prev is None else {k: max(prev[k], a[k]) for k in a}
    phases = reports[0]["timings"].keys()
    timings = {k: max(r["timings"][k] for r in reports) for k in phases}
    return StepReport(step=step, batch_index=batch_index, loss=reports[0]["loss"], grad_norm=reports[0]["grad_norm"],
                      lr=reports[0]["lr"], tokens=tokens, tokens_per_expert=tpe, activations=acts, timings=timings,
                      rank_load=rank_load, balance=balance)


# The same class as a Ray actor: one per job, threaded so the control API's calls run beside the step loop.
ControllerActor = ray.remote(num_cpus=0, max_concurrency=8)(Controller)
