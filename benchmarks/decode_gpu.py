"""The serving decode step on one GPU, without Ray: the bare step per batch size against its memory-bandwidth limit,
and the engine (scheduler + the worker's StageServer in this process) at fixed concurrencies.

    python benchmarks/decode_gpu.py --config configs/gpu2.yaml --set model.n_layers=4 [--batches 1 4 16 64 256]

Bare step: B sequences decoding at once (context `--context` tokens each), `StageServer.step` as a worker runs it
(plan copied in, CUDA-graph replay, token ids copied out), timed over `--iters` steps; "device" is the graph replay
alone (CUDA events). Its bandwidth limit is the bytes a step must move at least, over the measured copy bandwidth:
every weight the step reads (dense weights; the routed experts that B x top-k routes touch, expected count),
KDA states read and written, MLA latents read. Engine: C clients each with one request of 64 new tokens at a time
(a new one when one ends), the scheduler's host time per iteration beside the step.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from k3ray.config import load_config, parse_assignments
from k3ray.config import ServeConfig
from k3ray.serve.scheduler import Scheduler
from k3ray.model.cache import SeqAdmit
from k3ray.model.decoder import build_stage
from k3ray.model.sampling import SamplingParams
from k3ray.parallel.serving import LocalExecutor, PoolSizes, RankPlan

PROMPTS = ["def ", "import os\n", "class Reader(object):\n    def __init__(self", "for i in range(",
           "# Licensed to the PSF\n\"\"\"Helpers for ", "    if not data:\n        return "]


def copy_bandwidth(device) -> float:
    """Bytes per second read + written by a device-to-device copy of 1 GiB (median of 10)."""
    a = torch.empty(2**30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() / statistics.median(times[2:])


def step_bytes(model, cfg, batch: int, context: int) -> float:
    """The least a decode step of `batch` sequences must move: weights read (routed experts: the expected number
    touched by batch x top-k uniform routes), KDA states read + written, MLA latents read."""
    m = cfg.model
    expert_bytes = dense_bytes = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            expert_bytes += p.numel() * p.element_size()
        elif "embed" not in name:  # the embedding: one row per sequence
            dense_bytes += p.numel() * p.element_size()
    touched = 1 - (1 - m.top_k / m.n_experts) ** batch
    kda_layers = sum(m.layer_kind(i) == "kda" for i in range(m.n_layers))
    mla_layers = m.n_layers - kda_layers
    state = kda_layers * batch * m.n_heads * m.kda_head_dim ** 2 * 4 * 2
    latents = mla_layers * batch * context * m.kv_rank * 2
    return dense_bytes + expert_bytes * touched + state + latents


def bare_step(model, cfg, batch: int, context: int, iters: int, bandwidth: float, profile: bool = False) -> dict:
    sizes = PoolSizes(pages=batch * (-(-(context + iters + 8) // 16)) + 1, page_size=16, slots=batch)
    ex = LocalExecutor(model, sizes, device="cuda")
    server, pools = ex.server, ex.server.pools
    per = -(-(context + iters + 8) // 16)
    plan = RankPlan(admit=[])
    for b in range(batch):
        plan.admit.append(SeqAdmit(b, list(range(b * per, (b + 1) * per))))
    pools.admit(plan.admit)
    # fill the context with decode steps (each sequence one token per step, as graphs replay them)
    step_plan = lambda pos: RankPlan(slots=list(range(batch)), starts=[pos] * batch, counts=[1] * batch,  # noqa: E731
                                     tokens=[(pos * 7 + b) % cfg.model.vocab_size for b in range(batch)],
                                     counters=[0] * batch, greedy=True)
    for pos in range(context):
        server.step(step_plan(pos))
    torch.cuda.synchronize()
    wall, device = [], []
    for i in range(iters):
        plan = step_plan(context + i)
        t0 = time.perf_counter()
        server.step(plan)  # ends with the token ids on the host: synchronous
        wall.append(time.perf_counter() - t0)
    graph = server.graphs.graphs.get((batch, pools.context_bucket(context + iters), True, True))
    if graph is not None:
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph[0].replay()
            e.record()
            torch.cuda.synchronize()
            device.append(s.elapsed_time(e) / 1e3)
    if profile:  # the same steps eagerly, kernel by kernel (a graph replays exactly these kernels)
        graphs, server.graphs = server.graphs, None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(5):
                server.step(step_plan(context + iters + i))
        server.graphs = graphs
        print(f"[decode] eager decode step at batch {batch}, 5 steps, kernels by device time:")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    limit = step_bytes(model, cfg, batch, context) / bandwidth
    step = statistics.median(wall)
    dev = statistics.median(device) if device else float("nan")
    del ex
    torch.cuda.empty_cache()
    return {"batch": batch, "step_ms": step * 1e3, "device_ms": dev * 1e3, "limit_ms": limit * 1e3,
            "x_limit": step / limit, "busy": dev / step, "tok_s": batch / step}


def serve_config(sizes: PoolSizes, budget: int, max_waiting: int, stepwise: int) -> ServeConfig:
    return ServeConfig(page_size=sizes.page_size, pages_per_rank=sizes.pages, slots_per_rank=sizes.slots,
                       token_budget=budget, max_waiting=max_waiting, stepwise_prefill_max=stepwise)


def engine_level(model, cfg, concurrency: int, requests: int, max_tokens: int, budget: int, device="cuda",
                 stepwise: int = 0) -> dict:
    slots = max(concurrency, 1)
    sizes = PoolSizes(pages=slots * (-(-(64 + max_tokens) // 16)) + 8, page_size=16, slots=slots)
    sched = Scheduler(serve_config(sizes, budget, 4 * requests, stepwise), cfg.model.max_seq_len, 1,
                      cfg.policies.guards)
    ex = LocalExecutor(model, sizes, device=device)
    prompts = [[ord(c) for c in PROMPTS[i % len(PROMPTS)]] for i in range(requests)]
    submitted, host, steps, t_first = 0, [], [], {}
    t0 = time.perf_counter()
    while submitted < requests or sched.has_work:
        while submitted < requests and len(sched.table.running) + len(sched.table.waiting) < concurrency:
            req = sched.submit(prompts[submitted], SamplingParams(max_tokens=max_tokens))
            t_first[req.id] = time.perf_counter()
            submitted += 1
        h0 = time.perf_counter()
        plans = sched.schedule()
        h1 = time.perf_counter()
        outs = ex.run(plans.plans())
        h2 = time.perf_counter()
        sched.complete(plans, outs)
        h3 = time.perf_counter()
        host.append((h1 - h0) + (h3 - h2))
        steps.append(h3 - h0)
    wall = time.perf_counter() - t0
    reqs = list(sched.table.requests.values())
    tokens = sum(len(r.out) for r in reqs)
    ttft = [r.token_times[0] - t_first[r.id] for r in reqs if r.token_times]
    itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
    return {"concurrency": concurrency, "tok_s": tokens / wall, "ttft_p50_ms": statistics.median(ttft) * 1e3,
            "itl_p50_ms": statistics.median(itl) * 1e3, "itl_p99_ms": sorted(itl)[int(0.99 * (len(itl) - 1))] * 1e3,
            "host_ms": statistics.median(host) * 1e3, "iterations": len(steps)}


def greedy_outputs(model, cfg, graphs: bool, stepwise: int, n: int = 8, max_tokens: int = 24, budget: int = 512
                   ) -> list[list[int]]:
    """Greedy outputs of n requests served together (decode graphs or eagerly; prompts stepwise up to `stepwise`
    tokens, else in chunks of the token budget)."""
    sizes = PoolSizes(pages=n * 8 + 8, page_size=16, slots=n)
    sched = Scheduler(serve_config(sizes, budget, 64, stepwise), cfg.model.max_seq_len, 1, cfg.policies.guards)
    ex = LocalExecutor(model, sizes, device="cuda", graphs=graphs)
    reqs = [sched.submit([ord(c) for c in PROMPTS[i % len(PROMPTS)]], SamplingParams(max_tokens=max_tokens))
            for i in range(n)]
    while sched.has_work:
        sched.step(ex)
    return [r.out for r in reqs]


def tokens_equal(a: list[list[int]], b: list[list[int]]) -> str:
    """How far two runs' greedy outputs agree: tokens equal at the same place, first tokens equal, and the tokens
    before each request's first difference."""
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    first = sum(ra[:1] == rb[:1] for ra, rb in zip(a, b))
    prefix = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(rb)) for ra, rb in zip(a, b)]
    return (f"{same} / {sum(len(r) for r in b)} tokens, first tokens {first} / {len(b)}, common prefixes {prefix}")


