"""Properties of the placement policies (k3ray.policies): MoonEP, persistent replication, GEMM scheduling."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from k3ray.policies import moonep, replication, scheduling

# ----------------------------------------------------------------------------------------------------------- MoonEP


def _counts(num_ranks: int, num_experts: int, skew: float, seed: int, scale: int = 200) -> torch.Tensor:
    """tokens_per_expert [R, E] with Zipf-like skew over a random expert permutation."""
    g = torch.Generator().manual_seed(seed)
    pop = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** skew
    pop = pop[torch.randperm(num_experts, generator=g)]
    rate = (scale * pop / pop.mean()).expand(num_ranks, num_experts).contiguous()
    return torch.poisson(rate, generator=g).to(torch.int64)


def check_plan(counts: torch.Tensor, plan: moonep.MoonEPPlan, home: torch.Tensor | None = None,
               slots: int | None = None) -> None:
    num_ranks, num_experts = counts.shape
    home = moonep.default_home(num_experts, num_ranks) if home is None else home
    if slots is None:
        slots = max(math.ceil(num_experts / num_ranks), int(torch.bincount(home, minlength=num_ranks).max()))
    alloc = plan.alloc
    assert alloc.shape == (num_experts, num_ranks) and alloc.dtype == torch.int64
    assert (alloc >= 0).all()
    # conservation
    assert torch.equal(alloc.sum(1), counts.sum(0))
    # exact balance: target = S//R (+1 on the lowest S%R ranks)
    total = int(counts.sum())
    expected = torch.full((num_ranks,), total // num_ranks, dtype=torch.int64)
    expected[: total % num_ranks] += 1
    assert torch.equal(moonep.rank_loads(alloc), expected)
    assert torch.equal(plan.target, expected)
    # slot limit and replica bookkeeping
    is_home = torch.zeros(num_ranks, num_experts, dtype=torch.bool)
    is_home[home, torch.arange(num_experts)] = True
    assert torch.equal(plan.replica_mask, (alloc.T > 0) & ~is_home)
    assert int(plan.replicas_per_rank.max()) <= slots
    assert plan.num_replicas == int(plan.replica_mask.sum())
    # send matrix consistent with counts and alloc
    send = plan.send(counts)
    assert torch.equal(send.sum(0), alloc.T.contiguous().T) and torch.equal(send.sum(2), counts)
    assert (send >= 0).all()
    for src in {0, num_ranks - 1}:
        assert torch.equal(plan.send_from(counts, src), send[src])


@settings(max_examples=60, deadline=None)
@given(num_ranks=st.integers(1, 12), experts_per_rank=st.integers(1, 6), extra=st.integers(0, 3),
       skew=st.floats(0.0, 3.0), seed=st.integers(0, 10_000))
def test_plan_properties_random(num_ranks, experts_per_rank, extra, skew, seed):
    num_experts = num_ranks * experts_per_rank + extra          # uneven when extra > 0
    counts = _counts(num_ranks, num_experts, skew, seed)
    check_plan(counts, moonep.plan(counts))


@settings(max_examples=40, deadline=None)
@given(num_ranks=st.integers(1, 8), num_experts=st.integers(1, 24), seed=st.integers(0, 10_000),
       skew=st.floats(0.0, 4.0))
def test_plan_arbitrary_homes(num_ranks, num_experts, seed, skew):
    g = torch.Generator().manual_seed(seed)
    home = torch.randint(0, num_ranks, (num_experts,), generator=g)     # some ranks may own no expert at all
    counts = _counts(num_ranks, num_experts, skew, seed)
    check_plan(counts, moonep.plan(counts, home=home), home=home)


@settings(max_examples=40, deadline=None)
@given(counts=st.integers(1, 6).flatmap(lambda r: st.lists(
    st.lists(st.integers(0, 50), min_size=r * 2, max_size=r * 2), min_size=r, max_size=r)))
def test_plan_explicit_small_counts(counts):
    check_plan(torch.tensor(counts), moonep.plan(torch.tensor(counts)))


@pytest.mark.parametrize("num_ranks,num_experts", [(1, 8), (4, 5), (8, 9), (8, 64), (16, 3 * 16 + 1), (3, 16)])
def test_plan_adversarial(num_ranks, num_experts):
    cases = []
    one_expert = torch.zeros(num_ranks, num_experts, dtype=torch.int64)
    one_expert[:, num_experts - 1] = 1000                      # one expert takes every token
    cases.append(one_expert)
    home = moonep.default_home(num_experts, num_ranks)
    one_home = torch.zeros(num_ranks, num_experts, dtype=torch.int64)
    one_home[:, home == 0] = 997                               # every token on one home rank
    cases.append(one_home)
    cases.append(torch.zeros(num_ranks, num_experts, dtype=torch.int64))   # zero tokens
    cases.append(torch.ones(num_ranks, num_experts, dtype=torch.int64))    # already balanced: no replica needed
    tiny = torch.zeros(num_ranks, num_experts, dtype=torch.int64)
    tiny[0, 0] = 1                                             # a single token slot
    cases.append(tiny)
    for counts in cases:
        plan = moonep.plan(counts)
        check_plan(counts, plan)
    if num_experts % num_ranks == 0:
        assert moonep.plan(torch.ones(num_ranks, num_experts, dtype=torch.int64)).num_replicas == 0


def test_plan_many_slightly_hot_ranks_cascade():
    """All ranks but one slightly over target with flat experts: the one-donor rule still meets the slot limit."""
    num_ranks, per_rank = 64, 14
    counts = torch.full((num_ranks, num_ranks * per_rank), 64, dtype=torch.int64)
    counts[:, (num_ranks - 1) * per_rank:] = 0
    plan = moonep.plan(counts)
    check_plan(counts, plan)
    assert int(plan.replicas_per_rank.max()) <= per_rank


def test_plan_uneven_homes_default_slots():
    counts = _counts(3, 16, 2.0, seed=1)
    plan = moonep.plan(counts)                                 # homes 6, 5, 5; default slots ceil(16/3) = 6
    assert torch.bincount(plan.home, minlength=3).tolist() == [6, 5, 5]
    check_plan(counts, plan)


def test_plan_deterministic_and_layout_independent():
    counts = _counts(16, 128, 1.2, seed=3)
    first, second = moonep.plan(counts), moonep.plan(counts.clone())
    assert torch.equal(first.alloc, second.alloc)
    for same in (counts.T.contiguous().T, counts.to(torch.int32), counts.flip(0).flip(0)):
        assert torch.equal(moonep.plan(same).alloc, first.alloc)


def test_plan_ties_resolve_by_index():
    """Equal-load experts and ranks: the plan must not depend on sort stability, only on indices."""
    counts = torch.zeros(4, 8, dtype=torch.int64)
    counts[0, :2] = 10                                         # rank 0 home experts 0, 1 equal and hot
    plan = moonep.plan(counts)
    check_plan(counts, plan)
    assert torch.equal(plan.alloc, moonep.plan(counts.clone()).alloc)


def test_plan_too_few_slots_is_an_error():
    counts = torch.full((64, 896), 64, dtype=torch.int64)
    counts[:, 63 * 14:] = 0
    with pytest.raises(ValueError, match="slots_per_rank"):
        moonep.plan(counts, slots_per_rank=2)


def test_plan_needs_few_replicas_on_zipf():
    counts = _counts(64, 896, 1.2, seed=0, scale=73)
    plan = moonep.plan(counts)
    check_plan(counts, plan)
    assert plan.num_replicas <= 3 * 64                         # a few copies per rank, not E/R


def test_metrics():
    counts = torch.tensor([[3, 1], [3, 1]])
    assert moonep.maxvio(counts) == pytest.approx(0.5)
    assert moonep.imbalance(torch.tensor([4, 2])) == pytest.approx(4 / 3)
    assert torch.equal(moonep.home_loads(counts), torch.tensor([6, 2]))
