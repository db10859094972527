"""Placement policies at K3 scale (E=896, K=16, s=4096 tokens per rank), CPU only; prints markdown tables.

    python benchmarks/policies.py [--layers 16] [--steps 8] [--ranks 16 64 256] [--full]

Per (R, trace): max/mean rank load under none / persistent replicas / MoonEP / both, replicas per rank, MoonEP
planning time (median per layer, one intra-op thread), persistent-replica balancedness (one spare slot per rank,
re-planned every step from the load history). --full adds an all-93-layer simulation at R=256 (wall time).
Goals: MoonEP max/mean = 1.000 on every trace; MoonEP planning < 10 ms at R=64; replicas balancedness >= 0.98 on
Zipf 1.2.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from k3ray import sim
from k3ray.config import load_config
from k3ray.policies import moonep

TRACES = ("zipf:1.0", "zipf:1.2", "zipf:1.5", "hot-shift:4")


def layer_counts(ranks: int, trace: str = "zipf:1.2") -> torch.Tensor:
    return sim.Trace(trace, 1, ranks, 896, 16, 4096, seed=0).counts(0, torch.Generator().manual_seed(0), layer=0)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/k3.yaml")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tokens-per-rank", type=int, default=4096)
    ap.add_argument("--full", action="store_true", help="also time all 93 layers x 3 steps at R=256")
    args = ap.parse_args()
    cfg = load_config(args.config)
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} intra-op threads available; "
          f"E={cfg.model.n_experts} K={cfg.model.top_k} s={args.tokens_per_rank}, {args.layers} layers x "
          f"{args.steps} steps per row\n")
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
    print("\nMoonEP planning time, one Zipf 1.2 layer, median of 50 (ms), and replicas of one layer against the lower "
          "bound (ranks off target - 1, for generic loads):")
    print("| R | plan ms, 1 thread | plan ms, 2 threads | " + " | ".join(f"replicas/bound {t}" for t in TRACES) + " |")
    print("|---" * (3 + len(TRACES)) + "|")
    for ranks in args.ranks:
        bounds = " | ".join("{} / {}".format(*replicas_vs_bound(ranks, t)) for t in TRACES)
        print(f"| {ranks} | {plan_time_ms(ranks, 1):.2f} | {plan_time_ms(ranks, 2):.2f} | {bounds} |", flush=True)
    if args.full:
        t0 = time.perf_counter()
        r = sim.run_simulation(cfg, ranks=256, trace="zipf:1.2", steps=3, tokens_per_rank=args.tokens_per_rank)
        print(f"\nfull simulation, 93 layers x 3 steps at R=256 (zipf:1.2): {time.perf_counter() - t0:.1f} s wall")
        print(sim.format_table(r))


if __name__ == "__main__":
    main()
