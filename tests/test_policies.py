"""Properties of the placement policies (k3ray.policies): MoonEP, persistent replication, GEMM scheduling."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from k3ray.config import MoonEPPolicy, load_config
from k3ray.policies import moonep, replication, retry, scheduling
from k3ray.policies.expert_cost import ExpertCost
from k3ray.policies.planner import MoonEPPlanner

# ----------------------------------------------------------------------------------------------------------- MoonEP


def _counts(num_ranks: int, num_experts: int, skew: float, seed: int, scale: int = 200) -> torch.Tensor:
    """tokens_per_expert [R, E] with Zipf-like skew over a random expert permutation."""
    g = torch.Generator().manual_seed(seed)
    pop = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** skew
    pop = pop[torch.randperm(num_experts, generator=g)]
    rate = (scale * pop / pop.mean()).expand(num_ranks, num_experts).contiguous()
    return torch.poisson(rate, generator=g).to(torch.int64)


def check_plan(counts: torch.Tensor, plan: moonep.MoonEPPlan, home: torch.Tensor | None = None,
               slots: int | None = None, exact: bool = True) -> None:
    """Every guarantee of the module doc; exact=False (priced plans): balance only as far as the plan's target."""
    num_ranks, num_experts = counts.shape
    home = moonep.default_home(num_experts, num_ranks) if home is None else home
    if slots is None:
        slots = max(math.ceil(num_experts / num_ranks), int(torch.bincount(home, minlength=num_ranks).max()))
    alloc = plan.alloc
    assert alloc.shape == (num_experts, num_ranks) and alloc.dtype == torch.int64
    assert (alloc >= 0).all()
    # conservation
    assert torch.equal(alloc.sum(1), counts.sum(0))
    assert torch.equal(moonep.rank_loads(alloc), plan.target)
    assert int(plan.target.max()) <= int(moonep.home_loads(counts, home).max())
    if exact:   # exact balance: target = S//R (+1 on the lowest S%R ranks)
        total = int(counts.sum())
        expected = torch.full((num_ranks,), total // num_ranks, dtype=torch.int64)
        expected[: total % num_ranks] += 1
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
    off_target = int((moonep.home_loads(counts) != plan.target).sum())
    assert plan.num_replicas <= off_target                     # the flow bound is off_target - 1 (generic loads)


# ------------------------------------------------------------------------------------------ MoonEP, priced plans

K3_LATENT = load_config("configs/k3.yaml").model.model_copy(update={"expert_inner": 2048})   # 3584 -> 2048, bf16


def latent_cost(**policy) -> ExpertCost:
    """The K3 latent expert (44 MB of weights) under the config's H200 figures, in training."""
    return ExpertCost.from_config(MoonEPPolicy(**policy), K3_LATENT)


def no_replicas_s(counts: torch.Tensor, cost: ExpertCost, home: torch.Tensor | None = None) -> float:
    return cost.layer_s(int(moonep.home_loads(counts, home).max()), [], [], counts.shape[0])


def test_expert_cost_from_config():
    cost = latent_cost()
    assert cost.weight_bytes == 3 * 3584 * 2048 * 2 == 44_040_192
    assert cost.row_s == pytest.approx(3 * 6 * 3584 * 2048 / 400e12)          # forward + backward at 400 TFLOP/s
    assert cost.passes == 2 and cost.ranks_per_node == 8
    assert cost.copy_s(same_node=True) == pytest.approx(2 * 44_040_192 / 330e9)
    assert cost.copy_s(same_node=False) == pytest.approx(2 * 44_040_192 / 50e9)
    inference = ExpertCost.from_config(MoonEPPolicy(), K3_LATENT, training=False)
    assert inference.passes == 1 and inference.row_s == pytest.approx(cost.row_s / 3)
    assert cost.cheapest_copy_s(8) == cost.copy_s(True) and cost.cheapest_copy_s(16) == cost.copy_s(True)
    assert latent_cost(ranks_per_node=1).cheapest_copy_s(16) == cost.copy_s(False)


def test_weight_traffic_is_the_busiest_link_direction():
    """Ranks 0, 1 share a node, 2, 3 another; 1 GB copies, 100 GB/s NVLink, 10 GB/s InfiniBand, 2 passes."""
    cost = ExpertCost(row_s=1e-6, weight_bytes=10**9, passes=2, nvlink_bytes_per_s=100e9, ib_bytes_per_s=10e9,
                      ranks_per_node=2)
    assert cost.transfer_s([], [], 4) == 0.0
    assert cost.transfer_s([0], [1], 4) == pytest.approx(0.02)                  # one NVLink copy, out and back
    assert cost.transfer_s([0, 1], [1, 0], 4) == pytest.approx(0.02)            # both directions at once
    assert cost.transfer_s([0, 0], [1, 1], 4) == pytest.approx(0.04)            # rank 0 sends two
    assert cost.transfer_s([0, 2], [1, 3], 4) == pytest.approx(0.02)            # two nodes side by side
    assert cost.transfer_s([0], [2], 4) == pytest.approx(0.2)                   # InfiniBand
    assert cost.transfer_s([0, 0], [1, 2], 4) == pytest.approx(0.2)             # NVLink beside InfiniBand
    assert cost.layer_s(1000, [0], [2], 4) == pytest.approx(1e-3 + 0.2)


def _near_balanced(num_ranks: int, num_experts: int, seed: int, base: int = 1024, jitter: int = 4) -> torch.Tensor:
    """[R, E] counts within +-jitter of base: every rank's home load within E * jitter of the mean."""
    g = torch.Generator().manual_seed(seed)
    return base + torch.randint(-jitter, jitter + 1, (num_ranks, num_experts), generator=g)


@settings(max_examples=30, deadline=None)
@given(num_ranks=st.sampled_from([2, 4, 8, 16]), seed=st.integers(0, 10_000), ranks_per_node=st.sampled_from([1, 8]))
def test_priced_plan_balanced_load_makes_no_replicas(num_ranks, seed, ranks_per_node):
    """64 experts, ~65k rows per rank within 256 of each other: 85 us of rows at most, a copy costs 267 us or more."""
    counts = _near_balanced(num_ranks, 64, seed)
    plan = moonep.plan(counts, cost=latent_cost(ranks_per_node=ranks_per_node))
    check_plan(counts, plan, exact=False)
    assert plan.num_replicas == 0
    assert torch.equal(plan.target, moonep.home_loads(counts))


def test_balanced_load_exact_plan_replicates_priced_does_not():
    counts = _near_balanced(8, 64, seed=0)
    assert moonep.plan(counts).num_replicas > 0                                # exact balance copies anyway
    assert moonep.plan(counts, cost=latent_cost()).num_replicas == 0


@settings(max_examples=40, deadline=None)
@given(num_ranks=st.integers(2, 16), experts_per_rank=st.integers(2, 8), skew=st.floats(1.5, 3.0),
       seed=st.integers(0, 10_000))
def test_priced_plan_strong_skew_cheap_weights_replicates(num_ranks, experts_per_rank, skew, seed):
    """Zipf >= 1.5 and 44 KB experts (a copy: 0.27 us, under one row): replicas, and the busiest rank and the
    modelled layer both shorter than without them."""
    counts = _counts(num_ranks, num_ranks * experts_per_rank, skew, seed, scale=1024)
    cost = dataclasses.replace(latent_cost(), weight_bytes=44_040)
    plan = moonep.plan(counts, cost=cost)
    check_plan(counts, plan, exact=False)
    assert plan.num_replicas > 0
    assert int(plan.target.max()) < int(moonep.home_loads(counts).max())
    assert plan.modelled_s(cost) < no_replicas_s(counts, cost)


def test_priced_plan_expensive_weights_mild_skew_fewer_replicas():
    """K3's latent expert (44 MB), 8 ranks, busiest rank 5-11 % over the mean: over NVLink exact balance pays; over
    InfiniBand (one rank per node, 6.6x slower copies) the plan keeps fewer replicas or none."""
    for seed in range(3):
        counts = _counts(8, 64, 0.3, seed, scale=1024)
        assert 1.04 < moonep.imbalance(moonep.home_loads(counts)) < 1.12
        exact = moonep.plan(counts)
        nvlink = moonep.plan(counts, cost=latent_cost())
        ib = moonep.plan(counts, cost=latent_cost(ranks_per_node=1))
        check_plan(counts, ib, exact=False)
        assert ib.num_replicas < exact.num_replicas and ib.num_replicas <= nvlink.num_replicas
        assert ib.modelled_s(latent_cost(ranks_per_node=1)) <= exact.modelled_s(latent_cost(ranks_per_node=1))


@settings(max_examples=80, deadline=None)
@given(num_ranks=st.integers(1, 12), num_experts=st.integers(1, 40), skew=st.floats(0.0, 3.0),
       seed=st.integers(0, 10_000), log_bytes=st.floats(3.0, 9.5), ranks_per_node=st.sampled_from([1, 2, 8]),
       training=st.booleans(), random_homes=st.booleans())
def test_priced_plan_never_models_slower(num_ranks, num_experts, skew, seed, log_bytes, ranks_per_node, training,
                                        random_homes):
    """Whatever the load, weights and links: a valid plan (conservation, slot limit, replica bookkeeping), never
    modelled slower than no replicas or than exact balance, and with replicas strictly faster than none."""
    g = torch.Generator().manual_seed(seed)
    home = torch.randint(0, num_ranks, (num_experts,), generator=g) if random_homes else None
    counts = _counts(num_ranks, num_experts, skew, seed)
    cost = dataclasses.replace(ExpertCost.from_config(MoonEPPolicy(ranks_per_node=ranks_per_node), K3_LATENT,
                                                      training), weight_bytes=int(10**log_bytes))
    plan = moonep.plan(counts, home=home, cost=cost)
    check_plan(counts, plan, home=home, exact=False)
    none_s, exact_s = no_replicas_s(counts, cost, home), moonep.plan(counts, home=home).modelled_s(cost)
    assert plan.modelled_s(cost) <= min(none_s, exact_s) * (1 + 1e-12)
    if plan.num_replicas:
        assert plan.modelled_s(cost) < none_s
    assert torch.equal(moonep.plan(counts.clone(), home=home, cost=cost).alloc, plan.alloc)   # deterministic


def test_moonep_planner_follows_the_config():
    """cost_model=false: exact balance; true: the plan priced for training, or for inference without a backward."""
    counts, home = _counts(8, 64, 0.3, seed=1, scale=1024), moonep.default_home(64, 8)
    exact = MoonEPPlanner.from_config(MoonEPPolicy(cost_model=False), K3_LATENT)
    assert torch.equal(exact.plan(counts, home, training=True), moonep.plan(counts).alloc)
    policy = MoonEPPolicy(ranks_per_node=1)
    priced = MoonEPPlanner.from_config(policy, K3_LATENT)
    for training in (True, False):
        cost = ExpertCost.from_config(policy, K3_LATENT, training)
        assert torch.equal(priced.plan(counts, home, training), moonep.plan(counts, cost=cost).alloc)
    assert not torch.equal(priced.plan(counts, home, True), exact.plan(counts, home, True))


def test_metrics():
    counts = torch.tensor([[3, 1], [3, 1]])
    assert moonep.maxvio(counts) == pytest.approx(0.5)
    assert moonep.imbalance(torch.tensor([4, 2])) == pytest.approx(4 / 3)
    assert torch.equal(moonep.home_loads(counts), torch.tensor([6, 2]))


# ------------------------------------------------------------------------------------------------------- scheduling


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(0, 5000), min_size=0, max_size=40), num_groups=st.integers(1, 8),
       overhead=st.floats(0.0, 50.0), per_row=st.floats(0.0, 0.1))
