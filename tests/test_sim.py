"""The K3-scale simulator (k3ray.sim, k3ray.traces) on small shapes: traces, sampling, per-policy figures and
modelled times, trace files."""
from __future__ import annotations

import json

import pytest
import torch

from k3ray import sim, traces
from k3ray.config import load_config


@pytest.fixture(scope="module")
def k3():
    return load_config("configs/k3.yaml")


def test_inclusion_probs_cap_and_sum():
    pop = torch.tensor([[100.0, 1, 1, 1, 1, 1, 1, 1], [1.0] * 8])
    pi = traces.inclusion_probs(pop, top_k=2)
    assert torch.allclose(pi.sum(1), torch.tensor([2.0, 2.0], dtype=torch.float64))
    assert pi[0, 0] == 1.0 and (pi <= 1).all()
    assert torch.allclose(pi[1], torch.full((8,), 0.25, dtype=torch.float64))


@pytest.mark.parametrize("spec", ["uniform", "zipf:1.2", "dirichlet:0.3", "hot-shift:2"])
def test_trace_counts_shape_and_totals(spec):
    s, k = 64, 4
    tr = traces.Trace(spec, num_layers=3, num_ranks=5, num_experts=32, top_k=k, tokens_per_rank=s, seed=1)
    counts = tr.counts(0, torch.Generator().manual_seed(0))
    assert counts.shape == (3, 5, 32) and counts.dtype == torch.int64
    assert (counts.sum(2) == s * k).all()                     # exactly s*K slots per rank and layer
    assert (counts >= 0).all() and (counts <= s).all()         # K distinct experts per token


def test_zipf_is_skewed_and_hot_shift_moves():
    tr = traces.Trace("zipf:1.5", 2, 4, 64, 4, 256, seed=0)
    counts = tr.counts(0, torch.Generator().manual_seed(0))
    assert sim.moonep.maxvio(counts[0]) > 3
    hs = traces.Trace("hot-shift:2", 1, 4, 64, 4, 256, seed=0)
    pop0, pop1, pop2 = (hs._popularity(step) for step in (0, 1, 2))
    assert torch.equal(pop0, pop1) and not torch.equal(pop0, pop2)


def test_unknown_trace_is_an_error():
    with pytest.raises(ValueError, match="unknown trace"):
        traces.Trace("pareto", 1, 2, 8, 2, 16)


@pytest.mark.parametrize("fmt", [".pt", ".json"])
def test_trace_file_round_trip(tmp_path, fmt, k3):
    counts = torch.randint(0, 50, (2, 3, 4, k3.model.n_experts))          # [steps, L, R, E]
    path = tmp_path / f"trace{fmt}"
    traces.save_trace(path, counts)
    assert torch.equal(traces.load_trace(path), counts)
    tr = traces.Trace(str(path), num_layers=10, num_ranks=99, num_experts=k3.model.n_experts, top_k=16,
                   tokens_per_rank=1)
    assert tr.num_layers == 3 and tr.num_ranks == 4                         # taken from the file
    assert torch.equal(tr.counts(1, torch.Generator()), counts[1])
    result = sim.run_simulation(k3, ranks=4, trace=str(path), steps=2, layers=2, tokens_per_rank=16)
    assert result.layers == 2 and result.policies["moonep"].imbalance_worst == pytest.approx(1.0, abs=1e-3)


def test_global_trace_file_split_over_ranks(tmp_path):
    counts = torch.tensor([[[10, 3, 0, 7]]])                                  # [steps=1, L=1, E=4]
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"tokens_per_expert": counts.tolist()}))
    tr = traces.Trace(str(path), 1, 3, 4, 2, 8)
    per_rank = tr.counts(0, torch.Generator())[0]
    assert per_rank.shape == (3, 4) and torch.equal(per_rank.sum(0), counts[0, 0])


def test_bad_trace_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"counts": [1, 2]}))
    with pytest.raises(ValueError, match="tokens_per_expert"):
        traces.load_trace(path)


def test_run_simulation_smoke(k3):
    result = sim.run_simulation(k3, ranks=16, trace="zipf:1.2", steps=3, layers=2, tokens_per_rank=512, seed=0,
                                rebalance_every=1)
    pol = result.policies
    assert set(pol) == set(sim.POLICIES)
    assert pol["none"].imbalance_mean > 1.5
    assert pol["moonep"].imbalance_worst == pytest.approx(1.0, abs=1e-4)
    assert pol["replicas+moonep"].imbalance_worst == pytest.approx(1.0, abs=1e-4)
    assert 1.0 <= pol["replicas"].imbalance_mean < pol["none"].imbalance_mean
    assert pol["moonep"].replicas_per_rank_max <= 896 // 16
    assert pol["moonep"].copy_bytes_per_step_per_rank > 0 and pol["none"].copy_bytes_per_step_per_rank == 0
    assert result.expert_bytes == 3 * 3584 * 3072 * 2
    data = result.to_json()
    json.dumps(data)
    assert data["policies"]["moonep"]["balancedness_mean"] == pytest.approx(1.0, abs=1e-4)
    table = sim.format_table(result)
    assert "replicas+moonep" in table and "zipf:1.2" in table


