"""Placement policies at K3 scale (E=896, K=16, s=4096 tokens per rank), CPU only; prints markdown tables.

    python benchmarks/policies.py [--layers 16] [--steps 8] [--ranks 16 64 256] [--full]
                                  [--tables balance planning priced]

balance: per (R, trace): max/mean rank load under none / persistent replicas / MoonEP / both, replicas per rank, MoonEP
planning time (median per layer, one intra-op thread), persistent-replica balancedness (one spare slot per rank,
re-planned every step from the load history). --full adds an all-93-layer simulation at R=256 (wall time).
planning: MoonEP planning time and replicas against the lower bound.
priced: modelled times (k3ray.policies.expert_cost, training, the config's H200 figures; not GPU measurements) at
K3's latent expert (3584 -> 2048, bf16, 44 MB): the issue's MoE layer (E=64, K=8, s=8192, EP=2) at Zipf 0, Zipf 1.2
and experts in popularity order sized for hottest/mean 1.55 / 1.88 / 2.00, with no MoonEP, exact MoonEP (no cost
model) and priced MoonEP (cost model), over NVLink and over InfiniBand; then every simulator policy at R=64.
Goals: MoonEP max/mean = 1.000 on every trace; MoonEP planning < 10 ms at R=64; replicas balancedness >= 0.98 on
Zipf 1.2.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from k3ray import sim, traces
from k3ray.config import MoonEPPolicy, load_config
from k3ray.policies import moonep
from k3ray.policies.expert_cost import ExpertCost

TRACES = ("zipf:1.0", "zipf:1.2", "zipf:1.5", "hot-shift:4")


def layer_counts(ranks: int, trace: str = "zipf:1.2") -> torch.Tensor:
    return traces.Trace(trace, 1, ranks, 896, 16, 4096, seed=0).counts(0, torch.Generator().manual_seed(0), layer=0)


def replicas_vs_bound(ranks: int, trace: str) -> tuple[int, int]:
    """(MoonEP replicas, lower bound). The rank-to-rank flow of any plan connects all n ranks that are off target
    unless a proper subset of their imbalances sums to zero, so it has at least n - 1 edges, each one replica."""
    counts = layer_counts(ranks, trace)
    plan = moonep.plan(counts)
    return plan.num_replicas, max(int((moonep.home_loads(counts) != plan.target).sum()) - 1, 0)


def plan_time_ms(ranks: int, threads: int, repeats: int = 50) -> float:
    """Median wall time of moonep.plan on one Zipf 1.2 layer at E=896, s=4096, K=16."""
    counts = layer_counts(ranks)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        moonep.plan(counts)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            moonep.plan(counts)
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        torch.set_num_threads(before)
    return statistics.median(times)


def ordered_zipf_pi(exponent: float, num_experts: int, top_k: int) -> torch.Tensor:
    """[E] inclusion probabilities of popularity 1/(i+1)^exponent, expert 0 hottest (the first home block hottest)."""
    pop = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    return traces.inclusion_probs(pop[None], top_k)[0]


def exponent_for(hottest_over_mean: float, num_experts: int, num_ranks: int, top_k: int) -> float:
    """The exponent whose expected busiest home rank is hottest_over_mean x the mean (bisection; 2.00 at R=2 is the
    limit where every token's K experts live on rank 0)."""
    def ratio(a: float) -> float:
        pi = ordered_zipf_pi(a, num_experts, top_k)
        return float(pi.reshape(num_ranks, -1).sum(1).max() / (top_k / num_ranks))
    lo, hi = 0.0, 16.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < hottest_over_mean - 5e-4 else (lo, mid)
    return hi


def priced_layer_table(cfg, draws: int = 16) -> None:
    """One MoE layer at the issue's shapes; each cell the mean of `draws` sampled routings."""
    experts, top_k, ranks, tokens = 64, 8, 2, 8192
    model = cfg.model.model_copy(update={"n_experts": experts, "top_k": top_k, "expert_inner": 2048})
    links = {"NVLink": MoonEPPolicy(), "InfiniBand": MoonEPPolicy(ranks_per_node=1)}
    costs = {name: ExpertCost.from_config(policy, model) for name, policy in links.items()}
    balanced_ms = costs["NVLink"].row_s * tokens * top_k * 1e3
    skews = [("Zipf 0", None, 0.0), ("Zipf 1.2", None, 1.2)] + [
        (f"hottest/mean {t:.2f}", exponent_for(t, experts, ranks, top_k), None) for t in (1.55, 1.88, 2.00)]
    print(f"\nModelled MoE layer (not measured): E={experts} K={top_k} s={tokens} per rank, EP={ranks}, expert "
          f"3584 -> 2048 ({costs['NVLink'].weight_bytes / 1e6:.0f} MB bf16), {cfg.policies.moonep.expert_tflops:.0f} "
          f"TFLOP/s fwd+bwd (a row {costs['NVLink'].row_s * 1e6:.3f} us); a copy with its gradient "
          f"{costs['NVLink'].copy_s(True) * 1e3:.3f} ms over NVLink, {costs['InfiniBand'].copy_s(False) * 1e3:.2f} ms "
          f"over InfiniBand; perfectly balanced, no copies: {balanced_ms:.2f} ms. Means of {draws} routings; "
          f"x = / that balanced time.\n")
    print("| routing | busiest home rank / mean | link | no MoonEP ms (x) | MoonEP exact ms (x) | exact copies | "
          "MoonEP priced ms (x) | priced copies | priced busiest / mean | priced plan ms |")
    print("|---" * 10 + "|")
    for label, exponent, zipf in skews:
        gen = torch.Generator().manual_seed(0)
        if exponent is None:
            trace = traces.Trace("uniform" if zipf == 0 else f"zipf:{zipf}", 1, ranks, experts, top_k, tokens, seed=0)
            samples = [trace.counts(0, gen, layer=0) for _ in range(draws)]
        else:
            pi = ordered_zipf_pi(exponent, experts, top_k)
            samples = [traces.sample_counts(pi, ranks, tokens, top_k, gen) for _ in range(draws)]
            label += f" (exponent {exponent:.2f})"
        hot = statistics.fmean(moonep.imbalance(moonep.home_loads(c)) for c in samples)
        for link, cost in costs.items():
            none = [cost.layer_s(int(moonep.home_loads(c).max()), [], [], ranks) for c in samples]
            exact = [moonep.plan(c) for c in samples]
            priced, plan_s = [], []
            for c in samples:
                t0 = time.perf_counter()
                priced.append(moonep.plan(c, cost=cost))
                plan_s.append(time.perf_counter() - t0)
            ms = [statistics.fmean(x) * 1e3 for x in (none, [p.modelled_s(cost) for p in exact],
                                                       [p.modelled_s(cost) for p in priced])]
            print(f"| {label} | {hot:.2f} | {link} | {ms[0]:.2f} ({ms[0] / balanced_ms:.2f}) | "
                  f"{ms[1]:.2f} ({ms[1] / balanced_ms:.2f}) | {statistics.fmean(p.num_replicas for p in exact):.1f} | "
                  f"{ms[2]:.2f} ({ms[2] / balanced_ms:.2f}) | {statistics.fmean(p.num_replicas for p in priced):.1f} | "
                  f"{statistics.fmean(moonep.imbalance(p.target) for p in priced):.3f} | "
                  f"{statistics.median(plan_s) * 1e3:.2f} |", flush=True)


def priced_k3_table(cfg, ranks: int, layers: int, steps: int, tokens_per_rank: int) -> None:
    """Every simulator policy at K3 scale with the latent expert, priced (modelled ms per layer, mean)."""
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"expert_inner": 2048})})
    print(f"\nModelled K3 layer (not measured): E={cfg.model.n_experts} K={cfg.model.top_k} s={tokens_per_rank} per "
          f"rank, R={ranks} ({cfg.policies.moonep.ranks_per_node} ranks per node: NVLink inside, InfiniBand across), "
          f"expert 3584 -> 2048; {layers} layers x {steps} steps; persistent replicas: one spare slot per rank, "
          f"re-planned every step, their copies synced once per {cfg.parallel.micro_batches} micro-batches.\n")
    print("| trace | policy | busiest / mean | replicas per rank | modelled ms per layer | of which weights | "
          "copy GiB per step and rank (93 layers) | plan ms per layer |")
    print("|---" * 8 + "|")
    for trace in ("uniform", "zipf:1.2"):
        r = sim.run_simulation(cfg, ranks=ranks, trace=trace, steps=steps, layers=layers,
                               tokens_per_rank=tokens_per_rank, seed=0, rebalance_every=1)
        for name, st in r.policies.items():
            gib_93 = st.copy_bytes_per_step_per_rank / layers * cfg.model.n_layers / 2**30
            print(f"| {trace} | {name} | {st.imbalance_mean:.3f} | {st.replicas_per_rank_mean:.2f} | "
                  f"{st.modelled_ms_per_step / layers:.2f} | {st.weights_ms_per_step / layers:.2f} | {gib_93:.1f} | "
                  f"{st.plan_ms_median:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/k3.yaml")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tokens-per-rank", type=int, default=4096)
    ap.add_argument("--full", action="store_true", help="also time all 93 layers x 3 steps at R=256")
    ap.add_argument("--tables", nargs="+", choices=["balance", "planning", "priced"],
                    default=["balance", "planning", "priced"])
    args = ap.parse_args()
    cfg = load_config(args.config)
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} intra-op threads available; "
          f"E={cfg.model.n_experts} K={cfg.model.top_k} s={args.tokens_per_rank}, {args.layers} layers x "
          f"{args.steps} steps per row\n")
    if "balance" in args.tables:
        balance_table(cfg, args)
    if "planning" in args.tables:
        planning_table(args)
    if "priced" in args.tables:
        with_one_thread(priced_layer_table, cfg)
        with_one_thread(priced_k3_table, cfg, 64, args.layers, 2, args.tokens_per_rank)
    if args.full:
        t0 = time.perf_counter()
        r = sim.run_simulation(cfg, ranks=256, trace="zipf:1.2", steps=3, tokens_per_rank=args.tokens_per_rank)
        print(f"\nfull simulation, 93 layers x 3 steps at R=256 (zipf:1.2): {time.perf_counter() - t0:.1f} s wall")
        print(sim.format_table(r))