def test_schedule_lpt_properties(rows, num_groups, overhead, per_row):
    rows_t = torch.tensor(rows, dtype=torch.int64)
    cost = scheduling.CostModel(overhead, per_row)
    sched = scheduling.schedule(rows_t, num_groups, cost)
    assert sorted(sched.order.tolist()) == list(range(len(rows)))
    ordered = rows_t[sched.order].tolist()
    assert ordered == sorted(rows, reverse=True)
    # group finish times are the sums of the costs assigned to them
    times = cost.time(rows_t)
    finish = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, sched.group, times)
    assert torch.allclose(finish, sched.finish_us)
    bound = scheduling.lower_bound_us(rows_t, num_groups, cost)
    assert bound - 1e-6 <= sched.makespan_us <= (2 - 1 / num_groups) * bound + 1e-6   # any list schedule
    if len(rows) <= 7 and num_groups <= 3:                     # Graham: LPT <= (4/3 - 1/(3m)) * optimum
        best = _optimal_makespan(times.tolist(), num_groups)
        assert sched.makespan_us <= (4 / 3 - 1 / (3 * num_groups)) * best + 1e-6


def _optimal_makespan(times: list[float], num_groups: int) -> float:
    best = float("inf")
    for code in range(num_groups ** len(times)):
        finish = [0.0] * num_groups
        for t in times:
            finish[code % num_groups] += t
            code //= num_groups
        best = min(best, max(finish))
    return best