def test_run_simulation_deterministic_uneven_homes(k3):
    """R=48 does not divide E=896: uneven homes; same seed, same figures."""
    a = sim.run_simulation(k3, ranks=48, trace="hot-shift:1", steps=2, layers=1, tokens_per_rank=128, seed=3)
    b = sim.run_simulation(k3, ranks=48, trace="hot-shift:1", steps=2, layers=1, tokens_per_rank=128, seed=3)
    for name in sim.POLICIES:
        assert a.policies[name].imbalance_mean == b.policies[name].imbalance_mean
    assert a.policies["moonep"].imbalance_worst == pytest.approx(1.0, abs=1e-3)


def _sampled_counts(cfg, trace: str, ranks: int, steps: int, layers: int, tokens_per_rank: int, seed: int):
    """The counts run_simulation draws: the same trace, generator and order (step-major, then layer)."""
    tr = traces.Trace(trace, layers, ranks, cfg.model.n_experts, cfg.model.top_k, tokens_per_rank, seed)
    gen = torch.Generator().manual_seed(seed)
    return [[tr.counts(step, gen, layer=layer) for layer in range(layers)] for step in range(steps)]


def test_modelled_step_time_prices_rows_and_weight_copies(k3):
    """none: the busiest rank's rows; MoonEP: its rows plus its copies' traffic, recomputed here from the same counts;
    the priced MoonEP is never modelled slower than either, per layer and so per step."""
    args = dict(trace="zipf:1.2", ranks=16, steps=2, layers=2, tokens_per_rank=512, seed=0)
    result = sim.run_simulation(k3, rebalance_every=1, **args)
    cost, pol = result.cost, result.policies
    counts = _sampled_counts(k3, **args)
    none_ms = sum(cost.row_s * int(sim.moonep.home_loads(c).max()) for step in counts for c in step) / 2 * 1e3
    exact_ms = sum(sim.moonep.plan(c).modelled_s(cost) for step in counts for c in step) / 2 * 1e3
    assert pol["none"].modelled_ms_per_step == pytest.approx(none_ms) and pol["none"].weights_ms_per_step == 0
    assert pol["moonep"].modelled_ms_per_step == pytest.approx(exact_ms)
    assert pol["moonep"].weights_ms_per_step > 0
    assert pol["moonep-priced"].modelled_ms_per_step <= min(none_ms, exact_ms) * (1 + 1e-9)
    assert pol["replicas+moonep-priced"].modelled_ms_per_step <= \
        pol["replicas+moonep"].modelled_ms_per_step * (1 + 1e-9)
    assert pol["replicas"].weights_ms_per_step > 0           # persistent copies sync once per optimizer step
    assert cost.passes == 2 and result.to_json()["cost"]["weight_bytes"] == result.expert_bytes


def test_uniform_trace_priced_moonep_makes_no_replicas(k3):
    """Uniform routing at K3 scale: exact MoonEP copies about one expert per rank and layer for sampling noise; the
    priced plan copies nothing and is modelled exactly as fast as no MoonEP."""
    result = sim.run_simulation(k3, ranks=16, trace="uniform", steps=1, layers=2, tokens_per_rank=4096, seed=0)
    pol = result.policies
    assert pol["moonep"].replicas_per_rank_mean > 0.5
    assert pol["moonep-priced"].replicas_per_rank_max == 0
    assert pol["moonep-priced"].modelled_ms_per_step == pytest.approx(pol["none"].modelled_ms_per_step)
    assert pol["moonep-priced"].modelled_ms_per_step < pol["moonep"].modelled_ms_per_step


def test_interconnect_prices_the_copies(k3):
    """The same trace with InfiniBand between every pair of ranks (ranks_per_node=1): MoonEP's copies cost more."""
    args = dict(ranks=16, trace="zipf:1.2", steps=1, layers=2, tokens_per_rank=512, seed=0)
    nvlink, ib = (sim.run_simulation(load_config("configs/k3.yaml", {"policies.moonep.ranks_per_node": n}), **args)
                  for n in (16, 1))
    ratio = k3.policies.moonep.nvlink_gb_per_s / k3.policies.moonep.ib_gb_per_s
    assert ib.policies["moonep"].weights_ms_per_step == pytest.approx(
        nvlink.policies["moonep"].weights_ms_per_step * ratio)
    priced = [run.policies["moonep-priced"].replicas_per_rank_mean for run in (ib, nvlink)]
    assert priced[0] <= priced[1]
