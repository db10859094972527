"""Job metrics through `ray.util.metrics` (Ray exports them as `ray_<name>` on each node's metrics port).

Prometheus conventions: `k3ray_` prefix, base units (seconds, ratios, tokens), `_total` for counters, and bounded
label sets only: k3ray_job (the job name; `job` is Prometheus' own label), layer (model layers), rank (EP ranks),
phase (step phases), rule (INCIDENT_RULES), policy (POLICY_NAMES), state (JobState values), le (buckets). Per-expert load is a per-layer histogram of
load / mean load, never one series per expert.

`MetricsCallback` hooks them into the controller (k3ray.train.callbacks): `JobMetrics.publish` once per step
with the merged report, folding in what changed in the controller since the last step (policy changes, incidents,
state transitions). Reliability counters are exported at zero from the start so dashboards show 0 rather than
"no data" before the first incident.
"""
from __future__ import annotations

import time

from k3ray.config import POLICY_NAMES
from k3ray.steering.metrics import EXPERT_LOAD_BUCKETS, build_metric
from k3ray.train.callbacks import Callback
from k3ray.train.state import JobState

PHASES = ("compute", "dispatch_combine", "pipeline_wait", "optimizer", "step")
INCIDENT_RULES = ("nonfinite_loss", "nonfinite_grad", "activation", "loss_spike", "grad_norm_spike", "worker_lost",
                  "collective_timeout", "checkpoint_damaged", "checkpoint_none", "checkpoint_abandoned",
                  "checkpoint_write_failed", "resumed_with_changes", "other")
STATES = tuple(s.value for s in JobState)
STEP_SECONDS_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0, 30.0]

# name -> (kind, description, tag keys); the dashboards and their test use this table.
SPECS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "k3ray_loss": ("gauge", "training loss of the last step (nats per token)", ()),
    "k3ray_grad_norm": ("gauge", "global gradient norm of the last step", ()),
    "k3ray_learning_rate": ("gauge", "learning rate of the last step", ()),
    "k3ray_step": ("gauge", "index of the last finished step", ()),
    "k3ray_steps_total": ("counter", "steps finished", ()),
    "k3ray_tokens_total": ("counter", "tokens trained on", ()),
    "k3ray_tokens_per_second": ("gauge", "tokens per second over the last step (controller wall time)", ()),
    "k3ray_step_phase_seconds": ("gauge", "time of the last step by phase (max over workers)", ("phase",)),
    "k3ray_step_phase_seconds_total": ("counter", "time spent in each step phase (max over workers)", ("phase",)),
    "k3ray_step_seconds": ("histogram", "controller wall time of a step", ()),
    "k3ray_routed_tokens": ("gauge", "routed tokens computed by each EP rank in the last step", ("layer", "rank")),
    "k3ray_rank_load_max_tokens": ("gauge", "largest per-rank routed token count in the last step", ("layer",)),
    "k3ray_rank_load_mean_tokens": ("gauge", "mean per-rank routed token count in the last step", ("layer",)),
    "k3ray_maxvio_ratio": ("gauge", "MaxVio of the last step: max expert load / mean expert load - 1", ("layer",)),
    "k3ray_expert_load_ratio": ("histogram", "per-expert load / mean expert load, one observation per expert "
                                "and step", ("layer",)),
    "k3ray_activation_maxabs": ("gauge", "max |routed MoE output| in the last step", ("layer",)),
    "k3ray_residual_maxabs": ("gauge", "max |residual stream| in the last step", ("layer",)),
    "k3ray_replica_slots": ("gauge", "expert replica slots per EP rank of the live MoonEP policy (0: off)", ()),
    "k3ray_policy_changes_total": ("counter", "policy changes applied at a step boundary", ("policy",)),
    "k3ray_incidents_total": ("counter", "incidents recorded by the guards and fault handling", ("rule",)),
    "k3ray_rollbacks_total": ("counter", "restores of the last good snapshot", ()),
    "k3ray_recoveries_total": ("counter", "recoveries finished (recovering -> running)", ()),
    "k3ray_recovery_seconds_total": ("counter", "time spent recovering", ()),
    "k3ray_snapshots_total": ("counter", "in-memory snapshots taken", ()),
    "k3ray_snapshot_seconds_total": ("counter", "time spent taking snapshots", ()),
    "k3ray_checkpoints_total": ("counter", "durable checkpoints written", ()),
    "k3ray_checkpoint_seconds_total": ("counter", "time spent writing durable checkpoints", ()),
    "k3ray_job_state": ("gauge", "1 for the job's current state, 0 for the others", ("state",)),
}
_ZERO_COUNTERS = {"k3ray_incidents_total": [{"rule": r} for r in INCIDENT_RULES],
                  "k3ray_policy_changes_total": [{"policy": p} for p in POLICY_NAMES],
                  "k3ray_rollbacks_total": [{}], "k3ray_recoveries_total": [{}], "k3ray_recovery_seconds_total": [{}],
                  "k3ray_snapshots_total": [{}], "k3ray_snapshot_seconds_total": [{}],
                  "k3ray_checkpoints_total": [{}], "k3ray_checkpoint_seconds_total": [{}]}