def with_one_thread(fn, *args) -> None:
    """Small tensors: one intra-op thread, as the workers plan."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fn(*args)
    finally:
        torch.set_num_threads(before)


def balance_table(cfg, args) -> None:
    print("| R | trace | expert MaxVio | none max/mean | replicas max/mean | replicas balancedness | "
          "MoonEP max/mean (worst) | MoonEP replicas/rank (max) | replicas+MoonEP max/mean | "
          "replicas+MoonEP copies/rank | MoonEP plan ms/layer | MoonEP copy GiB/step/rank (all 93 layers) |")
    print("|---" * 12 + "|")
    for ranks in args.ranks:
        for trace in TRACES:
            r = sim.run_simulation(cfg, ranks=ranks, trace=trace, steps=args.steps, layers=args.layers,
                                   tokens_per_rank=args.tokens_per_rank, seed=0, rebalance_every=1)
            p = r.policies
            full_gib = p["moonep"].replicas_per_rank_mean * cfg.model.n_layers * r.expert_bytes / 2**30
            print(f"| {ranks} | {trace} | {r.expert_maxvio_mean:.1f} | {p['none'].imbalance_mean:.2f} | "
                  f"{p['replicas'].imbalance_mean:.3f} | {p['replicas'].balancedness_mean:.3f} | "
                  f"{p['moonep'].imbalance_mean:.3f} ({p['moonep'].imbalance_worst:.3f}) | "
                  f"{p['moonep'].replicas_per_rank_mean:.2f} ({p['moonep'].replicas_per_rank_max:.0f}) | "
                  f"{p['replicas+moonep'].imbalance_mean:.3f} | {p['replicas+moonep'].replicas_per_rank_mean:.2f} | "
                  f"{p['moonep'].plan_ms_median:.2f} | {full_gib:.1f} |", flush=True)


def planning_table(args) -> None:
    print("\nMoonEP planning time, one Zipf 1.2 layer, median of 50 (ms), and replicas of one layer against the lower "
          "bound (ranks off target - 1, for generic loads):")
    print("| R | plan ms, 1 thread | plan ms, 2 threads | " + " | ".join(f"replicas/bound {t}" for t in TRACES) + " |")
    print("|---" * (3 + len(TRACES)) + "|")
    for ranks in args.ranks:
        bounds = " | ".join("{} / {}".format(*replicas_vs_bound(ranks, t)) for t in TRACES)
        print(f"| {ranks} | {plan_time_ms(ranks, 1):.2f} | {plan_time_ms(ranks, 2):.2f} | {bounds} |", flush=True)


if __name__ == "__main__":
    main()