def agreement(model, cfg) -> None:
    """Greedy outputs under changes that keep the arithmetic but not its rounding (bf16): decode graphs against eager
    iterations, prompts stepwise against chunks, and chunks of another size (a token budget of 5)."""
    eager = greedy_outputs(model, cfg, graphs=False, stepwise=0)
    for name, run in (("graphs / eager", greedy_outputs(model, cfg, graphs=True, stepwise=0)),
                      ("prompts stepwise / chunked", greedy_outputs(model, cfg, graphs=True, stepwise=64)),
                      ("chunks of a 5-token budget / one chunk", greedy_outputs(model, cfg, False, 0, budget=5))):
        print(f"[decode] greedy {name}: {tokens_equal(run, eager)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/gpu2.yaml")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 64, 256])
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64, 256])
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--profile", type=int, nargs="*", default=[], help="print the kernels of an eager step at these batches")
    ap.add_argument("--device", default="cuda", help="cpu: the engine table only (host time per iteration)")
    ap.add_argument("--token-budget", type=int, default=2048, help="tokens per iteration (decode + prefill)")
    ap.add_argument("--stepwise", type=int, nargs="+", default=[0],
                    help="serve.stepwise_prefill_max values for the engine table (0: prompts in chunks)")
    args = ap.parse_args()
    cfg = load_config(args.config, parse_assignments(args.set))
    t0 = time.perf_counter()
    model = build_stage(cfg.model, range(cfg.model.n_layers), seed=cfg.train.seed, device=args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[decode] {cfg.name} {cfg.model.n_layers} layers, {n_params / 1e9:.2f} B parameters, built in "
          f"{time.perf_counter() - t0:.0f}s; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}", flush=True)
    if args.device == "cuda":
        gpu_tables(model, cfg, args)
    print("| stepwise prefill up to | concurrency | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms "
          "| engine host ms/iter | iterations |")
    print("|---|---|---|---|---|---|---|---|")
    for stepwise in args.stepwise:
        for c in args.concurrency:
            r = engine_level(model, cfg, c, max(2 * c, 8), args.max_tokens, args.token_budget, args.device, stepwise)
            print(f"| {stepwise} | {c} | {r['tok_s']:.0f} | {r['ttft_p50_ms']:.1f} | {r['itl_p50_ms']:.2f} | "
                  f"{r['itl_p99_ms']:.2f} | {r['host_ms']:.3f} | {r['iterations']} |", flush=True)
    for b in args.profile:  # last: a capture after the profiler has run can fail
        bare_step(model, cfg, b, args.context, 5, 1.0, profile=True)


def gpu_tables(model, cfg, args) -> None:
    bw = copy_bandwidth("cuda")
    print(f"[decode] copy bandwidth {bw / 1e12:.2f} TB/s (read + written)", flush=True)
    agreement(model, cfg)
    print("| batch | step ms (host+graph) | graph replay ms | bandwidth limit ms | step / limit | GPU busy | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batches:
        r = bare_step(model, cfg, b, args.context, args.iters, bw)
        print(f"| {r['batch']} | {r['step_ms']:.3f} | {r['device_ms']:.3f} | {r['limit_ms']:.3f} | "
              f"{r['x_limit']:.2f} | {r['busy']:.0%} | {r['tok_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