def test_lpt_against_lower_bound_is_not_four_thirds():
    """4 equal GEMMs on 3 groups: optimum = LPT = 2, lower bound 4/3; the 4/3 guarantee is against the optimum."""
    sched = scheduling.schedule(torch.tensor([1, 1, 1, 1]), 3, scheduling.CostModel(0.0, 1.0))
    assert sched.makespan_us == 2.0
    assert scheduling.lower_bound_us(torch.tensor([1, 1, 1, 1]), 3, scheduling.CostModel(0.0, 1.0)) == 4 / 3


def test_schedule_order_ties_by_index():
    order = scheduling.schedule_order(torch.tensor([3, 7, 3, 7, 0]))
    assert order.tolist() == [1, 3, 0, 2, 4]


def test_calibrate_recovers_affine_cost():
    rows = torch.tensor([0.0, 128, 512, 2048, 8192])
    times = 7.5 + 0.02 * rows
    cost = scheduling.calibrate(rows, times)
    assert cost.overhead_us == pytest.approx(7.5) and cost.per_row_us == pytest.approx(0.02)
    with pytest.raises(ValueError, match="distinct"):
        scheduling.calibrate(torch.tensor([5.0, 5.0]), torch.tensor([1.0, 2.0]))
    noisy = scheduling.calibrate(torch.tensor([10.0, 20.0]), torch.tensor([5.0, 4.0]))   # negative slope -> 0
    assert noisy.per_row_us == 0 and noisy.overhead_us == pytest.approx(4.5)


