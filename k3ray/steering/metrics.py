"""The metric conventions training and serving publish under (`ray.util.metrics`, exported as `ray_<name>`):
`k3ray_` names, base units, `_total` counters, every series tagged with k3ray_job (the job's name; `job` is
Prometheus' own label), per-expert load as a histogram of load / mean load over these buckets."""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

EXPERT_LOAD_BUCKETS = [0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0]


def build_metric(name: str, spec: tuple[str, str, tuple[str, ...]], job: str, buckets: list[float] | None = None):
    """One metric from its (kind, description, tag keys) spec, tagged with the job."""
    kind, desc, tags = spec
    keys = ("k3ray_job",) + tags
    if kind == "gauge":
        metric = Gauge(name, desc, tag_keys=keys)
    elif kind == "counter":
        metric = Counter(name, desc, tag_keys=keys)
    else:
        metric = Histogram(name, desc, boundaries=buckets, tag_keys=keys)
    metric.set_default_tags({"k3ray_job": job})
    return metric
