"""The serving scheduler's host time per iteration, without Ray or a GPU: `Scheduler.schedule` and `complete` with a
synchronous fake executor (every row samples token 65 at once), C clients in a closed loop (each sends its next
request when the last ends), greedy, stepwise prefill up to 64 tokens. Pool sizes: the CPU's defaults and a GPU's
(65,536 pages x 16 tokens, 256 slots, token budget 8,192). Prints median ms per iteration over --runs runs.
`--system-tokens N` puts one N-token system prompt before every prompt (its tokens differ from the prompts'), and
`--prefix-cache` turns the prefix cache on (a checkpoint every 64 tokens, one per slot, as a GPU server's default).

    python benchmarks/scheduler_cpu.py [--concurrency 64] [--requests 256] [--runs 3] [--system-tokens 1500]
        [--prefix-cache] [--profile FILE]
"""
from __future__ import annotations

import argparse
import cProfile
import random
import statistics
import time

from k3ray.config import ServeConfig
from k3ray.model.sampling import SamplingParams
from k3ray.parallel.serving import StageOutput
from k3ray.serve.prefix_cache import PrefixSizes
from k3ray.serve.scheduler import Scheduler

SIZES = ((4096, 16, 2048), (65536, 256, 8192))  # pages per rank, slots, token budget
PROMPTS = ((4, 40), (200, 1200))  # prompt tokens, drawn uniformly (seeded)


def run(pages: int, slots: int, budget: int, prompt: tuple[int, int], concurrency: int, requests: int,
        max_tokens: int = 64, system_tokens: int = 0, prefix_cache: bool = False) -> tuple[float, float]:
    """Median host seconds per iteration of schedule() and complete()."""
    serve = ServeConfig(pages_per_rank=pages, slots_per_rank=slots, token_budget=budget, stepwise_prefill_max=64,
                        max_waiting=10 ** 6)
    prefix = PrefixSizes(64, slots, 1, 1) if prefix_cache else None
    sched = Scheduler(serve, 4096, prefix=prefix)
    rng, sent, schedule_s, complete_s = random.Random(0), 0, [], []
    system = [rng.randrange(66, 256) for _ in range(system_tokens)]
    while sent < requests or sched.has_work:
        while sent < requests and len(sched.table.running) + len(sched.table.waiting) < concurrency:
            sched.submit(system + [rng.randrange(66, 256) for _ in range(rng.randint(*prompt))],
                         SamplingParams(max_tokens=max_tokens))
            sent += 1
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        sched.complete(out, {r: StageOutput([65] * len(p.slots), [1.0] * len(p.slots)) for r, p in out.plans().items()})
        complete_s.append(time.perf_counter() - t1)
        schedule_s.append(t1 - t0)
        for rid in [r.id for r in sched.table.requests.values() if r.done]:
            sched.table.forget(rid)
    return statistics.median(schedule_s), statistics.median(complete_s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=0)
    ap.add_argument("--prefix-cache", action="store_true")
    ap.add_argument("--profile", help="cProfile the runs into this file (pstats)")
    args = ap.parse_args()
    print(f"{args.concurrency} clients, {args.requests} requests, max_tokens 64, greedy, stepwise prefill 64, "
          f"system prompt {args.system_tokens} tokens, prefix cache {'on' if args.prefix_cache else 'off'}")
    print("| pages per rank | slots | token budget | prompt tokens | schedule() ms | complete() ms |")
    print("|---|---|---|---|---|---|")
    profiler = cProfile.Profile() if args.profile else None
    for pages, slots, budget in SIZES:
        for prompt in PROMPTS:
            if profiler:
                profiler.enable()
            runs = [run(pages, slots, budget, prompt, args.concurrency, args.requests, 64, args.system_tokens,
                        args.prefix_cache) for _ in range(args.runs)]
            if profiler:
                profiler.disable()
            print(f"| {pages:,} | {slots} | {budget:,} | {prompt[0]}-{prompt[1]} | "
                  f"{statistics.median(r[0] for r in runs) * 1e3:.3f} | "
                  f"{statistics.median(r[1] for r in runs) * 1e3:.3f} |", flush=True)
    if profiler:
        profiler.dump_stats(args.profile)


if __name__ == "__main__":
    main()
