"""The Controller actor: one per job. Owns the topology, the placement table (expert -> EP rank, per stage) and
the live policies; drives steps and merges the workers' reports. An explicit state machine: every transition is
named in `JobState` (k3ray/runtime/resilience.py) and logged; failure handling and durable checkpoints are the
Resilience and DurableCheckpoints mixins."""
from __future__ import annotations

import logging
import threading
import time

import ray
import torch
from pydantic import ValidationError

from k3ray.config import JobConfig
from k3ray.policies import guards, recovery
from k3ray.runtime.durable import DurableCheckpoints
from k3ray.runtime.group import TopologyError, WorkerGroup, WorkerLost
from k3ray.runtime.resilience import GuardError, JobState, Resilience, Snapshot
from k3ray.runtime.step import StepReport, layer_maxvio

__all__ = ["Controller", "GuardError", "JobState", "TopologyError"]

log = logging.getLogger("k3ray.controller")


@ray.remote(num_cpus=0, max_concurrency=8)
class Controller(Resilience, DurableCheckpoints):
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
        self.snap: Snapshot | None = None  # the committed snapshot recovery falls back on
        self.pending_snap: Snapshot | None = None  # started, bytes still arriving
        self.guard_state = guards.GuardState()
        self.lr_scale = 1.0
        self.fired: set[int] = set()  # indices of fault drills already injected
        self.shrunk_at: int | None = None
        self.pending_commit: tuple[int, dict] | None = None  # checkpoint parts being written: (step, meta)
        self.checkpoint_requested = False
        self.checkpoints: list[dict] = []  # committed: step, path, seconds
        self.snapshot_seconds: list[float] = []  # training stalled per snapshot
        self.snapshot_total_seconds: list[float] = []  # start to committed
        self.pending_faults = list(enumerate(ft.faults))
        self.poisoned = False  # a NaN drill is armed on the workers for the current attempt
        self.load_history: torch.Tensor | None = None  # [E] decayed tokens per expert, for rebalancing
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
        if self._snapshot_due(step):
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
        self._commit_snapshot(wait=False)
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
            if self.cfg.checkpoint.at_end and not any(c["step"] == self.step for c in self.checkpoints):
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