# ------------------------------------------------------------------------------------------------------ replication


def _expert_loads(num_layers: int, num_experts: int, skew: float, seed: int, cap: float | None = None):
    g = torch.Generator().manual_seed(seed)
    pop = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** skew
    load = torch.stack([pop[torch.randperm(num_experts, generator=g)] for _ in range(num_layers)])
    load = load / load.sum(1, keepdim=True)
    if cap is not None:
        load = load.clamp(max=cap)
    return load * 1e5


def check_placement(p: replication.Placement, num_experts: int, num_phys: int) -> None:
    phy2log, log2phy, count = p.physical_to_logical, p.logical_to_physical, p.logical_count
    num_layers = phy2log.shape[0]
    assert phy2log.shape == (num_layers, num_phys)
    assert (count >= 1).all() and (count.sum(1) == num_phys).all()
    assert torch.equal(count, torch.stack([torch.bincount(row, minlength=num_experts) for row in phy2log]))
    assert torch.equal((log2phy >= 0).sum(2), count)
    for layer in range(num_layers):
        for e in range(num_experts):
            slots = log2phy[layer, e][log2phy[layer, e] >= 0]
            assert (phy2log[layer, slots] == e).all()


@pytest.mark.parametrize("num_experts,num_ranks,spare,skew", [(32, 4, 1, 1.2), (64, 8, 2, 1.5), (48, 8, 1, 0.0),
                                                              (16, 16, 1, 2.0), (8, 1, 3, 1.0)])
def test_rebalance_flat(num_experts, num_ranks, spare, skew):
    load = _expert_loads(3, num_experts, skew, seed=num_experts)
    num_phys = num_experts + spare * num_ranks
    p = replication.rebalance(load, num_ranks, num_phys)
    check_placement(p, num_experts, num_phys)
    rr = replication.round_robin(3, num_experts, num_ranks, num_phys)
    ours = replication.balancedness(load, p.physical_to_logical, num_ranks)
    base = replication.balancedness(load, rr.physical_to_logical, num_ranks)
    assert (ours >= base - 1e-9).all()
    # copies of one expert on distinct ranks where possible
    per_rank = num_phys // num_ranks
    for layer in range(3):
        ranks = torch.arange(num_phys) // per_rank
        for e in range(num_experts):
            holders = ranks[p.physical_to_logical[layer] == e]
            if holders.numel() <= num_ranks:
                assert holders.unique().numel() == holders.numel()