def _build(name: str, job: str):
    buckets = EXPERT_LOAD_BUCKETS if name == "k3ray_expert_load_ratio" else STEP_SECONDS_BUCKETS
    return build_metric(name, SPECS[name], job, buckets)


class JobMetrics:
    """All of one job's metrics; `publish` is the per-step entry point (cheap: O(layers x (R + E)) records)."""

    def __init__(self, job: str):
        self.m = {name: _build(name, job) for name in SPECS}
        for name, tag_sets in _ZERO_COUNTERS.items():
            for tags in tag_sets:  # Counter.inc refuses 0; export the series at 0 (Prometheus: initialise counters)
                self.m[name]._record(0.0, tags=tags)
        self.tokens_per_s: float | None = None
        self._audit_seen = 0
        self._incidents_seen = 0
        self._transitions_seen = 0
        self._recovering_since: float | None = None

    def publish(self, report: dict, wall_s: float) -> None:
        m = self.m
        self.tokens_per_s = report["tokens"] / wall_s if wall_s > 0 else None
        m["k3ray_loss"].set(report["loss"])
        m["k3ray_grad_norm"].set(report["grad_norm"])
        m["k3ray_learning_rate"].set(report["lr"])
        m["k3ray_step"].set(report["step"])
        m["k3ray_steps_total"].inc()
        m["k3ray_tokens_total"].inc(max(report["tokens"], 1))
        if self.tokens_per_s is not None:
            m["k3ray_tokens_per_second"].set(self.tokens_per_s)
        m["k3ray_step_seconds"].observe(wall_s)
        for phase, seconds in report["timings"].items():
            if phase in PHASES:
                m["k3ray_step_phase_seconds"].set(seconds, tags={"phase": phase})
                if seconds > 0:
                    m["k3ray_step_phase_seconds_total"].inc(seconds, tags={"phase": phase})
        for layer, loads_R in report["rank_load"].items():
            tag = {"layer": str(layer)}
            for rank, tokens in enumerate(loads_R):
                m["k3ray_routed_tokens"].set(tokens, tags={"layer": str(layer), "rank": str(rank)})
            m["k3ray_rank_load_max_tokens"].set(max(loads_R), tags=tag)
            m["k3ray_rank_load_mean_tokens"].set(sum(loads_R) / len(loads_R), tags=tag)
        for layer, tpe_RE in report["tokens_per_expert"].items():
            load_E = [sum(col) for col in zip(*tpe_RE)]
            mean = sum(load_E) / len(load_E)
            if mean > 0:
                hist, tag = m["k3ray_expert_load_ratio"], {"layer": str(layer)}
                for load in load_E:
                    hist.observe(load / mean, tags=tag)
        for layer, maxvio in report["maxvio"].items():
            m["k3ray_maxvio_ratio"].set(maxvio, tags={"layer": str(layer)})
        for layer, acts in report["activations"].items():
            m["k3ray_activation_maxabs"].set(acts["routed_maxabs"], tags={"layer": str(layer)})
            m["k3ray_residual_maxabs"].set(acts["resid_maxabs"], tags={"layer": str(layer)})

    def sync(self, ctrl) -> None:
        """Fold in the controller's changes since the last call: applied policy changes, incidents, transitions,
        and the live MoonEP slots. Reads the controller's lists; never writes them."""
        m = self.m
        audit = ctrl.audit_log()
        for entry in audit[self._audit_seen:]:
            if not entry["applied"]:
                break
            m["k3ray_policy_changes_total"].inc(tags={"policy": entry["policy"]})
            self._audit_seen += 1
        incidents = ctrl.get_incidents()
        for incident in incidents[self._incidents_seen:]:
            if incident.get("kind") == "grow_back":  # a resize back to full size, not an incident
                continue
            rule = incident.get("rule", "other")
            m["k3ray_incidents_total"].inc(tags={"rule": rule if rule in INCIDENT_RULES else "other"})
            if incident.get("action") == "rollback":
                m["k3ray_rollbacks_total"].inc()
        self._incidents_seen = len(incidents)
        for t, state, _why in ctrl.machine.history[self._transitions_seen:]:
            if state == "recovering":
                self._recovering_since = t
            elif self._recovering_since is not None and state == "running":
                m["k3ray_recoveries_total"].inc()
                m["k3ray_recovery_seconds_total"].inc(max(t - self._recovering_since, 1e-9))
                self._recovering_since = None
        self._transitions_seen = len(ctrl.machine.history)
        self.set_state(ctrl.machine.state.value)
        mp = ctrl.cfg.policies.moonep
        slots = (mp.slots_per_rank or ctrl.cfg.model.n_experts // ctrl.cfg.parallel.ep) if mp.enabled else 0
        m["k3ray_replica_slots"].set(slots)

    def set_state(self, current: str) -> None:
        for state in STATES:
            self.m["k3ray_job_state"].set(1.0 if state == current else 0.0, tags={"state": state})

    # entry points for the snapshot and checkpoint code paths
    def record_snapshot(self, seconds: float) -> None:
        self.m["k3ray_snapshots_total"].inc()
        self.m["k3ray_snapshot_seconds_total"].inc(max(seconds, 1e-9))

    def record_checkpoint(self, seconds: float) -> None:
        self.m["k3ray_checkpoints_total"].inc()
        self.m["k3ray_checkpoint_seconds_total"].inc(max(seconds, 1e-9))


class MetricsCallback(Callback):
    """The job's metrics as a controller callback; keeps the per-step publishing overhead (benchmarks read it)."""

    def __init__(self):
        self.metrics: JobMetrics | None = None  # made in the controller's process, on start
        self.overhead_s: list[float] = []

    def on_start(self, ctrl) -> None:
        self.metrics = JobMetrics(ctrl.cfg.name)
        self.metrics.set_state(ctrl.machine.state.value)

    def on_step(self, ctrl, report: dict, wall_s: float) -> None:
        t0 = time.perf_counter()
        self.metrics.publish(report, wall_s)
        self.metrics.sync(ctrl)
        self.overhead_s.append(time.perf_counter() - t0)
        del self.overhead_s[:-1000]

    def on_snapshot(self, stall_s: float) -> None:
        if self.metrics is not None:
            self.metrics.record_snapshot(stall_s)

    def on_checkpoint(self, step: int, path, parts: list, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.record_checkpoint(seconds)

    def status(self) -> dict:
        return {"tokens_per_s": None if self.metrics is None else self.metrics.tokens_per_s}
