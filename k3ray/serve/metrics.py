"""Serving metrics through `ray.util.metrics` (exported as `ray_k3ray_serve_*`), published by the serving engine
actor after every iteration (`ServeMetrics` is one of its observers; it builds the metrics in the engine's process).

Same conventions as the training job's (k3ray.steering.metrics): base units, `_total` counters, bounded labels:
k3ray_job, state (running, waiting), finish (stop, length, cancelled, error), layer, expert (E values), placement
(copies, home).
Per-expert load is a per-layer histogram of load / mean load and, summed over layers, a gauge per expert, collected
from the workers every `expert_load_every` iterations; with it the replica map (holders per expert: its home and its
read-only copies) and the balancedness (mean / max rank load) under the copies and with homes only."""
from __future__ import annotations

from k3ray.steering.metrics import EXPERT_LOAD_BUCKETS, build_metric

LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
FINISH = ("stop", "length", "cancelled", "error")

SERVE_SPECS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "k3ray_serve_ttft_seconds": ("histogram", "time from a request's arrival to its first token", ()),
    "k3ray_serve_inter_token_seconds": ("histogram", "time between consecutive tokens of a request", ()),
    "k3ray_serve_iteration_seconds": ("histogram", "one engine iteration (schedule, grid forward, sample)", ()),
    "k3ray_serve_queue_depth": ("gauge", "requests waiting for a state slot", ()),
    "k3ray_serve_requests": ("gauge", "requests by state", ("state",)),
    "k3ray_serve_kv_pages_used": ("gauge", "latent-KV pages held by requests, all ranks", ()),
    "k3ray_serve_kv_pages_total": ("gauge", "latent-KV pages, all ranks", ()),
    "k3ray_serve_prefix_cache_hit_ratio": ("gauge", "prompt tokens taken from the prefix cache / prompt tokens, "
                                           "since the grid started", ()),
    "k3ray_serve_prefix_cache_bytes": ("gauge", "bytes the prefix cache holds (latent pages and KDA state "
                                       "checkpoints), all ranks", ()),
    "k3ray_serve_tokens_per_second": ("gauge", "output tokens per second over the last iteration", ()),
    "k3ray_serve_output_tokens_total": ("counter", "tokens generated", ()),
    "k3ray_serve_requests_total": ("counter", "requests finished, by finish reason", ("finish",)),
    "k3ray_serve_expert_load_ratio": ("histogram", "per-expert served load / mean load, one observation per expert "
                                      "and collection", ("layer",)),
    "k3ray_serve_expert_tokens": ("gauge", "routed tokens per expert since the last collection, all MoE layers",
                                  ("expert",)),
    "k3ray_serve_expert_holders": ("gauge", "EP ranks holding each expert: its home and its read-only copies",
                                   ("expert",)),
    "k3ray_serve_balancedness_ratio": ("gauge", "mean / max EP-rank load of the last collection's expert load, "
                                       "under the copies in use and with homes only", ("placement",)),
}


def _build(name: str, job: str):
    buckets = EXPERT_LOAD_BUCKETS if name == "k3ray_serve_expert_load_ratio" else LATENCY_BUCKETS
    return build_metric(name, SERVE_SPECS[name], job, buckets)


class ServeMetrics:
    """An observer of the serving engine: `iteration` after each iteration, `expert_load` with the workers' counts."""

    def __init__(self, job: str, expert_load_every: int = 50):
        self.job, self.expert_load_every = job, expert_load_every
        self.m: dict | None = None  # built on first use, in the engine actor's process

    def _metrics(self) -> dict:
        if self.m is None:
            self.m = {name: _build(name, self.job) for name in SERVE_SPECS}
            for finish in FINISH:  # Counter.inc refuses 0: export the series at 0 from the start
                self.m["k3ray_serve_requests_total"]._record(0.0, tags={"finish": finish})
            self.m["k3ray_serve_output_tokens_total"]._record(0.0, tags={})
        return self.m

    def iteration(self, changed: list, sched, seconds: float) -> None:
        m = self._metrics()
        tokens = 0
        for req in changed:
            if req.token_times and req.finish != "cancelled" and req.finish != "error":
                tokens += 1
                if len(req.token_times) == 1:
                    m["k3ray_serve_ttft_seconds"].observe(req.token_times[0] - req.arrival)
                else:
                    m["k3ray_serve_inter_token_seconds"].observe(req.token_times[-1] - req.token_times[-2])
            if req.finish is not None:
                m["k3ray_serve_requests_total"].inc(tags={"finish": req.finish})
        if tokens:
            m["k3ray_serve_output_tokens_total"].inc(tokens)
        u = sched.usage()
        m["k3ray_serve_iteration_seconds"].observe(seconds)
        m["k3ray_serve_queue_depth"].set(u["waiting"])
        m["k3ray_serve_requests"].set(u["running"], tags={"state": "running"})
        m["k3ray_serve_requests"].set(u["waiting"], tags={"state": "waiting"})
        m["k3ray_serve_kv_pages_used"].set(u["pages_used"])
        m["k3ray_serve_kv_pages_total"].set(u["pages_total"])
        m["k3ray_serve_tokens_per_second"].set(tokens / seconds if seconds > 0 else 0.0)
        if "prefix_cache" in u:
            m["k3ray_serve_prefix_cache_hit_ratio"].set(u["prefix_cache"]["hit_rate"])
            m["k3ray_serve_prefix_cache_bytes"].set(u["prefix_cache"]["cached_bytes"])

    def expert_load(self, per_worker: list[dict[int, list[int]]], home: list[int] | None = None,
                    copies: list[list[int]] | None = None) -> None:
        """Workers' routed-token counts by layer and expert since the last collection; with the grid's homes [E] and
        copy table (R lists of expert ids), the replica map and the balancedness too."""
        m, totals = self._metrics(), {}
        for worker in per_worker:
            for layer, counts in worker.items():
                acc = totals.setdefault(layer, [0] * len(counts))
                totals[layer] = [a + c for a, c in zip(acc, counts)]
        for layer, load in totals.items():
            mean = sum(load) / len(load)
            if mean > 0:
                for x in load:
                    m["k3ray_serve_expert_load_ratio"].observe(x / mean, tags={"layer": str(layer)})
        if not totals:
            return
        per_expert = [sum(col) for col in zip(*totals.values())]
        for e, tokens in enumerate(per_expert):
            m["k3ray_serve_expert_tokens"].set(tokens, tags={"expert": str(e)})
        if home is not None:
            # imported here: this observer reaches the engine actor with its constructor's arguments, so this module
            # is imported there before the engine starts its workers, which it does before importing torch
            import torch

            from k3ray.policies import copies as copies_policy

            table = copies or [[] for _ in range(max(home) + 1)]
            for e, ranks in enumerate(copies_policy.holders_of(home, table)):
                m["k3ray_serve_expert_holders"].set(len(ranks), tags={"expert": str(e)})
            load = torch.tensor(per_expert, dtype=torch.float64)
            for placement, used in (("copies", table), ("home", [[] for _ in table])):
                m["k3ray_serve_balancedness_ratio"].set(copies_policy.balancedness(load, home, used),
                                                        tags={"placement": placement})
