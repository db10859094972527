"""How a job survives failures, as a mixin of the Controller actor: in-memory snapshots, rollback on a guard trip,
recovery from lost workers (shrink, re-home the lost experts, replay), growing back, periodic re-homing, fault drills.
The decisions come from k3ray.policies (guards, recovery, replication); this carries them out on the WorkerGroup.
Job states are named here, in one place."""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

import ray
import torch

from k3ray.policies import guards, recovery, replication
from k3ray.runtime import shards
from k3ray.runtime.group import WorkerGroup, WorkerLost, restore_sources

log = logging.getLogger("k3ray.controller")


class JobState(str, enum.Enum):
    INITIALIZING = "initializing"
    SCHEDULING = "scheduling"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    FINISHED = "finished"
    ERRORED = "errored"


class GuardError(RuntimeError):
    """A blow-up the escalation ladder could not get past; the job stops with this report."""


@dataclass
class Snapshot:
    """The state of every worker of one grid at the boundary before `step`, in the object store (refs by world rank,
    owned by the controller, so they outlive the workers)."""
    step: int
    guard: guards.GuardState
    pp: int
    ep: int
    refs: list
    size_refs: list  # world rank -> ref to the snapshot's size in bytes
    started: float
    stall_seconds: float  # training held up: staging on every worker
    nbytes: int = 0  # all workers together, once committed

    def sources(self) -> dict[int, list]:
        return restore_sources(dict(enumerate(self.refs)), self.pp, self.ep)


