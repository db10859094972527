"""The controller's recovery part: it carries out the failure policies' typed decisions. A guard trip gets the failure
ladder's `TripDecision` (k3ray.policies.ladder: roll back to the snapshot and skip batches, lower the learning rate,
or stop); lost workers get the recovery policy's `LossDecision` (k3ray.policies.recovery: hot spares take their
places, the grid shrinks to the survivors, or it starts again), in any state of the controller, carried out by the
grid rebuild serving's recovery uses too (k3ray.grid.rebuild, with training's steps: `RebuildFromSnapshot`).

Recovery and the first launch are bounded handlers of the state machine (k3ray.train.state): each attempt is a
transition into its state, a loss during an attempt starts the next one after a backoff, and the machine refuses the
attempt past the limit; then the job stops with one line naming what happened and where the incidents are
(`RecoveryFailed`). The grid in use is kept until the one replacing it is placed."""
from __future__ import annotations

import time
from typing import NoReturn

from k3ray.config import JobConfig
from k3ray.grid.calls import ObjectsLost, TopologyError, WorkerLost
from k3ray.grid.rebuild import GridRebuild
from k3ray.grid.snapshots import Snapshots
from k3ray.jobs.incidents import IncidentLog
from k3ray.policies import guards, ladder, recovery, retry
from k3ray.train.checkpointing import DurableCheckpoints
from k3ray.train.grid import TrainingGrid
from k3ray.train.placement import Placement
from k3ray.train.progress import TrainingProgress
from k3ray.train.scaling import Scaling
from k3ray.train.state import AttemptsExhausted, JobState, StateMachine


class GuardError(RuntimeError):
    """A blow-up the failure ladder could not get past; the job stops with this report."""


class RecoveryFailed(RuntimeError):
    """Lost workers the bounded recovery could not get past (its attempts spent, or nothing fits the alive nodes);
    the job stops with this one-line report."""