def test_rebalance_one_dimensional_and_deterministic():
    load = _expert_loads(1, 64, 1.2, seed=0)[0]
    a, b = replication.rebalance(load, 8, 72), replication.rebalance(load.clone(), 8, 72)
    assert a.physical_to_logical.shape == (72,) and torch.equal(a.physical_to_logical, b.physical_to_logical)


def test_rebalance_zipf_balancedness_goal():
    """One spare slot per rank on Zipf 1.2 (per-expert load capped at 1/K of the total, as top-K routing implies)."""
    load = _expert_loads(4, 256, 1.2, seed=1, cap=1 / 16)
    p = replication.rebalance(load, 16, 256 + 16)
    assert replication.balancedness(load, p.physical_to_logical, 16).min() >= 0.98


def test_rebalance_hierarchical():
    load = _expert_loads(3, 64, 1.0, seed=2, cap=1 / 8)
    p = replication.rebalance(load, 8, 80, num_nodes=2)
    check_placement(p, 64, 80)
    # every logical expert's copies stay inside one node (ranks 0-3 or 4-7)
    node = (torch.arange(80) // 10) // 4
    for layer in range(3):
        for e in range(64):
            assert node[p.physical_to_logical[layer] == e].unique().numel() == 1
    with pytest.raises(ValueError, match="num_nodes"):
        replication.rebalance(load, 8, 80, num_nodes=3)


def test_rebalance_moved_budget():
    num_experts, num_ranks, num_phys = 64, 8, 72
    old = _expert_loads(2, num_experts, 1.2, seed=3)
    current = replication.rebalance(old, num_ranks, num_phys).physical_to_logical
    new = _expert_loads(2, num_experts, 1.2, seed=4)                       # hot set moved
    free = replication.rebalance(new, num_ranks, num_phys, current=current)
    for budget in (0, 1, 4, 16):
        p = replication.rebalance(new, num_ranks, num_phys, current=current, moved_budget=budget)
        check_placement(p, num_experts, num_phys)
        assert ((p.physical_to_logical != current).sum(1) <= budget).all()
        if budget == 0:
            assert torch.equal(p.physical_to_logical, current)
    bal_cur = replication.balancedness(new, current, num_ranks)
    bal_16 = replication.balancedness(new, p.physical_to_logical, num_ranks)
    assert (bal_16 >= bal_cur - 1e-9).all() and (bal_16 > bal_cur + 0.05).any()
    # re-running on the same load with its own placement as current moves nothing
    same = replication.rebalance(new, num_ranks, num_phys, current=free.physical_to_logical, moved_budget=8)
    assert torch.equal(same.physical_to_logical, free.physical_to_logical)
    # alignment alone keeps balance identical
    assert torch.allclose(replication.balancedness(new, free.physical_to_logical, num_ranks),
                          replication.balancedness(new, replication.rebalance(new, num_ranks, num_phys)
                                                   .physical_to_logical, num_ranks))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_plan_on_cuda_matches_cpu():
    counts = _counts(64, 896, 1.2, seed=5, scale=73)
    cpu = moonep.plan(counts)
    gpu = moonep.plan(counts.cuda())
    assert gpu.alloc.is_cuda and gpu.replica_mask.is_cuda and gpu.home.is_cuda
    assert torch.equal(gpu.alloc.cpu(), cpu.alloc) and torch.equal(gpu.replica_mask.cpu(), cpu.replica_mask)
    assert torch.equal(gpu.send(counts.cuda()).cpu(), cpu.send(counts))
    sched = scheduling.schedule(counts[0].cuda(), 4, scheduling.CostModel(5.0, 0.01))
    assert sched.group.is_cuda and sched.order.is_cuda


def test_received_by_is_the_destination_column_of_the_send_matrix():
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 50, (4, 16), generator=g)
    alloc = moonep.plan(counts).alloc
    send = moonep.send_matrix(counts, alloc)
    for rank in range(4):
        assert torch.equal(moonep.received_by(counts, alloc, rank), send[:, :, rank])
        assert torch.equal(moonep.send_matrix(counts, alloc, src=rank), send[rank])


def test_backoff_doubles_from_the_base_and_stops_at_the_cap():
    assert [retry.backoff_s(a, 0.5, cap_s=3.0) for a in range(6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    assert retry.backoff_s(4, 0.0) == 0.0