class Resilience:
    def _snapshot(self, step: int, wait: bool = False) -> None:
        """Start a snapshot of the state to run `step` from; it becomes the one to fall back on once every worker's
        bytes have arrived (`_commit_snapshot`, after the step, or at once with wait=True)."""
        self._commit_snapshot(wait=True)  # the previous one must be done: buffers are reused
        t0 = time.perf_counter()
        refs, size_refs = self.group.begin_snapshot(step)
        self.pending_snap = Snapshot(step, self.guard_state, self.cfg.parallel.pp, self.ep_size, refs, size_refs,
                                     t0, time.perf_counter() - t0)
        if wait:
            self._commit_snapshot(wait=True)

    def _commit_snapshot(self, wait: bool, timeout_s: float | None = None) -> None:
        """Make the pending snapshot the committed one once all of it has arrived; raises if a worker died first."""
        snap = self.pending_snap
        if snap is None:
            return
        ready, _ = ray.wait(snap.size_refs, num_returns=len(snap.size_refs),
                            timeout=(timeout_s if wait else 0), fetch_local=True)
        if len(ready) < len(snap.size_refs):
            return
        snap.nbytes = sum(ray.get(snap.size_refs))
        self.group.hold_peer_snapshots(snap.step, snap.refs)
        self.snap, self.pending_snap = snap, None
        self.snapshot_seconds.append(snap.stall_seconds)
        self.snapshot_total_seconds.append(time.perf_counter() - snap.started)
        if self.metrics is not None:
            self.metrics.record_snapshot(snap.stall_seconds)

    def _snapshot_due(self, step: int) -> bool:
        taken = {s.step for s in (self.snap, self.pending_snap) if s is not None}
        return step % self.cfg.fault_tolerance.snapshot_every == 0 and step not in taken

    def _replay(self, until: int) -> None:
        """Re-run the accepted steps snap.step .. until-1 on the batches they used (deterministic)."""
        self.guard_state = self.snap.guard
        for s in range(self.snap.step, until):
            report = self._run(s, self.batches[s])
            self.guard_state = guards.accept(report, self.guard_state)

    def _rollback(self, step: int, batch: int, trip: guards.Trip, attempts: int) -> None:
        ft = self.cfg.fault_tolerance
        t0 = time.perf_counter()
        skipped = [batch + i for i in range(ft.skip_growth ** (attempts - 1))]
        incident = {"time": time.time(), "kind": "blowup", "action": "rollback", "step": step, "rule": trip.rule,
                    "layer": trip.layer,
                    "value": trip.value, "detail": trip.detail, "batch_ids": skipped, "attempt": attempts}
        self.incidents.append(incident)
        if attempts > ft.max_retries_per_step:
            self._transition(JobState.ERRORED, f"step {step}: {attempts} guard trips")
            raise GuardError(f"step {step}: guard tripped {attempts} times (last: {trip.rule} = {trip.value} "
                             f"layer {trip.layer}; skipped batches {sorted(self.skip)}; lr scale {self.lr_scale}); "
                             f"stopping. Incidents: {self.incidents[-attempts:]}")
        self._transition(JobState.RECOVERING, f"rollback: {trip.rule} at step {step}")
        self.skip.update(skipped)
        self._commit_snapshot(wait=True)  # one started at this step's boundary holds the state to go back to
        sources = self.snap.sources()
        ray.get([w.restore.remote(*sources[i // self.ep_size]) for i, w in enumerate(self._all())])
        incident["restore_seconds"] = time.perf_counter() - t0
        if attempts >= 2:  # escalate: the same step keeps blowing up on fresh data
            self.lr_scale *= ft.lr_backoff
        ray.get([w.set_lr_scale.remote(self.lr_scale) for w in self._all()])
        self._replay(step)
        incident["rollback_seconds"] = time.perf_counter() - t0  # restore + replay since the snapshot
        self._transition(JobState.RUNNING, f"rolled back to step {self.snap.step}, skipping {skipped}")

    def _recover(self, step: int, lost: WorkerLost, detected_after: float) -> None:
        """Rebuild a smaller topology from the survivors' snapshots, re-home the lost experts, replay to `step`."""
        t0 = time.perf_counter()
        self._transition(JobState.RECOVERING, str(lost))
        old = self.group
        try:  # a snapshot started at this boundary is the newest state, if every worker finished its part
            self._commit_snapshot(wait=True, timeout_s=30.0)
        except ray.exceptions.RayError:  # a lost worker never delivered its part (or not in time)
            pass
        self.pending_snap = None  # what is still pending lacks a lost worker's part
        if self.snap is None:
            self._transition(JobState.ERRORED, "no snapshot yet")
            raise RuntimeError(f"{lost} before the first snapshot completed; restart with --resume from a checkpoint")
        sources = self.snap.sources()
        t_gathered = time.perf_counter()
        lost_cols = {r % old.ep for r in lost.ranks}
        if old.ep - len(lost_cols) >= 1:
            load = self._expert_load()
            home, _ = recovery.shrink(torch.tensor(old.home), lost_cols, load)
            new_ep = old.ep - len(lost_cols)
        else:  # nothing left in the EP dimension of some stage: restart the same grid on other resources
            home, new_ep = torch.tensor(old.home), old.ep
        old.close()
        t_planned = time.perf_counter()
        self._relaunch(new_ep, home.tolist(), sources)
        t_restored = time.perf_counter()
        self._replay(step)
        self.shrunk_at = step if new_ep < self.cfg.parallel.ep else None
        self.incidents.append({
            "time": time.time(), "kind": "worker_lost", "action": "reshard" if new_ep < old.ep else "restart",
            "rule": "collective_timeout" if lost.why.startswith("no answer") else "worker_lost",
            "step": step, "ranks": sorted(lost.ranks), "why": lost.why,
            "ep": [old.ep, new_ep], "seconds": {
                "detection": detected_after, "find_snapshot": t_gathered - t0, "replan": t_planned - t_gathered,
                **self.group.launch_seconds, "launch_other": t_restored - t_planned - sum(self.group.launch_seconds.values()),
                "replay": time.perf_counter() - t_restored}})
        self._transition(JobState.RUNNING, f"recovered on {new_ep * self.cfg.parallel.pp} workers")

    def _relaunch(self, ep: int, home: list[int], sources: dict) -> None:
        self.ep_size, self.home = ep, home
        self.group = WorkerGroup(self.cfg, ep, home)
        self.group.launch(120.0, restore=sources)
        self._apply_policies()
        ray.get([w.set_lr_scale.remote(self.lr_scale) for w in self._all()])
        self.group.hold_peer_snapshots(self.snap.step, self.snap.refs)  # re-pin on the new grid

    def _maybe_grow_back(self, step: int) -> None:
        full = self.cfg.parallel.ep
        if self.shrunk_at is None or not self.cfg.fault_tolerance.grow_back or self.ep_size >= full:
            return
        if step - self.shrunk_at < self.cfg.fault_tolerance.grow_back_after_steps:
            return
        extra = WorkerGroup(self.cfg, full - self.ep_size, [0] * self.cfg.model.n_experts)
        if not extra.fits(extra_cluster_free=True)[0]:
            return
        t0 = time.perf_counter()
        self._transition(JobState.RESIZING, f"growing back to ep={full}")
        self._snapshot(step, wait=True)
        old = self.group
        sources = self.snap.sources()
        old.close()
        self._relaunch(full, recovery.grow(self.cfg.model.n_experts, full).tolist(), sources)
        self.shrunk_at = None
        self.incidents.append({"time": time.time(), "kind": "grow_back", "step": step, "ep": [old.ep, full],
                               "seconds": time.perf_counter() - t0})
        self._transition(JobState.RUNNING, f"grown back to {self.group.size} workers")

    def _track_load(self, report: dict) -> None:
        now = torch.zeros(self.cfg.model.n_experts, dtype=torch.float64)
        for rows in report["tokens_per_expert"].values():
            now += torch.tensor(rows, dtype=torch.float64).sum(0)
        decay = self.cfg.policies.replication.history_decay
        self.load_history = now if self.load_history is None else decay * self.load_history + (1 - decay) * now

    def _rebalance(self) -> None:
        """Persistent placement from the load history (the replication policy with one slot per expert: experts
        re-homed, no extra copies), within the migration budget; MoonEP still balances each micro-batch on top.
        Skipped while shrunk when the EP size does not divide the experts."""
        E, R = self.cfg.model.n_experts, self.ep_size
        if E % R:
            return
        per = E // R
        current = torch.tensor(sorted(range(E), key=lambda e: (self.home[e], e)))  # physical slot -> expert
        plan = replication.rebalance(self.load_history, R, E, moved_budget=self.cfg.policies.replication.moved_budget,
                                     current=current)
        new_home = [0] * E
        for slot, e in enumerate(plan.physical_to_logical.tolist()):
            new_home[e] = slot // per
        moved = [e for e in range(E) if new_home[e] != self.home[e]]
        if moved:
            self._rehome(new_home)
            self.incidents.append({"time": time.time(), "kind": "rebalance", "step": self.step, "moved": moved})
            log.info("rebalance at step %d moved experts %s", self.step, moved)

    def _rehome(self, new_home: list[int]) -> None:
        ep = self.ep_size
        for row in (self._all()[p * ep:(p + 1) * ep] for p in range(self.cfg.parallel.pp)):
            imports: list[dict] = [{} for _ in range(ep)]
            for src in range(ep):
                leaving = [e for e in range(len(new_home)) if self.home[e] == src and new_home[e] != src]
                if not leaving:
                    continue
                for layer, payload in ray.get(row[src].export_shard.remote(leaving)).items():
                    for dst in sorted({new_home[e] for e in leaving}):
                        part = shards.select_experts(payload, {e for e in leaving if new_home[e] == dst})
                        imports[dst].setdefault(layer, []).append(part)
            ray.get([w.set_placement.remote(new_home, imports[r] or None) for r, w in enumerate(row)])
        self.home = list(new_home)
        self.group.home = list(new_home)

    def _expert_load(self) -> torch.Tensor:
        load = torch.ones(self.cfg.model.n_experts, dtype=torch.float64)
        if self.last_report is not None:
            for rows in self.last_report["tokens_per_expert"].values():
                load += torch.tensor(rows, dtype=torch.float64).sum(0)
        return load

    def _inject_fault(self, step: int) -> None:
        """Fire the next drill due at this step (one per attempt: a drill listed twice hits the retry too)."""
        for i, fault in self.pending_faults:
            if fault.step != step or i in self.fired or fault.kind == "corrupt_checkpoint":  # that one: at commit
                continue
            self.fired.add(i)
            log.warning("fault drill: %s at step %d", fault.kind, step)
            if fault.kind in ("kill_worker", "hang_collective"):  # drills hit during the step, after the
                self._commit_snapshot(wait=True)  # boundary's snapshot is in: their outcome is reproducible
            workers = self._all()
            if fault.kind == "kill_worker":
                ray.kill(workers[fault.worker or 0], no_restart=True)
            elif fault.kind == "nan":
                ray.get([w.set_poison.remote(fault.layer or 0) for w in workers])
                self.poisoned = True
            elif fault.kind == "hang_collective":
                ray.get(workers[fault.worker or 0].hang_at.remote(step))
            return

    def _clear_transient_faults(self) -> None:
        if self.poisoned:
            self.poisoned = False
            ray.get([w.set_poison.remote(None) for w in self._all()])