class Recovery:
    def __init__(self, cfg: JobConfig, progress: TrainingProgress, grid: TrainingGrid, table: Placement,
                 machine: StateMachine, snapshots: Snapshots, checkpoints: DurableCheckpoints, incidents: IncidentLog,
                 scaling: Scaling):
        """The controller's parts a recovery acts on: the progress it replays, the grid it replaces, the placement
        table it re-homes, the state machine it moves through, the snapshots it restores from, the checkpoint it
        abandons, the incidents it records and the scaling part it tells the size it left."""
        self.cfg, self.progress, self.grid, self.table, self.machine = cfg, progress, grid, table, machine
        self.snapshots, self.checkpoints, self.incidents, self.scaling = snapshots, checkpoints, incidents, scaling
        self._resuming: tuple[dict, float] | None = None  # the last recovery's incident and when it ended

    def launch(self, timeout_s: float, restore: dict | None) -> str:
        """The job's first grid, a bounded handler as a recovery is: a worker lost while it starts (died, or no
        answer within `timeout_s` on a loaded machine) closes it and launches anew after the backoff, up to
        fault_tolerance.recovery_attempts times; then the job stops in one line. Returns the backend."""
        ft, attempt = self.cfg.fault_tolerance, 0
        while True:
            attempt += 1
            try:
                return self.grid.launch(self.table.ep, self.table.home, timeout_s, restore=restore)
            except TopologyError:
                self.machine.to(JobState.ERRORED, "topology does not fit")
                raise
            except WorkerLost as lost:
                self.grid.close()
                self.incidents.add("launch_failed", step=self.progress.step, rule="other", why=str(lost),
                                   attempt=attempt)
                if attempt == ft.recovery_attempts:
                    self.machine.to(JobState.ERRORED, f"the workers did not start: {lost}")
                    raise RecoveryFailed(f"the workers did not start ({attempt} attempts; last: {lost}); stopping. "
                                         f"{self.incidents.where()}") from None
                time.sleep(retry.backoff_s(attempt, ft.retry_backoff_s))

    def replay(self, until: int) -> None:
        """Re-run the accepted steps snap.step .. until-1 on the batches they used (deterministic), from the committed
        snapshot or the job's start point."""
        snap, progress = self.snapshots.committed, self.progress
        progress.guard_state = snap.guard
        for s in range(snap.step, until):
            progress.guard_state = guards.accept(self.grid.run(s, progress.batches[s]), progress.guard_state)

    def resumed(self, since: float) -> None:
        """A step was accepted: when it is the first since a recovery, its seconds (the boundary's work and the
        step, counted from the recovery's end or from `since`, when the step was asked for, if later) go into the
        recovery's incident as `resumed_step`, written again (the last line wins)."""
        if self._resuming is None:
            return
        (incident, ended), self._resuming = self._resuming, None
        incident["seconds"]["resumed_step"] = time.perf_counter() - max(ended, since)
        self.incidents.write(incident)

    def rollback(self, step: int, batch: int, trip: guards.Trip, attempt: int) -> None:
        """Carry out the failure ladder's decision on the `attempt`-th guard trip of `step` (run on `batch`)."""
        t0, progress = time.perf_counter(), self.progress
        decision = ladder.on_trip(attempt, batch, progress.lr_scale, self.cfg.fault_tolerance)
        incident = self.incidents.add("blowup", action=decision.action, step=step, rule=trip.rule, layer=trip.layer,
                                      value=trip.value, detail=trip.detail, batch_ids=list(decision.skip),
                                      attempt=attempt)
        if decision.action == "stop":
            self.machine.to(JobState.ERRORED, f"step {step}: {attempt} guard trips")
            raise GuardError(f"step {step}: guard tripped {attempt} times (last: {trip.rule} = {trip.value} "
                             f"layer {trip.layer}; skipped batches {sorted(progress.skip)}; lr scale "
                             f"{progress.lr_scale}); stopping. {self.incidents.where()}")
        self.machine.to(JobState.RECOVERING, f"rollback: {trip.rule} at step {step}")
        # the decision in one piece, before anything that can fail: a worker lost from here on is recovered from
        # onto a grid that gets this skip and this scale together (never half a rollback)
        progress.skip.update(decision.skip)
        progress.lr_scale = decision.lr_scale
        self.snapshots.commit(self.grid.group, wait=True, timeout_s=self.cfg.fault_tolerance.wait_timeout_s)
        self.grid.restore_in_place(self.snapshots.committed.sources())
        self.table.drop_copies()  # the restored workers hold none
        incident["restore_seconds"] = time.perf_counter() - t0
        self.grid.group.call("set_lr_scale", progress.lr_scale)
        self.replay(step)
        incident["rollback_seconds"] = time.perf_counter() - t0  # restore + replay since the snapshot
        self.machine.to(JobState.RUNNING, f"rolled back to step {self.snapshots.committed.step}, skipping "
                                          f"{list(decision.skip)}")

    def recover(self, step: int, lost: WorkerLost, detected_after: float) -> None:
        """Recover from `lost` to the boundary before `step`, a bounded handler: each attempt (`_recover_once`) is a
        transition into recovering; a worker lost during one starts the next after the machine's backoff; past
        `fault_tolerance.recovery_attempts` (or when nothing fits the alive nodes) the job stops (RecoveryFailed)."""
        while True:
            try:
                self.machine.to(JobState.RECOVERING, str(lost))
            except AttemptsExhausted as spent:
                self.give_up(step, f"{spent}")
            try:
                self._recover_once(step, lost, detected_after)
                return
            except WorkerLost as again:
                lost, detected_after = again, 0.0
                time.sleep(self.machine.backoff_s())
            except TopologyError as err:
                self.give_up(step, f"recovering from {lost}: {err}")

    def give_up(self, step: int, what: str) -> NoReturn:
        self.snapshots.drop_pending()
        self.machine.to(JobState.ERRORED, what)
        self.incidents.add("stopped", step=step, rule="recovery_failed", why=what)
        raise RecoveryFailed(f"step {step}: recovery failed: {what}; stopping. {self.incidents.where()}")

    def _recover_once(self, step: int, lost: WorkerLost, detected_after: float) -> None:
        """One attempt: the grid the policy decides on rebuilt from the survivors' snapshots (k3ray.grid.rebuild: in
        place where it says so, survivors keeping their processes and ready spares taking lost ranks' places, no
        process started; else, or when that does not fit, launched anew), then replayed to `step`. A worker lost
        during it (the new grid's launch, restore or replay) raises WorkerLost for the next attempt."""
        t0 = time.perf_counter()
        snap = self._settle_snapshots(lost)
        silent = recovery.silent_nodes(self.grid.group.nodes, lost.ranks) if lost.hung else set()
        self.grid.avoid(silent)  # no spare on them either
        t_gathered = time.perf_counter()
        fields = dict(step=step, ranks=sorted(lost.ranks), why=lost.why,
                      rule="collective_timeout" if lost.hung else "worker_lost", silent_nodes=sorted(silent),
                      replayed_steps=[snap.step, step], attempt=self.machine.attempt)
        steps = RebuildFromSnapshot(self.cfg, self.grid, self.table, self.snapshots, self.incidents, fields)
        rebuilt = GridRebuild(steps, self.cfg.parallel.pp, bool(self.cfg.fault_tolerance.spares), off_lost_nodes=True,
                              decide_again_when_lost=False).run(lost, self.table.expert_load(self.progress.last_report))
        incident = steps.incident
        if self.snapshots.committed is not snap:  # its parts were lost with a node: the base was restored
            incident.update(replayed_steps=[self.snapshots.committed.step, step], snapshot_lost=snap.step)
        t_restored = time.perf_counter()
        try:
            self.replay(step)
        except WorkerLost as again:
            steps.failed(again)
            raise
        decision = rebuilt.decision
        self.scaling.after_recovery(step, decision.ep)
        incident["seconds"] = {
            "detection": detected_after, "find_snapshot": t_gathered - t0,
            "replan": rebuilt.planned_at - t_gathered, **rebuilt.phases,
            "launch_other": t_restored - rebuilt.planned_at - sum(rebuilt.phases.values()),
            "replay": time.perf_counter() - t_restored}
        self.incidents.write(incident)
        self._resuming = incident, time.perf_counter()
        self.machine.to(JobState.RUNNING, f"recovered on {decision.ep * self.cfg.parallel.pp} workers"
                                          + (f", {len(decision.spare_for)} of them hot spares" if decision.spare_for
                                             else ""))

    def _settle_snapshots(self, lost: WorkerLost):
        """The state to recover from: a snapshot started at this boundary is the newest, if every worker finished its
        part; what is still pending lacks a lost worker's part, and the pending checkpoint its writers. Returns the
        committed snapshot (or the job's start or newest durable checkpoint)."""
        try:
            self.snapshots.commit(self.grid.group, wait=True,
                                  timeout_s=min(30.0, self.cfg.fault_tolerance.wait_timeout_s), hold=False)
        except WorkerLost:  # a lost worker never delivered its part
            pass
        self.snapshots.drop_pending()
        self.checkpoints.abandon_pending(str(lost))  # its writers are gone: the new grid writes it again
        return self.snapshots.committed


