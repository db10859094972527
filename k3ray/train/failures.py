"""The controller's failure paths, carrying out the policies' decisions: roll back on a guard trip, recover from lost
workers (in any state), grow back when capacity returns. A part of `Controller` (k3ray.train.controller), kept
in its own file; it uses the controller's state and parts.

Recovery and grow-back are bounded handlers of the state machine (k3ray.train.state): each attempt is a
transition into its state, a loss during an attempt starts the next one after a backoff, and the machine refuses
the attempt past the limit; then the job stops with one line naming what happened and where the incidents are
(`RecoveryFailed`). The grid in use is kept until the one replacing it is placed."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from k3ray.train.state import AttemptsExhausted, JobState
from k3ray.grid.worker_group import TopologyError, WorkerLost
from k3ray.policies import guards, ladder, recovery

log = logging.getLogger("k3ray.controller")


class GuardError(RuntimeError):
    """A blow-up the failure ladder could not get past; the job stops with this report."""


class RecoveryFailed(RuntimeError):
    """Lost workers the bounded recovery could not get past (its attempts spent, or nothing fits the alive nodes);
    the job stops with this one-line report."""


class FailurePaths:
    def _replay(self, until: int) -> None:
        """Re-run the accepted steps snap.step .. until-1 on the batches they used (deterministic)."""
        snap = self.snapshots.committed
        self.guard_state = snap.guard
        for s in range(snap.step, until):
            self.guard_state = guards.accept(self._run(s, self.batches[s]), self.guard_state)

    def _rollback(self, step: int, batch: int, trip: guards.Trip, attempt: int) -> None:
        t0 = time.perf_counter()
        decision = ladder.on_trip(attempt, batch, self.lr_scale, self.cfg.fault_tolerance)
        incident = {"time": time.time(), "kind": "blowup", "action": decision.action, "step": step,
                    "rule": trip.rule, "layer": trip.layer, "value": trip.value, "detail": trip.detail,
                    "batch_ids": list(decision.skip), "attempt": attempt}
        self.incidents.append(incident)
        self._log_incident(incident)
        if decision.action == "stop":
            self.machine.to(JobState.ERRORED, f"step {step}: {attempt} guard trips")
            raise GuardError(f"step {step}: guard tripped {attempt} times (last: {trip.rule} = {trip.value} "
                             f"layer {trip.layer}; skipped batches {sorted(self.skip)}; lr scale {self.lr_scale}); "
                             f"stopping. {self._incidents_where()}")
        self.machine.to(JobState.RECOVERING, f"rollback: {trip.rule} at step {step}")
        # the decision in one piece, before anything that can fail: a worker lost from here on is recovered from
        # onto a grid that gets this skip and this scale together (never half a rollback)
        self.skip.update(decision.skip)
        self.lr_scale = decision.lr_scale
        self.snapshots.commit(self.group, wait=True, timeout_s=self.cfg.fault_tolerance.wait_timeout_s)
        self.group.restore(self.snapshots.committed.sources())
        self.table.drop_copies()  # the restored workers hold none
        incident["restore_seconds"] = time.perf_counter() - t0
        self.group.call("set_lr_scale", self.lr_scale)
        self._replay(step)
        incident["rollback_seconds"] = time.perf_counter() - t0  # restore + replay since the snapshot
        self.machine.to(JobState.RUNNING, f"rolled back to step {self.snapshots.committed.step}, skipping "
                                          f"{list(decision.skip)}")

    def _recover(self, step: int, lost: WorkerLost, detected_after: float) -> None:
        """Recover from `lost` to the boundary before `step`, a bounded handler: each attempt (`_recover_once`) is a
        transition into recovering; a worker lost during one starts the next after the machine's backoff; past
        `fault_tolerance.recovery_attempts` (or when nothing fits the alive nodes) the job stops (RecoveryFailed)."""
        while True:
            try:
                self.machine.to(JobState.RECOVERING, str(lost))
            except AttemptsExhausted as spent:
                self._give_up(step, f"{spent}")
            try:
                self._recover_once(step, lost, detected_after)
                return
            except WorkerLost as again:
                lost, detected_after = again, 0.0
                time.sleep(self.machine.backoff_s())
            except TopologyError as err:
                self._give_up(step, f"recovering from {lost}: {err}")

    def _give_up(self, step: int, what: str) -> None:
        self.snapshots.drop_pending()
        self.machine.to(JobState.ERRORED, what)
        self._log_incident(self._incident("stopped", step=step, rule="recovery_failed", why=what))
        raise RecoveryFailed(f"step {step}: recovery failed: {what}; stopping. {self._incidents_where()}")

    def _incidents_where(self) -> str:
        path = self.cfg.fault_tolerance.incidents_file
        return f"Incidents: {path}" if path else "Incidents: `k3ray incidents` while the job runs"

    def _recover_once(self, step: int, lost: WorkerLost, detected_after: float) -> None:
        """One attempt: rebuild the grid the policy decides on from the survivors' snapshots and replay to `step`:
        in place around hot spares where ready ones take lost ranks' places, else launched anew. A worker lost
        during it (the new grid's launch, restore or replay) raises WorkerLost for the next attempt."""
        t0 = time.perf_counter()
        ft = self.cfg.fault_tolerance
        old = self.group
        try:  # a snapshot started at this boundary is the newest state, if every worker finished its part
            self.snapshots.commit(old, wait=True, timeout_s=min(30.0, ft.wait_timeout_s), hold=False)
        except WorkerLost:  # a lost worker never delivered its part
            pass
        self.snapshots.drop_pending()  # what is still pending lacks a lost worker's part
        self.checkpoints.abandon_pending(str(lost))  # its writers are gone: the new grid writes it again
        snap = self.snapshots.committed
        if snap is None:
            self.machine.to(JobState.ERRORED, "no snapshot yet")
            raise RecoveryFailed(f"{lost} before the first snapshot completed; restart with --resume from a "
                                 f"checkpoint. {self._incidents_where()}")
        silent = recovery.silent_nodes(old.nodes, lost.ranks) if lost.hung else set()
        self.avoid_nodes |= silent
        old.avoid_nodes = frozenset(self.avoid_nodes)  # no spare on a silent node either
        t_gathered = time.perf_counter()
        load = self.table.expert_load(self.last_report)
        spares = old.spares_ready() if ft.spares else 0
        decision = recovery.on_workers_lost(torch.tensor(old.home), old.ep, lost.ranks, load, spares=spares)
        fields = dict(step=step, ranks=sorted(lost.ranks), why=lost.why,
                      rule="collective_timeout" if lost.hung else "worker_lost", silent_nodes=sorted(silent),
                      replayed_steps=[snap.step, step], attempt=self.machine.attempt)
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
            self._replay(step)
        except WorkerLost as again:
            if incident is not None:
                incident["outcome"] = f"interrupted: {again}"
                self._log_incident(incident)
            raise
        self.shrunk_at = step if decision.ep < self.ep_target else None
        launch = self.group.launch_seconds
        incident["seconds"] = {
            "detection": detected_after, "find_snapshot": t_gathered - t0, "replan": t_planned - t_gathered,
            **launch, "launch_other": t_restored - t_planned - sum(launch.values()),
            "replay": time.perf_counter() - t_restored}
        self._log_incident(incident)
        self.machine.to(JobState.RUNNING, f"recovered on {decision.ep * self.cfg.parallel.pp} workers"
                                          + (f", {len(decision.spare_for)} of them hot spares" if decision.spare_for
                                             else ""))

    def _loss_incident(self, decision: recovery.LossDecision, old_ep: int, fields: dict) -> dict:
        return self._incident(
            "worker_lost", action=decision.action, **fields, ep=[old_ep, decision.ep],
            spares_used=sorted(decision.spare_for),
            dp_ranks_per_ep_rank=[recovery.dp_ranks_of(e, decision.ep, self.cfg.parallel.ep)
                                  for e in range(decision.ep)])

    def _launch_anew(self, old, lost: WorkerLost, load, fields: dict, snap):
        """Launch the grid that fits the alive nodes, planned first on their totals (the old grid's resources were
        just given back, and Ray's free counts lag), then, when the placement failed (a lost node not yet reported
        dead, or others hold resources), again on what they have free. Returns (decision, incident, when it was
        planned)."""
        old.close()  # a grid that lost workers holds their places: the new one is planned on what it gives back
        for attempt in range(1, 4):
            max_ep = self._new_group(1, old.home).capacity(free=attempt > 1) // self.cfg.parallel.pp
            if max_ep < 1:
                raise TopologyError(f"the alive nodes hold no {self.cfg.parallel.pp}-stage grid")
            decision = recovery.on_workers_lost(torch.tensor(old.home), old.ep, lost.ranks, load, max_ep=max_ep)
            t_planned = time.perf_counter()
            incident = self._loss_incident(decision, old.ep, fields)
            try:
                self._relaunch(decision.ep, decision.home.tolist(), snap.sources(), placement_timeout_s=60.0)
                return decision, incident, t_planned
            except TopologyError as err:
                incident["outcome"] = f"did not fit: {err}"
                self._log_incident(incident)
                self.group.close()
                if attempt == 3:
                    raise
            except WorkerLost as again:
                incident["outcome"] = f"interrupted: {again}"
                self._log_incident(incident)
                raise

    def _new_group(self, ep: int, home: list[int]):
        return self.new_group(self.cfg, ep, home, frozenset(self.avoid_nodes))

    def _incident(self, kind: str, **fields) -> dict:
        """Record an incident (the incident log, `k3ray incidents`, the metrics read it); returns it for updates
        (`_log_incident` writes it to the incidents file once complete)."""
        incident = {"time": time.time(), "kind": kind, **fields}
        self.incidents.append(incident)
        return incident

    def _log_incident(self, incident: dict) -> None:
        """Append an incident to `fault_tolerance.incidents_file` (JSON lines), where the user reads it after a
        stop; an incident updated later is written again (the last line of an incident wins)."""
        path = self.cfg.fault_tolerance.incidents_file
        if not path:
            return
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(incident, default=str) + "\n")
        except OSError as err:
            log.warning("incident not written to %s: %s", path, err)

    def _relaunch(self, ep: int, home: list[int], sources: dict, placement_timeout_s: float = 120.0) -> None:
        self.table.reset(ep, home)
        self.group = self._new_group(ep, home)
        self.group.launch(placement_timeout_s, restore=sources, wait_for_spares=False)
        self._joined()

    def _regroup(self, lost: set[int], decision: recovery.LossDecision, sources: dict) -> None:
        home = decision.home.tolist()
        self.table.reset(decision.ep, home)
        self.group.regroup(lost, decision.ep, home, list(decision.keep), set(decision.spare_for), sources,
                           timeout_s=60.0)
        self._joined()

    def _joined(self) -> None:
        """A grid that has just taken the snapshot's state: drills due on it, live policies, the learning-rate
        scale, the neighbours' snapshot copies."""
        self.drills.kill_at(self.group, self.step, "relaunch")
        self._push_policies()
        self.group.call("set_lr_scale", self.lr_scale)
        snap = self.snapshots.committed
        self.group.hold_peer_snapshots(snap.step, snap.refs)  # re-pin on the new grid

    def _maybe_scale(self, step: int) -> None:
        """A resize asked for (`request_scale`), at the boundary of `step`: from a snapshot of this boundary, down
        as after a loss (the kept EP columns, experts re-homed by load; the workers left out stand by as spares),
        up as a grow-back (ready spares, such as those, fill the added places first; the others are placed first,
        and a placement that does not fit leaves the grid as it was). The
        data-parallel width stays parallel.ep, so the global batch and the results do not change."""
        ep, self.scale_to = self.scale_to, None
        old_ep = self.table.ep
        if ep is None or ep == old_ep:
            return
        t0 = time.perf_counter()
        self.checkpoints.commit_pending(self.group)
        self.machine.to(JobState.RESIZING, f"scaling to ep={ep}")
        self.snapshots.take(self.group, step, self.guard_state, wait=True)
        sources = self.snapshots.committed.sources()
        try:
            if ep < old_ep:
                keep = list(range(ep))
                home, _ = recovery.shrink(torch.tensor(self.table.home), set(range(ep, old_ep)),
                                          self.table.expert_load(self.last_report))
                home = home.tolist()
                self.table.reset(ep, home)
                self.group.regroup(set(), ep, home, keep, set(), sources, timeout_s=60.0)
            else:
                home = recovery.grow(self.cfg.model.n_experts, ep).tolist()
                self.group.grow(ep, home, sources, timeout_s=min(60.0, self.cfg.fault_tolerance.wait_timeout_s),
                                use_spares=True)
                self.table.reset(ep, home)
        except TopologyError as err:  # nothing changed: the grid trains on at its size
            self._log_incident(self._incident("scale_failed", step=step, ep=[old_ep, ep], why=str(err)))
            self.machine.to(JobState.RUNNING, f"scaling to ep={ep} did not fit ({err})")
            return
        self._joined()
        self.ep_target, self.shrunk_at = ep, None  # the size asked for: a later loss grows back to it, not beyond
        self._log_incident(self._incident("scaled", step=step, ep=[old_ep, ep], seconds=time.perf_counter() - t0))
        self.machine.to(JobState.RUNNING, f"scaled to {self.group.size} workers")

    def _maybe_grow_back(self, step: int) -> None:
        """Grow back to the EP size asked for (parallel.ep, or the last `k3ray scale`) when the cluster has room
        again, in place: the grid in use keeps running until the added workers are placed (a placement that fails
        leaves it as it was, and the job goes on shrunk, trying again later; after `grow_back_attempts` failures in
        a row it stays shrunk)."""
        ft, full = self.cfg.fault_tolerance, self.ep_target
        if self.grow_back_failures >= ft.grow_back_attempts or not recovery.grow_back_due(
                step, self.shrunk_at, self.table.ep, full, ft.grow_back, ft.grow_back_after_steps):
            return
        if not self.group.room_for(self.cfg.parallel.pp * (full - self.table.ep)):
            return
        t0 = time.perf_counter()
        # the workers taking their places in the grown grid drop the parts they are writing: commit them first
        self.checkpoints.commit_pending(self.group)
        self.machine.to(JobState.RESIZING, f"growing back to ep={full}")
        self.snapshots.take(self.group, step, self.guard_state, wait=True)
        old_ep, home = self.table.ep, recovery.grow(self.cfg.model.n_experts, full).tolist()
        try:
            self.group.grow(full, home, self.snapshots.committed.sources(), timeout_s=min(60.0, ft.wait_timeout_s))
        except TopologyError as err:  # nothing changed: the shrunk grid trains on
            self.grow_back_failures += 1
            self.shrunk_at = step  # the next try after grow_back_after_steps more steps
            self._log_incident(self._incident("grow_back_failed", step=step, rule="grow_back_failed",
                                              ep=[old_ep, full], why=str(err), attempt=self.grow_back_failures))
            stay = self.grow_back_failures >= ft.grow_back_attempts
            self.machine.to(JobState.RUNNING, f"grow-back did not fit ({err}); "
                                              + ("staying shrunk" if stay else "trying again later"))
            return
        self.table.reset(full, home)
        self._joined()
        self.shrunk_at, self.grow_back_failures = None, 0
        self._log_incident(self._incident("grow_back", step=step, ep=[old_ep, full],
                                          seconds=time.perf_counter() - t0))
        self.machine.to(JobState.RUNNING, f"grown back to {self.group.size} workers")
