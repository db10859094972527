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
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from k3ray.actors.worker import Worker
from k3ray.config import JobConfig
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


class TopologyError(RuntimeError):
    """The cluster cannot hold the requested topology."""


def contiguous_home(num_experts: int, num_ranks: int) -> list[int]:
    return [e * num_ranks // num_experts for e in range(num_experts)]


@ray.remote(num_cpus=0, max_concurrency=8)
class Controller:
    def __init__(self, cfg_dict: dict):
        self.cfg = JobConfig.model_validate(cfg_dict)
        self.state = JobState.INITIALIZING
        self.transitions: list[tuple[float, str, str]] = []
        self.workers: list[list] = []  # [pp][ep] actor handles
        self.home = contiguous_home(self.cfg.model.n_experts, self.cfg.parallel.ep)
        self.pg = None
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
    def start(self, placement_timeout_s: float = 60.0) -> dict:
        cfg = self.cfg
        par = cfg.parallel
        self._transition(JobState.SCHEDULING, f"pp={par.pp} ep={par.ep}")
        bundle = {"CPU": 1} if par.device == "cpu" else {"CPU": 1, "GPU": 1}
        total = ray.cluster_resources()
        for res, amount in bundle.items():
            need = amount * par.world_size
            if total.get(res, 0) < need:
                self._transition(JobState.ERRORED, "topology does not fit")
                raise TopologyError(
                    f"parallel.pp={par.pp} x parallel.ep={par.ep} needs {need:g} {res} (one per worker) but the "
                    f"cluster has {total.get(res, 0):g}; lower pp/ep or add nodes")
        self.pg = placement_group([dict(bundle) for _ in range(par.world_size)], strategy="PACK")
        if not self._wait(self.pg.ready(), placement_timeout_s):
            self._transition(JobState.ERRORED, "placement timed out")
            raise TopologyError(f"could not place {par.world_size} workers ({bundle} each) within "
                                f"{placement_timeout_s:g}s: resources are busy")
        self.workers = [[Worker.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=p * par.ep + e),
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
        ).remote(cfg.model_dump(), p, e, self.home) for e in range(par.ep)] for p in range(par.pp)]
        ip, port = ray.get(self.workers[0][0].rendezvous_address.remote(), timeout=placement_timeout_s)
        if ip == ray.util.get_node_ip_address() and self._single_node():
            ip = "127.0.0.1"
        backend = par.backend if par.backend != "auto" else ("nccl" if par.device == "cuda" else "gloo")
        ray.get([w.setup.remote(f"tcp://{ip}:{port}", backend) for w in self._all()], timeout=placement_timeout_s)
        self._apply_policies()
        self._transition(JobState.RUNNING, f"{par.world_size} workers, backend {backend}")
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

    @staticmethod
    def _single_node() -> bool:
        return len([n for n in ray.nodes() if n["Alive"]]) == 1

    @staticmethod
    def _wait(ref, timeout: float) -> bool:
        ready, _ = ray.wait([ref], timeout=timeout)
        return bool(ready)

    def _all(self) -> list:
        return [w for row in self.workers for w in row]

    # -- steps ---------------------------------------------------------------------------------------------------
    def train_step(self, step: int, batch_index: int) -> dict:
        t0 = time.perf_counter()  # control plane (issue 6)
        self._apply_pending_policies(step)
        reports = ray.get([w.train_step.remote(step, batch_index) for w in self._all()])
        self.step = step + 1
        self.last_report = self._merge(step, batch_index, reports).to_dict()
        # -- control plane (issue 6): publish metrics, keep the per-step overhead --
        from k3ray.metrics import timed_publish
        self.metrics_overhead_s.append(timed_publish(self.metrics, self, self.last_report, time.perf_counter() - t0))
        del self.metrics_overhead_s[:-1000]
        # -- end control plane --
        return self.last_report

    def evaluate(self) -> float:
        return ray.get([w.evaluate.remote() for w in self._all()])[0]

    def _merge(self, step: int, batch_index: int, reports: list[dict]) -> StepReport:
        cfg = self.cfg
        ep = cfg.parallel.ep
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
                          tokens=cfg.global_batch_sequences * cfg.data.seq_len,
                          tokens_per_expert=tpe, maxvio={k: layer_maxvio(v) for k, v in tpe.items()},
                          activations=acts, timings=timings, rank_load=rank_load)

    # -- placement and policies ----------------------------------------------------------------------------------
    def _apply_policies(self) -> None:
        mp = self.cfg.policies.moonep
        ray.get([w.set_policy.remote(mp.enabled, mp.slots_per_rank) for w in self._all()])

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
        if "moonep" in pending:
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
        for row in self.workers:
            payloads = {}
            for e in expert_ids:
                src = self.home[e]
                if src == dst_ep_rank:
                    continue
                for layer, payload in ray.get(row[src].export_shard.remote([e])).items():
                    payloads.setdefault(layer, []).append(payload)
            ray.get([w.set_placement.remote(new_home, payloads if r == dst_ep_rank else None)
                     for r, w in enumerate(row)])
        self.home = new_home
        return self.placement()

    # -- views ---------------------------------------------------------------------------------------------------
    def status(self) -> dict:
        par = self.cfg.parallel
        return {"name": self.cfg.name, "state": self.state.value, "step": self.step, "pp": par.pp, "ep": par.ep,
                "workers": par.world_size, "device": par.device,
                "loss": None if self.last_report is None else self.last_report["loss"],
                "api_url": self.api_url,  # control plane (issue 6)
                "tokens_per_s": None if self.metrics is None else self.metrics.tokens_per_s,  # control plane
                "transitions": [{"time": t, "state": s, "why": w} for t, s, w in self.transitions]}

    def placement(self) -> dict:
        experts_of = {r: [e for e, h in enumerate(self.home) if h == r] for r in range(self.cfg.parallel.ep)}
        return {"home": list(self.home), "experts_of_ep_rank": experts_of,
                "rank_load": None if self.last_report is None else self.last_report["rank_load"]}

    def shutdown(self) -> None:
        if self.api_server is not None:  # control plane (issue 6)
            self.api_server.stop()
            self.api_server = None
        for w in self._all():
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self.state not in (JobState.ERRORED,):
            self._transition(JobState.FINISHED)