class RebuildFromSnapshot:
    """Training's side of a grid rebuild (k3ray.grid.rebuild.RebuildSteps): every grid, rebuilt in place or launched
    anew, restores the committed snapshot (its base instead where its parts were lost with a node, before a
    neighbour's copy was made) and is brought up to date (`TrainingGrid.joined`), the placement table reset to the
    decision; each decision is a `worker_lost` incident (`incident`: the last one), written with its outcome when
    its build did not finish."""

    def __init__(self, cfg: JobConfig, grid: TrainingGrid, table: Placement, snapshots: Snapshots,
                 incidents: IncidentLog, fields: dict):
        """fields: the incidents' fields that every decision of this recovery shares (step, lost ranks, why...)."""
        self.cfg, self.grid, self.table, self.snapshots, self.incidents = cfg, grid, table, snapshots, incidents
        self.fields, self.sources = fields, snapshots.committed.sources()
        self.incident: dict = {}

    @property
    def group(self):
        return self.grid.group

    def planned(self, lost: WorkerLost, old_ep: int, decision: recovery.LossDecision,
                standbys_used: frozenset[int]) -> None:
        full = self.cfg.parallel.ep
        self.incident = self.incidents.record(
            "worker_lost", action=decision.action, **self.fields, standbys_used=sorted(standbys_used),
            ep=[old_ep, decision.ep], spares_used=sorted(decision.spare_for),
            dp_ranks_per_ep_rank=[recovery.dp_ranks_of(e, decision.ep, full) for e in range(decision.ep)])

    def regroup(self, lost: set[int], decision: recovery.LossDecision, on_phase) -> dict[str, float]:
        self.table.reset(decision.ep, decision.home.tolist())
        return self._restored(lambda: self.grid.regroup(lost, decision, self.sources, on_phase))

    def launch(self, decision: recovery.LossDecision, on_phase) -> dict[str, float]:
        home = decision.home.tolist()
        self.table.reset(decision.ep, home)
        return self._restored(lambda: self.grid.launch(decision.ep, home, 60.0, self.sources, wait_for_spares=False,
                                                       on_phase=on_phase))

    def failed(self, err: TopologyError | WorkerLost) -> None:
        self.incident["outcome"] = f"{'interrupted' if isinstance(err, WorkerLost) else 'did not fit'}: {err}"
        self.incidents.write(self.incident)

    def _restored(self, build) -> dict[str, float]:
        """build() (a grid restoring the snapshot), the base restored instead where the snapshot's parts were lost,
        then the grid brought up to date. Returns its launch's phases in seconds."""
        try:
            build()
        except ObjectsLost:
            self.grid.restore_in_place(self.snapshots.fall_back().sources())
        self.grid.joined()
        return self.grid.group.launch_seconds
