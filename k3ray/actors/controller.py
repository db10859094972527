"""The Controller actor: one per job. Owns the topology, the placement table (expert -> EP rank, per stage) and
the live policies; drives steps and merges the workers' reports. An explicit state machine: every transition is
named in `JobState` and logged."""
from __future__ import annotations

import enum
import logging
import threading
import time

from pydantic import ValidationError

import ray
import torch

from k3ray.config import JobConfig
from k3ray.policies import guards, recovery, replication
from k3ray.actors.worker import part_name
from k3ray.runtime import checkpoint as ckpt
from k3ray.runtime import shards
from k3ray.runtime.group import TopologyError, WorkerGroup, WorkerLost, restore_sources
from k3ray.runtime.step import StepReport, layer_maxvio

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


@ray.remote(num_cpus=0, max_concurrency=8)
class Controller:
    def __init__(self, cfg_dict: dict):
        self.cfg = JobConfig.model_validate(cfg_dict)
        self.state = JobState.INITIALIZING
        self.transitions: list[tuple[float, str, str]] = []
        self.group: WorkerGroup | None = None
        self.ep_size = self.cfg.parallel.ep  # live EP size: smaller than configured while shrunk
        self.home = recovery.grow(self.cfg.model.n_experts, self.cfg.parallel.ep).tolist()
        ft = self.cfg.fault_tolerance
        self.skip: set[int] = set(self.cfg.data.skip_batches)  # batch indices never trained on
        self.batches: dict[int, int] = {}  # step -> batch index it trained on
        self.snap_step: int | None = None
        self.snap_guard = guards.GuardState()
        self.guard_state = guards.GuardState()
        self.lr_scale = 1.0
        self.fired: set[int] = set()  # indices of fault drills already injected
        self.shrunk_at: int | None = None
        self.pending_commit: tuple[int, dict] | None = None  # checkpoint parts being written: (step, meta)
        self.checkpoint_requested = False
        self.checkpoints: list[dict] = []  # committed: step, path, seconds
        self.snapshot_seconds: list[float] = []
        self.pending_faults = list(enumerate(ft.faults))
        self.last_report: dict | None = None
        self.step = 0
        self.lock = threading.Lock()
        self.pending_policies: dict[str, object] = {}  # name -> validated policy, applied at the next step
        self.audit: list[dict] = []
        self.incidents: list[dict] = []
        # -- control plane (issue 6): API server, metrics --
        self.api_server = None
        self.api_url: str | None = None
        self.metrics = None
        self.metrics_overhead_s: list[float] = []
        # -- end control plane --

    def _transition(self, state: JobState, why: str = "") -> None:
        log.info("state %s -> %s %s", self.state.value, state.value, why)
        self.transitions.append((time.time(), state.value, why))
        self.state = state

    # -- topology ------------------------------------------------------------------------------------------------
    def start(self, placement_timeout_s: float = 60.0, resume: bool = False) -> dict:
        cfg = self.cfg
        par = cfg.parallel
        self._transition(JobState.SCHEDULING, f"pp={par.pp} ep={par.ep}")
        sources = self._resume_sources() if resume else None
        self.group = WorkerGroup(cfg, self.ep_size, self.home)
        try:
            backend = self.group.launch(placement_timeout_s, restore=sources)
        except TopologyError:
            self._transition(JobState.ERRORED, "topology does not fit")
            raise
        self._apply_policies()
        if sources is not None:
            ray.get([w.set_lr_scale.remote(self.lr_scale) for w in self._all()])
        self._transition(JobState.RUNNING, f"{self.group.size} workers, backend {backend}")
        # -- control plane (issue 6) --
        from k3ray.metrics import JobMetrics
        self.metrics = JobMetrics(cfg.name)
        self.metrics.set_state(self.state.value)
        if cfg.api.enabled:
            from k3ray.api import start_control_api
            self.api_server, record = start_control_api(self)
            self.api_url = record["url"]
        # -- end control plane --
        return self.status()

    def _all(self) -> list:
        return self.group.workers if self.group is not None else []

    # -- steps ---------------------------------------------------------------------------------------------------
    def train_step(self, step: int, batch_index: int | None = None) -> dict:
        """Run `step` to an accepted report: snapshot on schedule, inject due fault drills, recover from lost
        workers, roll back and skip batches on a guard trip, grow back when capacity returns. `batch_index`, if
        given, must be the batch the controller's data order assigns (it owns the order because of skips)."""
        t0 = time.perf_counter()  # control plane (issue 6)
        self._apply_pending_policies(step)
        self._maybe_grow_back(step)
        if step % self.cfg.fault_tolerance.snapshot_every == 0 and self.snap_step != step:
            self._snapshot(step)
        self._checkpoint_boundary(step)
        attempts = 0
        while True:
            self._inject_fault(step)
            batch = self._batch_for(step)
            if batch_index is not None and attempts == 0 and batch != batch_index:
                raise ValueError(f"step {step}: batch {batch_index} requested, data order gives {batch}")
            t_attempt = time.perf_counter()
            try:
                report = self._run(step, batch)
            except WorkerLost as lost:
                self._recover(step, lost, detected_after=time.perf_counter() - t_attempt)
                continue
            finally:
                self._clear_transient_faults()
            trip = guards.check(report, self.guard_state, self.cfg.policies.guards) \
                if self.cfg.policies.guards.enabled else None
            if trip is None:
                break
            attempts += 1
            self._rollback(step, batch, trip, attempts)
        self.guard_state = guards.accept(report, self.guard_state)
        self.batches[step] = batch
        self.step = step + 1
        self.last_report = report
        self._track_load(report)
        rp = self.cfg.policies.replication
        if rp.enabled and self.step % rp.every_n_steps == 0:
            self._rebalance()
        # -- control plane (issue 6): publish metrics, keep the per-step overhead --
        from k3ray.metrics import timed_publish
        self.metrics_overhead_s.append(timed_publish(self.metrics, self, self.last_report, time.perf_counter() - t0))
        del self.metrics_overhead_s[:-1000]
        # -- end control plane --
        return self.last_report

    def _resume_sources(self) -> dict | None:
        """Read the newest verified checkpoint (falling back past corrupt ones, loudly) and set the data order,
        guard statistics and step from it. Experts reshard onto the configured EP size."""
        root = self.cfg.checkpoint.dir
        manifest = ckpt.latest_verified(root)
        if manifest is None:
            log.warning("--resume: no verified checkpoint under %s; starting from step 0", root)
            return None
        meta = manifest.meta
        if meta["pp"] != self.cfg.parallel.pp:
            raise ckpt.CheckpointError(f"{manifest.path}: written with parallel.pp={meta['pp']}, the config has "
                                       f"pp={self.cfg.parallel.pp}; resume with the same pp")
        states = {r: ckpt.load_part(root, manifest.step, part_name(r)) for r in range(meta["pp"] * meta["ep"])}
        self.step = manifest.step
        if meta["last_batch"] is not None:
            self.batches[manifest.step - 1] = meta["last_batch"]
        self.skip |= set(meta["skip"])
        self.lr_scale = meta["lr_scale"]
        self.guard_state = guards.GuardState(**{k: v for k, v in meta["guard_state"].items() if k != "history"})
        self._transition(JobState.SCHEDULING, f"resuming from {manifest.path} (step {manifest.step}, "
                                              f"ep {meta['ep']} -> {self.ep_size})")
        return restore_sources(states, meta["pp"], meta["ep"])

    def _batch_for(self, step: int) -> int:
        """The next batch index after the previous step's, passing over skipped ones."""
        b = self.batches[step - 1] + 1 if step - 1 in self.batches else step
        while b in self.skip:
            b += 1
        return b

    def _run(self, step: int, batch: int) -> dict:
        timeout = self.cfg.parallel.collective_timeout_s + 30.0
        reports = self.group.run_step(step, batch, timeout)
        return self._merge(step, batch, reports).to_dict()

    # -- resilience ----------------------------------------------------------------------------------------------
    def _snapshot(self, step: int) -> None:
        t0 = time.perf_counter()
        self.group.snapshot(step)
        self.snap_step, self.snap_guard = step, self.guard_state
        self.snapshot_seconds.append(time.perf_counter() - t0)
        if self.metrics is not None:
            self.metrics.record_snapshot(self.snapshot_seconds[-1])

    # -- durable checkpoints --------------------------------------------------------------------------------------
    def request_checkpoint(self) -> dict:
        """Ask for a durable checkpoint at the next step boundary."""
        self.checkpoint_requested = True
        return {"requested": True, "at_step": self.step, "dir": self.cfg.checkpoint.dir}

    def _checkpoint_boundary(self, step: int) -> None:
        """Commit the checkpoint whose parts were written since the last boundary; start a new one if due."""
        self._commit_pending()
        every = self.cfg.checkpoint.every_n_steps
        if self.checkpoint_requested or (every and step > 0 and step % every == 0):
            self.checkpoint_requested = False
            t0 = time.perf_counter()
            ray.get([w.save_checkpoint.remote(self.cfg.checkpoint.dir, step) for w in self._all()])
            meta = {"step": step, "pp": self.cfg.parallel.pp, "ep": self.ep_size, "home": list(self.home),
                    "last_batch": self.batches.get(step - 1), "skip": sorted(self.skip), "lr_scale": self.lr_scale,
                    "guard_state": {k: v for k, v in vars(self.guard_state).items() if k != "history"},
                    "job": self.cfg.name, "config": self.cfg.model_dump(mode="json"),
                    "copy_seconds": time.perf_counter() - t0}
            self.pending_commit = (step, meta)

    def _commit_pending(self) -> None:
        if self.pending_commit is None:
            return
        step, meta = self.pending_commit
        self.pending_commit = None
        t0 = time.perf_counter()
        parts = [ckpt.PartInfo(**p) for ps in ray.get([w.checkpoint_parts.remote() for w in self._all()]) for p in ps]
        path = ckpt.commit(self.cfg.checkpoint.dir, step, parts, meta, self.cfg.checkpoint.keep)
        self.checkpoints.append({"step": step, "path": str(path), "copy_seconds": meta["copy_seconds"],
                                 "wait_and_commit_seconds": time.perf_counter() - t0})
        log.info("checkpoint of step %d committed at %s", step, path)
        if self.metrics is not None:
            self.metrics.record_checkpoint(meta["copy_seconds"] + self.checkpoints[-1]["wait_and_commit_seconds"])
        for i, fault in self.pending_faults:
            if fault.kind == "corrupt_checkpoint" and fault.step <= step and i not in self.fired:
                self.fired.add(i)
                victim = path / parts[0].name
                victim.write_bytes(victim.read_bytes()[: parts[0].bytes // 2])
                log.warning("fault drill: truncated %s", victim)

    def list_checkpoints(self) -> list[dict]:
        return list(self.checkpoints)

    def _replay(self, until: int) -> None:
        """Re-run the accepted steps snap_step .. until-1 on the batches they used (deterministic)."""
        self.guard_state = self.snap_guard
        for s in range(self.snap_step, until):
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
        ray.get([w.rollback.remote() for w in self._all()])
        incident["restore_seconds"] = time.perf_counter() - t0
        if attempts >= 2:  # escalate: the same step keeps blowing up on fresh data
            self.lr_scale *= ft.lr_backoff
        ray.get([w.set_lr_scale.remote(self.lr_scale) for w in self._all()])
        self._replay(step)
        incident["rollback_seconds"] = time.perf_counter() - t0  # restore + replay since the snapshot
        self._transition(JobState.RUNNING, f"rolled back to step {self.snap_step}, skipping {skipped}")

    def _recover(self, step: int, lost: WorkerLost, detected_after: float) -> None:
        """Rebuild a smaller topology from the survivors' snapshots, re-home the lost experts, replay to `step`."""
        t0 = time.perf_counter()
        self._transition(JobState.RECOVERING, str(lost))
        states = self.group.gather_snapshots(self.snap_step, lost.ranks)
        old = self.group
        if len(states) < old.size:
            self._transition(JobState.ERRORED, "snapshots incomplete")
            raise RuntimeError(f"{lost}: in-memory snapshots of step {self.snap_step} cover ranks "
                               f"{sorted(states)} of {old.size}; restart with --resume from a checkpoint")
        t_gathered = time.perf_counter()
        lost_cols = {r % old.ep for r in lost.ranks}
        if old.ep - len(lost_cols) >= 1:
            load = self._expert_load()
            home, _ = recovery.shrink(torch.tensor(old.home), lost_cols, load)
            new_ep = old.ep - len(lost_cols)
        else:  # nothing left in the EP dimension of some stage: restart the same grid on other resources
            home, new_ep = torch.tensor(old.home), old.ep
        sources = old.restore_sources(states)
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
                "detection": detected_after, "gather_snapshots": t_gathered - t0, "replan": t_planned - t_gathered,
                **self.group.launch_seconds, "launch_other": t_restored - t_planned - sum(self.group.launch_seconds.values()),
                "replay": time.perf_counter() - t_restored}})
        self._transition(JobState.RUNNING, f"recovered on {new_ep * self.cfg.parallel.pp} workers")

    def _relaunch(self, ep: int, home: list[int], sources: dict) -> None:
        self.ep_size, self.home = ep, home
        self.group = WorkerGroup(self.cfg, ep, home)
        self.group.launch(120.0, restore=sources)
        self._apply_policies()
        ray.get([w.set_lr_scale.remote(self.lr_scale) for w in self._all()])
        self.group.snapshot(self.snap_step)  # the new grid holds the same snapshot: a second loss is covered

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
        self._snapshot(step)
        old = self.group
        sources = old.restore_sources(old.gather_snapshots(step, set()))
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
        prev = getattr(self, "load_history", None)
        self.load_history = now if prev is None else decay * prev + (1 - decay) * now

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
        if getattr(self, "poisoned", False):
            self.poisoned = False
            ray.get([w.set_poison.remote(None) for w in self._all()])

    def worker_states(self) -> list[dict]:
        """Every worker's current state (for inspection and tests)."""
        return ray.get([w.state.remote() for w in self._all()])

    def evaluate(self) -> float:
        return ray.get([w.evaluate.remote() for w in self._all()])[0]

    def _merge(self, step: int, batch_index: int, reports: list[dict]) -> StepReport:
        cfg = self.cfg
        ep = self.ep_size
        tpe, rank_load, acts = {}, {}, {}
        for i, r in enumerate(reports):
            if i % ep == 0:  # every EP rank of a stage holds the same gathered counts
                tpe.update(r["tokens_per_expert"])
                rank_load.update(r["rank_load"])
            for layer, a in r["activations"].items():
                prev = acts.get(layer)
                acts[layer] = a if prev is None else {k: max(prev[k], a[k]) for k in a}
        phases = reports[0]["timings"].keys()
        timings = {k: max(r["timings"][k] for r in reports) for k in phases}
        return StepReport(step=step, batch_index=batch_index, loss=reports[0]["loss"],
                          grad_norm=reports[0]["grad_norm"], lr=reports[0]["lr"],
                          tokens=ep * cfg.parallel.micro_batches * cfg.data.micro_batch_size * cfg.data.seq_len,
                          tokens_per_expert=tpe, maxvio={k: layer_maxvio(v) for k, v in tpe.items()},
                          activations=acts, timings=timings, rank_load=rank_load)

    # -- placement and policies ----------------------------------------------------------------------------------
    def _apply_policies(self) -> None:
        pol = self.cfg.policies
        ray.get([w.set_policy.remote(pol.moonep.enabled, pol.moonep.slots_per_rank, pol.scheduling.enabled)
                 for w in self._all()])

    POLICY_NAMES = ("moonep", "replication", "scheduling", "guards")

    def get_policies(self, name: str | None = None) -> dict:
        """Live policies (with any change still waiting for the next step boundary applied on top)."""
        with self.lock:
            current = {n: getattr(self.cfg.policies, n).model_dump() for n in self.POLICY_NAMES}
            for n, pol in self.pending_policies.items():
                current[n] = pol.model_dump()
        if name is None:
            return current
        if name not in current:
            raise KeyError(f"unknown policy {name!r}; policies: {', '.join(self.POLICY_NAMES)}")
        return current[name]

    def set_policy(self, name: str, params: dict, source: str = "python") -> dict:
        """Validate a change to one policy and queue it for the next step boundary. Raises KeyError for an unknown
        policy and ValueError naming the field for a bad value; nothing changes then."""
        if name not in self.POLICY_NAMES:
            raise KeyError(f"unknown policy {name!r}; policies: {', '.join(self.POLICY_NAMES)}")
        with self.lock:
            base = self.pending_policies.get(name) or getattr(self.cfg.policies, name)
            try:
                new = type(base).model_validate({**base.model_dump(), **params})
            except ValidationError as err:
                fields = "; ".join(f"{name}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
                raise ValueError(fields) from None
            self.pending_policies[name] = new
            entry = {"time": time.time(), "policy": name, "params": params, "source": source,
                     "requested_at_step": self.step, "applies_at_step": self.step, "applied": False}
            self.audit.append(entry)
        log.info("policy %s change %s from %s queued for step %d", name, params, source, self.step)
        return {"policy": name, "value": new.model_dump(), "applies_at_step": self.step}

    def _apply_pending_policies(self, step: int) -> None:
        with self.lock:
            pending, self.pending_policies = self.pending_policies, {}
            for entry in self.audit:
                if not entry["applied"] and entry["policy"] in pending:
                    entry.update(applied=True, applies_at_step=step)
        if not pending:
            return
        for name, pol in pending.items():
            setattr(self.cfg.policies, name, pol)
        if "moonep" in pending or "scheduling" in pending:
            self._apply_policies()

    def audit_log(self) -> list[dict]:
        with self.lock:
            return [dict(e) for e in self.audit]

    def get_incidents(self) -> list[dict]:
        return list(self.incidents)

    def move_experts(self, expert_ids: list[int], dst_ep_rank: int) -> dict:
        """Move experts' shards (weights and optimizer moments, every layer) to another EP rank of each stage."""
        new_home = list(self.home)
        for e in expert_ids:
            new_home[e] = dst_ep_rank
        self._rehome(new_home)
        return self.placement()

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

    # -- views ---------------------------------------------------------------------------------------------------
    def status(self) -> dict:
        par = self.cfg.parallel
        return {"name": self.cfg.name, "state": self.state.value, "step": self.step, "pp": par.pp,
                "ep": self.ep_size, "ep_configured": par.ep, "workers": par.pp * self.ep_size, "device": par.device,
                "skipped_batches": sorted(self.skip), "lr_scale": self.lr_scale,
                "loss": None if self.last_report is None else self.last_report["loss"],
                "api_url": self.api_url,  # control plane (issue 6)
                "tokens_per_s": None if self.metrics is None else self.metrics.tokens_per_s,  # control plane
                "transitions": [{"time": t, "state": s, "why": w} for t, s, w in self.transitions]}

    def placement(self) -> dict:
        experts_of = {r: [e for e, h in enumerate(self.home) if h == r] for r in range(self.ep_size)}
        return {"home": list(self.home), "experts_of_ep_rank": experts_of,
                "rank_load": None if self.last_report is None else self.last_report["rank_load"]}

    def shutdown(self) -> None:
        if self.group is not None and self.state == JobState.RUNNING and self.step > 0:
            if not any(c["step"] == self.step for c in self.checkpoints):  # the final state, durable
                self.checkpoint_requested = True
                self._checkpoint_boundary(self.step)
            self._commit_pending()
        if self.api_server is not None:  # control plane (issue 6)
            self.api_server.stop()
            self.api_server = None
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.state not in (JobState.ERRORED,):
            self._transition(JobState.FINISHED)
