"""The serving dashboard's placement panels, Ray-free: every query names a metric the serving engine exports, and
the observer turns the workers' counts, homes and copy table into per-expert load, the replica map and the
balancedness under the copies and with homes only."""
from __future__ import annotations

import re

import pytest
import torch

from k3ray.control.dashboards import panel_queries, serving
from k3ray.serve.metrics import SERVE_SPECS, ServeMetrics
from k3ray.policies import copies


class Recorder:
    """Stands in for a ray.util.metrics metric: the last value set per tag set."""

    def __init__(self):
        self.values: dict[tuple, float] = {}

    def set(self, value, tags=None):
        self.values[tuple(sorted((tags or {}).items()))] = value

    def observe(self, value, tags=None):
        self.values.setdefault(("observed",), []).append(value)


def test_every_serving_panel_queries_an_exported_metric():
    titles = set()
    for title, expr in panel_queries(serving()):
        names = set(re.findall(r"ray_(k3ray_serve_\w+?)(?:_bucket)?\{", expr))
        assert names and names <= set(SERVE_SPECS), (title, expr)
        titles.add(title)
    assert {"Served tokens per expert", "Replica map: EP ranks holding each expert",
            "Balancedness (mean / max rank load)"} <= titles


def test_the_observer_exports_per_expert_load_replica_map_and_balancedness():
    E, R = 8, 4
    home = [e * R // E for e in range(E)]
    table = [[], [0], [0], []]  # expert 0 (home rank 0) also held on ranks 1 and 2
    metrics = ServeMetrics("job")
    metrics.m = {name: Recorder() for name in SERVE_SPECS}
    layer_a = [30, 2, 1, 1, 1, 1, 0, 0]
    layer_b = [30, 0, 1, 1, 1, 1, 0, 0]
    metrics.expert_load([{1: layer_a}, {3: layer_b}], home, table)
    tokens = {dict(k)["expert"]: v for k, v in metrics.m["k3ray_serve_expert_tokens"].values.items()}
    assert tokens == {str(e): a + b for e, (a, b) in enumerate(zip(layer_a, layer_b))}
    holders = {dict(k)["expert"]: v for k, v in metrics.m["k3ray_serve_expert_holders"].values.items()}
    assert holders == {"0": 3, **{str(e): 1 for e in range(1, E)}}
    bal = {dict(k)["placement"]: v for k, v in metrics.m["k3ray_serve_balancedness_ratio"].values.items()}
    load = torch.tensor([a + b for a, b in zip(layer_a, layer_b)], dtype=torch.float64)
    # load [60, 2, 2, 2, 2, 2, 0, 0]; rank loads under the copies 20 + 2, 20 + 4, 20 + 4, 0 (mean 17.5, max 24),
    # homes only 62, 4, 4, 0
    assert bal["copies"] == pytest.approx(copies.balancedness(load, home, table)) == pytest.approx(17.5 / 24)
    assert bal["home"] == pytest.approx(17.5 / 62)
