"""The controller's recovery part: it carries out the failure policies' typed decisions. A guard trip gets the failure
ladder's `TripDecision` (k3ray.policies.ladder: roll back to the snapshot and skip batches, lower the learning rate,
or stop); lost workers get the recovery policy's `LossDecision` (k3ray.policies.recovery: hot spares take their
places, the grid shrinks to the survivors, or it starts again), in any state of the controller.

Recovery and the first launch are bounded handlers of the state machine (k3ray.train.state): each attempt is a
transition into its state, a loss during an attempt starts the next one after a backoff, and the machine refuses the
attempt past the limit; then the job stops with one line naming what happened and where the incidents are
(`RecoveryFailed`). The grid in use is kept until the one replacing it is placed."""
from __future__ import annotations

import time

import torch

from k3ray.grid.calls import TopologyError, WorkerLost
from k3ray.policies import guards, ladder, recovery
from k3ray.train.state import AttemptsExhausted, JobState


class GuardError(RuntimeError):
    """A blow-up the failure ladder could not get past; the job stops with this report."""


class RecoveryFailed(RuntimeError):
    """Lost workers the bounded recovery could not get past (its attempts spent, or nothing fits the alive nodes);
    the job stops with this one-line report."""


class Recovery:
    def __init__(self, job):
        """job: the controller (k3ray.train.controller): its progress, grid, snapshots and checkpoints."""
        self.job = job
        self.avoid_nodes: set[str] = set()  # nodes found silent (Ray may still report them alive): never placed on

    def new_group(self, ep: int, home: list[int]):
        return self.job.group_factory(self.job.cfg, ep, home, frozenset(self.avoid_nodes))

    def launch(self, timeout_s: float, restore: dict | None) -> str:
        """The job's first grid, a bounded handler as a recovery is: a worker lost while it starts (died, or no
        answer within `timeout_s` on a loaded machine) closes it and launches anew after the backoff, up to
        fault_tolerance.recovery_attempts times; then the job stops in one line. Returns the backend."""
        job = self.job
        ft, attempt = job.cfg.fault_tolerance, 0
        while True:
            attempt += 1
            job.group = self.new_group(job.table.ep, job.table.home)
            try:
                return job.group.launch(timeout_s, restore=restore)
            except TopologyError:
                job.machine.to(JobState.ERRORED, "topology does not fit")
                raise
            except WorkerLost as lost:
                job.group.close()
                job.incidents.write(job.incidents.record("launch_failed", step=job.step, rule="other", why=str(lost),
                                                         attempt=attempt))
                if attempt == ft.recovery_attempts:
                    job.machine.to(JobState.ERRORED, f"the workers did not start: {lost}")
                    raise RecoveryFailed(f"the workers did not start ({attempt} attempts; last: {lost}); stopping. "
                                         f"{job.incidents.where()}") from None
                time.sleep(min(30.0, ft.retry_backoff_s * 2 ** (attempt - 1)))

    def replay(self, until: int) -> None:
        """Re-run the accepted steps snap.step .. until-1 on the batches they used (deterministic)."""
        job = self.job
        snap = job.snapshots.committed
        job.guard_state = snap.guard
        for s in range(snap.step, until):
            job.guard_state = guards.accept(job.run(s, job.batches[s]), job.guard_state)

    def rollback(self, step: int, batch: int, trip: guards.Trip, attempt: int) -> None:
        """Carry out the failure ladder's decision on the `attempt`-th guard trip of `step` (run on `batch`)."""
        job = self.job
        t0 = time.perf_counter()
        decision = ladder.on_trip(attempt, batch, job.lr_scale, job.cfg.fault_tolerance)
        incident = job.incidents.record("blowup", action=decision.action, step=step, rule=trip.rule,
                                        layer=trip.layer, value=trip.value, detail=trip.detail,
                                        batch_ids=list(decision.skip), attempt=attempt)
        job.incidents.write(incident)
        if decision.action == "stop":
            job.machine.to(JobState.ERRORED, f"step {step}: {attempt} guard trips")
            raise GuardError(f"step {step}: guard tripped {attempt} times (last: {trip.rule} = {trip.value} "
                             f"layer {trip.layer}; skipped batches {sorted(job.skip)}; lr scale {job.lr_scale}); "
                             f"stopping. {job.incidents.where()}")
        job.machine.to(JobState.RECOVERING, f"rollback: {trip.rule} at step {step}")
        # the decision in one piece, before anything that can fail: a worker lost from here on is recovered from
        # onto a grid that gets this skip and this scale together (never half a rollback)
        job.skip.update(decision.skip)
        job.lr_scale = decision.lr_scale
        job.snapshots.commit(job.group, wait=True, timeout_s=job.cfg.fault_tolerance.wait_timeout_s)
        job.group.transfer.restore(job.snapshots.committed.sources())
        job.table.drop_copies()  # the restored workers hold none
        incident["restore_seconds"] = time.perf_counter() - t0
        job.group.call("set_lr_scale", job.lr_scale)
        self.replay(step)
        incident["rollback_seconds"] = time.perf_counter() - t0  # restore + replay since the snapshot
        job.machine.to(JobState.RUNNING, f"rolled back to step {job.snapshots.committed.step}, skipping "
                                         f"{list(decision.skip)}")

    def recover(self, step: int, lost: WorkerLost, detected_after: float) -> None:
        """Recover from `lost` to the boundary before `step`, a bounded handler: each attempt (`_recover_once`) is a
        transition into recovering; a worker lost during one starts the next after the machine's backoff; past
        `fault_tolerance.recovery_attempts` (or when nothing fits the alive nodes) the job stops (RecoveryFailed)."""
        machine = self.job.machine
        while True:
            try:
                machine.to(JobState.RECOVERING, str(lost))
            except AttemptsExhausted as spent:
                self.give_up(step, f"{spent}")
            try:
                self._recover_once(step, lost, detected_after)
                return
            except WorkerLost as again:
                lost, detected_after = again, 0.0
                time.sleep(machine.backoff_s())
            except TopologyError as err:
                self.give_up(step, f"recovering from {lost}: {err}")

    def give_up(self, step: int, what: str) -> None:
        job = self.job
        job.snapshots.drop_pending()
        job.machine.to(JobState.ERRORED, what)
        job.incidents.write(job.incidents.record("stopped", step=step, rule="recovery_failed", why=what))
        raise RecoveryFailed(f"step {step}: recovery failed: {what}; stopping. {job.incidents.where()}")

    def _recover_once(self, step: int, lost: WorkerLost, detected_after: float) -> None:
        """One attempt: rebuild the grid the policy decides on from the survivors' snapshots and replay to `step`:
        in place around hot spares where ready ones take lost ranks' places, else launched anew. A worker lost
        during it (the new grid's launch, restore or replay) raises WorkerLost for the next attempt."""
        job = self.job
        t0 = time.perf_counter()
        ft = job.cfg.fault_tolerance
        old = job.group
        try:  # a snapshot started at this boundary is the newest state, if every worker finished its part
            job.snapshots.commit(old, wait=True, timeout_s=min(30.0, ft.wait_timeout_s), hold=False)
        except WorkerLost:  # a lost worker never delivered its part
            pass
        job.snapshots.drop_pending()  # what is still pending lacks a lost worker's part
        job.checkpoints.abandon_pending(str(lost))  # its writers are gone: the new grid writes it again
        snap = job.snapshots.committed
        if snap is None:
            job.machine.to(JobState.ERRORED, "no snapshot yet")
            raise RecoveryFailed(f"{lost} before the first snapshot completed; restart with --resume from a "
                                 f"checkpoint. {job.incidents.where()}")
        silent = recovery.silent_nodes(old.nodes, lost.ranks) if lost.hung else set()
        self.avoid_nodes |= silent
        old.avoid_nodes = frozenset(self.avoid_nodes)  # no spare on a silent node either
        t_gathered = time.perf_counter()
        load = job.table.expert_load(job.last_report)
        spares = old.spares_ready() if ft.spares else 0
        decision = recovery.on_workers_lost(torch.tensor(old.home), old.ep, lost.ranks, load, spares=spares)
        fields = dict(step=step, ranks=sorted(lost.ranks), why=lost.why,
                      rule="collective_timeout" if lost.hung else "worker_lost", silent_nodes=sorted(silent),
                      replayed_steps=[snap.step, step], attempt=job.machine.attempt)
        incident = None  # the launch anew records each of its attempts' outcomes itself
        try:
            if decision.spare_for:
                t_planned = time.perf_counter()
                incident = self._loss_incident(decision, old.ep, fields)
                try:
                    self._regroup(lost.ranks, decision, snap.sources())
                except TopologyError as err:  # the spares went away meanwhile: launch anew instead
                    incident["outcome"] = f"no spare after all: {err}"
                    incident = None
                    decision, incident, t_planned = self._launch_anew(old, lost, load, fields, snap)
            else:
                decision, incident, t_planned = self._launch_anew(old, lost, load, fields, snap)
            t_restored = time.perf_counter()
            self.replay(step)
        except WorkerLost as again:
            if incident is not None:
                incident["outcome"] = f"interrupted: {again}"
                job.incidents.write(incident)
            raise
        job.scaling.after_recovery(step, decision.ep)
        launch = job.group.launch_seconds
        incident["seconds"] = {
            "detection": detected_after, "find_snapshot": t_gathered - t0, "replan": t_planned - t_gathered,
            **launch, "launch_other": t_restored - t_planned - sum(launch.values()),
            "replay": time.perf_counter() - t_restored}
        job.incidents.write(incident)
        job.machine.to(JobState.RUNNING, f"recovered on {decision.ep * job.cfg.parallel.pp} workers"
                                         + (f", {len(decision.spare_for)} of them hot spares" if decision.spare_for
                                            else ""))

    def _loss_incident(self, decision: recovery.LossDecision, old_ep: int, fields: dict) -> dict:
        full = self.job.cfg.parallel.ep
        return self.job.incidents.record(
            "worker_lost", action=decision.action, **fields, ep=[old_ep, decision.ep],
            spares_used=sorted(decision.spare_for),
            dp_ranks_per_ep_rank=[recovery.dp_ranks_of(e, decision.ep, full) for e in range(decision.ep)])

    def _launch_anew(self, old, lost: WorkerLost, load, fields: dict, snap):
        """Launch the grid that fits the alive nodes, planned first on their totals (the old grid's resources were
        just given back, and Ray's free counts lag), then, when the placement failed (a lost node not yet reported
        dead, or others hold resources), again on what they have free. Returns (decision, incident, when it was
        planned)."""
        job = self.job
        old.close()  # a grid that lost workers holds their places: the new one is planned on what it gives back
        for attempt in range(1, 4):
            max_ep = self.new_group(1, old.home).alive_nodes.capacity(free=attempt > 1) // job.cfg.parallel.pp
            if max_ep < 1:
                raise TopologyError(f"the alive nodes hold no {job.cfg.parallel.pp}-stage grid")
            decision = recovery.on_workers_lost(torch.tensor(old.home), old.ep, lost.ranks, load, max_ep=max_ep)
            t_planned = time.perf_counter()
            incident = self._loss_incident(decision, old.ep, fields)
            try:
                self._relaunch(decision.ep, decision.home.tolist(), snap.sources(), placement_timeout_s=60.0)
                return decision, incident, t_planned
            except TopologyError as err:
                incident["outcome"] = f"did not fit: {err}"
                job.incidents.write(incident)
                job.group.close()
                if attempt == 3:
                    raise
            except WorkerLost as again:
                incident["outcome"] = f"interrupted: {again}"
                job.incidents.write(incident)
                raise

    def _relaunch(self, ep: int, home: list[int], sources: dict, placement_timeout_s: float = 120.0) -> None:
        job = self.job
        job.table.reset(ep, home)
        job.group = self.new_group(ep, home)
        job.group.launch(placement_timeout_s, restore=sources, wait_for_spares=False)
        job.joined()

    def _regroup(self, lost: set[int], decision: recovery.LossDecision, sources: dict) -> None:
        job = self.job
        home = decision.home.tolist()
        job.table.reset(decision.ep, home)
        job.group.regroup(lost, decision.ep, home, list(decision.keep), set(decision.spare_for), sources,
                          timeout_s=60.0)
        job.joined()
