"""Serving real prompt lengths on one GPU without Ray: the scheduler and one worker's `StageServer` in this process,
with the sizes a GPU server picks by default (token budget, slots, pages from the free memory), so the worker's own
time is measured apart from Ray, the engine's actor and HTTP.

    python benchmarks/prefill_gpu.py --config configs/gpu2.yaml --set model.n_layers=4 [--concurrency 1 16 64]

Stages (each prints as it ends; an exception prints its traceback and the next stage runs):
1. TTFT of one prompt of `--ttft-tokens` tokens alone (median of 5 after a warm-up): one prefill iteration.
2. The engine loop at each concurrency: C clients, each sending its next request when the last ends; prompts of
   `--prompt-tokens` tokens of Python's stdlib source (bytes, seeded), max_tokens drawn from `--max-tokens`.
   Output tokens/s, TTFT and ITL from the scheduler's token times, prompt tokens/s, the worker's step per
   iteration (synchronized) binned by tokens per iteration, and the slowest. Each level runs first on other prompts
   unprinted: a first use of a shape or kernel (compilation, autotuning) stalls an iteration for seconds.
3. `graphs`: every decode CUDA graph of the pools captured in the order a server's start takes them
   (serve.graphs_at_start_s), each capture timed, by context and batch bucket.
4. A profile of mixed iterations of about `--mixed-tokens` tokens (64 decode rows + prompt chunks): device time by
   kernel category (attention, KDA, convolution, matmul, experts, elementwise/other) and the worker's wall time.

`--system-tokens LO:HI` puts one system prompt (drawn once) before every prompt; `--prefix-cache on|off` (default:
the config's) the prefix cache, with the pools' state checkpoints, as a server has it. The levels then print the
hit rate over prompt tokens. `--host-profile`: the printed levels' hit iterations under cProfile, their host time
by Python function (the device runs behind the host: where a host-bound iteration's time goes).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
import traceback

import torch

from k3ray.config import ServeConfig, load_config, parse_assignments
from k3ray.model.cache import pages_that_fit
from k3ray.model.decoder import build_stage
from k3ray.model.sampling import SamplingParams
from k3ray.parallel import serving
from k3ray.parallel.serving import LocalExecutor, PoolSizes
from k3ray.serve.prefix_cache import PrefixSizes, prefix_sizes
from k3ray.serve.scheduler import Scheduler
from k3ray.tokenizer import ByteTokenizer
from real_prompts import draws

DEVICE = "cuda"  # --device cpu: a smoke run of the same code at a tiny shape (no profile categories then)
PROMPT_GRAPHS = True  # --prompt-graphs off: prompt iterations eager (k3ray.parallel.prompt_graphs)


SYSTEM: list[int] = []  # --system-tokens: the system prompt before every prompt


def workload(n: int, prompt_tokens: str, max_tokens: str, seed: int) -> list[tuple[list[int], int]]:
    """serve_load.py's requests (benchmarks/real_prompts.py) as the byte-level model's token ids."""
    return [(SYSTEM + ids, m) for ids, m in draws(ByteTokenizer(), n, prompt_tokens, max_tokens, seed)]


def executor(model, serve: ServeConfig, prefix: PrefixSizes | None) -> LocalExecutor:
    """The worker's StageServer as a server makes it (prompt graphs on a GPU unless --prompt-graphs off)."""
    return LocalExecutor(model, pool_sizes(serve, prefix), device=DEVICE,
                         prompt_graphs=None if PROMPT_GRAPHS else False, token_budget=serve.token_budget)


def pool_sizes(serve: ServeConfig, prefix: PrefixSizes | None) -> PoolSizes:
    return PoolSizes(serve.pages_per_rank, serve.page_size, serve.slots_per_rank,
                     0 if prefix is None else prefix.checkpoints)


class TimedExecutor:
    """LocalExecutor whose every step is synchronized and timed, with the iteration's shape noted. profile: the
    index of the iteration to run under the profiler among those of its kind, by kind: "hit" (a prompt row starts
    from a prefix-cache checkpoint), "prompt" (a new prompt row, none from a checkpoint); `self.profiles`: (kind,
    its shape, the profiler) each."""

    def __init__(self, inner: LocalExecutor, profile: dict[str, int] | None = None, host_profile: bool = False):
        self.inner, self.steps = inner, []  # (tokens, prompt rows, decode rows, seconds)
        self.shapes = []  # (prompt rows starting from a checkpoint, saves inside rows)
        self.paths = []  # how the worker ran each (k3ray.parallel.serving `step_path`)
        self.profile, self.seen, self.profiles = profile or {}, {}, []
        # host_profile: every hit iteration (but the torch-profiled one) under cProfile, its Python functions' host
        # time summed (the device runs behind: what the host spends per function, launches included)
        self.host = cProfile.Profile() if host_profile else None
        self.host_iterations = 0

    def run(self, plans):
        plan = plans[0]
        restored = sum(a.checkpoint >= 0 for a in plan.admit)
        kind = "hit" if restored else "prompt" if plan.admit and max(plan.counts) > 1 else None
        profiled = kind is not None and self.seen.get(kind, 0) == self.profile.get(kind)
        if kind is not None:
            self.seen[kind] = self.seen.get(kind, 0) + 1
        prof = _profiler() if profiled else None
        host = self.host if kind == "hit" and not profiled else None
        t0 = time.perf_counter()
        if prof is not None:
            with prof:
                out = self.inner.run(plans)
        elif host is not None:
            host.enable()
            out = self.inner.run(plans)
            host.disable()
            self.host_iterations += 1
        else:
            out = self.inner.run(plans)  # ends with the tokens on the host: synchronous
        dt = time.perf_counter() - t0
        rows = sum(c > 1 for c in plan.counts)
        self.steps.append((sum(plan.counts), rows, len(plan.counts) - rows, dt))
        self.shapes.append((restored, len(plan.saves)))
        self.paths.append(out[0].path)
        if prof is not None:
            self.profiles.append((kind, self.steps[-1], self.shapes[-1], prof))
        return out


def _profiler():
    kinds = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if DEVICE == "cuda"
                                                     else [])
    return torch.profiler.profile(activities=kinds)


def pct(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


def serve_sizes(model, cfg, fraction: float) -> ServeConfig:
    serve = cfg.serve.resolved(DEVICE, ep=1)
    if serve.pages_per_rank:
        return serve
    free, _ = torch.cuda.mem_get_info()
    prefix = prefix_sizes(serve, cfg.model)
    pages = serve.pages_per_rank or pages_that_fit(cfg.model, model.layers, serve.page_size, serve.slots_per_rank,
                                                   fraction * free, 0 if prefix is None else prefix.checkpoints)
    return serve.model_copy(update={"pages_per_rank": pages})


def ttft_one(model, cfg, serve, tokens: int) -> None:
    prompt = workload(1, f"{tokens}:{tokens}", "1", 7)[0][0]
    ex = TimedExecutor(executor(model, serve, None))
    times = []
    for _ in range(6):  # the prefix cache off: each run's prompt prefilled whole
        sched = Scheduler(serve.model_copy(update={"prefix_cache": False}), cfg.model.max_seq_len, 1,
                          cfg.policies.guards)
        t0 = time.perf_counter()
        req = sched.submit(prompt, SamplingParams(max_tokens=1))
        while sched.has_work:
            sched.step(ex)
        times.append(req.token_times[0] - t0 if req.token_times else float("nan"))
    print(f"[prefill] TTFT of one {tokens}-token prompt alone: median {statistics.median(times[1:]) * 1e3:.1f} ms "
          f"(runs {', '.join(f'{t * 1e3:.1f}' for t in times)}); worker step "
          f"{statistics.median(s[3] for s in ex.steps[1:]) * 1e3:.1f} ms", flush=True)


def level(model, cfg, serve, args, concurrency: int, inner: LocalExecutor, warm_up: bool = False) -> None:
    """One level of `concurrency` requests at a time on `inner` (a server's worker: its pools and CUDA graphs last
    from level to level), printed; `warm_up`: the same level on other prompts (the same system prompt), not
    printed, so that the printed one meets no first use of a shape, a kernel or a graph (compilation, autotuning
    and captures stalled the first iterations of a level for seconds)."""
    n = args.requests or max(4 * concurrency, 16)
    requests = workload(n, args.prompt_tokens, args.max_tokens, args.seed + warm_up)
    prefix = prefix_sizes(serve, cfg.model)
    sched = Scheduler(serve.model_copy(update={"max_waiting": 10 ** 6}), cfg.model.max_seq_len, 1,
                      cfg.policies.guards, prefix=prefix)
    profile = {k: i for k, i in (("hit", args.profile_hit), ("prompt", args.profile_prompt)) if i is not None}
    ex = TimedExecutor(inner, None if warm_up else profile, host_profile=args.host_profile and not warm_up)
    sent, t_sent, reqs = 0, {}, []
    t0 = time.perf_counter()
    while sent < n or sched.has_work:
        while sent < n and len(sched.table.running) + len(sched.table.waiting) < concurrency:
            prompt, max_tokens = requests[sent]
            req = sched.submit(prompt, SamplingParams(max_tokens=max_tokens))
            t_sent[req.id] = time.perf_counter()
            reqs.append(req)
            sent += 1
        sched.step(ex)
    wall = time.perf_counter() - t0
    if warm_up:
        return
    out_tokens = sum(len(r.out) for r in reqs)
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    ttft = [r.token_times[0] - t_sent[r.id] for r in reqs if r.token_times]
    itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
    worker = sum(s[3] for s in ex.steps)
    errors = [r.error for r in reqs if r.error]
    hit = sched.usage().get("prefix_cache", {}).get("hit_rate")
    print(f"| {concurrency} | {n} | {out_tokens / wall:,.0f} | {pct(ttft, 50) * 1e3:.0f} / {pct(ttft, 99) * 1e3:.0f} "
          f"| {pct(itl, 50) * 1e3:.1f} / {pct(itl, 90) * 1e3:.1f} / {pct(itl, 99) * 1e3:.1f} "
          f"| {sum(s[0] for s in ex.steps) / len(ex.steps):.0f} | {prompt_tokens / wall:,.0f} "
          f"| {worker / wall:.0%} | {sched.table.preemptions} | {len(errors)} "
          f"| {'-' if hit is None else f'{hit:.0%}'} | {max(s[3] for s in ex.steps) * 1e3:.1f} |", flush=True)
    bins = {}
    for tokens, prompts, decodes, dt in ex.steps:
        b = 1 << max(0, (tokens - 1).bit_length())
        bins.setdefault(b, []).append((dt, prompts, decodes))
    print("  worker step by tokens per iteration: " + "; ".join(
        f"<= {b}: {len(v)} x {statistics.median(x[0] for x in v) * 1e3:.1f} ms "
        f"({statistics.mean(x[1] for x in v):.1f} prompt + {statistics.mean(x[2] for x in v):.0f} decode rows)"
        for b, v in sorted(bins.items())), flush=True)
    by_path = {}
    for step, path in zip(ex.steps, ex.paths):
        by_path.setdefault(path, []).append(step[3])
    print("  worker step by path: " + "; ".join(
        f"{path}: {len(v)} x {statistics.median(v) * 1e3:.1f} ms (median), {sum(v) / worker:.0%} of the workers' time"
        for path, v in sorted(by_path.items(), key=lambda kv: -sum(kv[1]))), flush=True)
    hit_steps = [(step, shape) for step, shape in zip(ex.steps, ex.shapes) if shape[0]]
    if hit_steps:
        print(f"  iterations with a prompt row from a checkpoint: {len(hit_steps)}, median "
              f"{statistics.median(s[3] for s, _ in hit_steps) * 1e3:.1f} ms; with saves inside rows: "
              f"{sum(1 for _, (_, saves) in zip(ex.steps, ex.shapes) if saves)} of {len(ex.steps)} iterations",
              flush=True)
    for kind, (tokens, prompts, decodes, dt), (restored, saves), prof in ex.profiles:
        print(f"  profiled {kind} iteration, {restored} prompt row(s) from a checkpoint: {tokens} tokens, {prompts} "
              f"prompt + {decodes} decode rows, {saves} saves inside rows, {dt * 1e3:.1f} ms (profiled)", flush=True)
        print_profile(prof, tokens)
    if ex.host is not None and ex.host_iterations:
        print_host_profile(ex.host, ex.host_iterations)
    if errors:
        print(f"  first error: {errors[0]}", flush=True)


def print_host_profile(host: cProfile.Profile, iterations: int, rows: int = 35) -> None:
    """The hit iterations' host time by Python function (cProfile, per iteration): own time and with callees."""
    stats = pstats.Stats(host)
    print(f"  host time of {iterations} hit iterations by function (cProfile; per iteration, its overhead included):",
          flush=True)
    print("| function | calls | own ms | with callees ms |\n|---|---|---|---|", flush=True)
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:rows]
    for (file, line, name), (_, calls, own, cum, _) in entries:
        where = file.split("/k3ray/", 1)[-1] if "/k3ray/" in file else file.rsplit("/", 1)[-1]
        print(f"| {where}:{line} {name} | {calls / iterations:.1f} | {own / iterations * 1e3:.3f} "
              f"| {cum / iterations * 1e3:.3f} |", flush=True)


CATEGORIES = (("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
              ("kda", ("kda", "chunk_", "recurrent", "wy_", "gla", "fwd_kernel", "solve_tril")),
              ("conv", ("conv",)),
              ("experts", ("grouped", "expert", "situ", "permute", "histogram")),
              ("matmul", ("gemm", "sm90", "cutlass", "nvjet", "cublas", "matmul", "xmma")))


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "elementwise/other")


def mixed_profile(model, cfg, serve, args) -> None:
    """64 decode rows at ~700 tokens of context, then iterations that add prompt chunks up to --mixed-tokens."""
    requests = workload(256, args.prompt_tokens, "1000", args.seed + 1)
    budget = args.mixed_tokens
    prefix = prefix_sizes(serve, cfg.model)
    sched = Scheduler(serve.model_copy(update={"max_waiting": 10 ** 6, "token_budget": budget}),
                      cfg.model.max_seq_len, 1, cfg.policies.guards, prefix=prefix)
    ex = TimedExecutor(executor(model, serve, prefix))
    for prompt, _ in requests[:64]:
        sched.submit(prompt, SamplingParams(max_tokens=1000))
    while any(r.cached < r.length for r in sched.table.running.values()) or sched.table.waiting:
        sched.step(ex)  # the 64 prompts prefilled: from here they decode
    nxt = 64
    timed = []
    stats0 = torch.cuda.memory_stats() if DEVICE == "cuda" else {}
    for i in range(12):
        while len(sched.table.waiting) < 4:
            sched.submit(requests[nxt][0], SamplingParams(max_tokens=4))
            nxt += 1
        if i == 9:
            with _profiler() as prof:
                sched.step(ex)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
        else:
            sched.step(ex)
        timed.append(ex.steps[-1])
    if DEVICE == "cuda":
        stats1 = torch.cuda.memory_stats()
        print("  allocator over the 12 iterations: " + ", ".join(
            f"{k} +{stats1.get(k, 0) - stats0.get(k, 0)}" for k in ("num_device_alloc", "num_device_free",
                                                                    "num_alloc_retries", "num_sync_all_streams")),
              flush=True)
    print("  mixed iterations (tokens, prompt rows, decode rows, worker ms): " + ", ".join(
        f"({t}, {p}, {d}, {s * 1e3:.1f})" for t, p, d, s in timed[2:]), flush=True)
    print_profile(prof, timed[9][0])


def print_profile(prof, tokens: int) -> None:
    """A profiled iteration: device time by kernel category, the top kernels, the top ops by host time."""
    by = {}
    total = 0.0
    for e in prof.key_averages():
        t = e.self_device_time_total if DEVICE == "cuda" else e.self_cpu_time_total
        by[category(e.key)] = by.get(category(e.key), 0.0) + t
        total += t
    print(f"  profiled iteration ({tokens} tokens): device time {total / 1e3:.1f} ms: " + ", ".join(
        f"{k} {v / 1e3:.1f} ms ({v / max(total, 1e-9):.0%})" for k, v in sorted(by.items(), key=lambda kv: -kv[1])),
        flush=True)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=80),
          flush=True)
    print("  the same iteration by host time (self CPU):", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=80),
          flush=True)


def graph_captures(model, serve) -> None:
    """Every decode graph the pools can ask for, captured as a server's start does, each capture timed."""
    sizes = PoolSizes(serve.pages_per_rank, serve.page_size, serve.slots_per_rank)
    graphs = LocalExecutor(model, sizes, device=DEVICE).server.graphs
    if graphs is None:
        print("[prefill] no decode graphs on this device", flush=True)
        return
    timed, capture = [], graphs._capture

    def timed_capture(bucket, context, greedy, sample):
        t0 = time.perf_counter()
        out = capture(bucket, context, greedy, sample)
        torch.cuda.synchronize()
        timed.append((bucket, context, greedy, time.perf_counter() - t0))
        return out

    graphs._capture = timed_capture
    t0 = time.perf_counter()
    n = graphs.capture_ahead(float("inf"))
    wall = time.perf_counter() - t0
    print(f"[prefill] {n} decode graphs captured in {wall:.1f} s (median {statistics.median(t[3] for t in timed):.3f}"
          f" s, first {timed[0][3]:.2f} s, max {max(t[3] for t in timed):.2f} s)", flush=True)
    by = {}
    for bucket, context, greedy, dt in timed:
        by.setdefault(context, []).append(dt)
    print("  by context bucket: " + "; ".join(f"{c}: {len(v)} x {statistics.median(v) * 1e3:.0f} ms"
                                             for c, v in sorted(by.items())), flush=True)
    by = {}
    for bucket, context, greedy, dt in timed:
        by.setdefault(bucket, []).append(dt)
    print("  by batch bucket: " + "; ".join(f"{b}: {len(v)} x {statistics.median(v) * 1e3:.0f} ms"
                                           for b, v in sorted(by.items())), flush=True)
    del graphs
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/gpu2.yaml")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default max(4C, 16))")
    ap.add_argument("--prompt-tokens", default="200:1200")
    ap.add_argument("--max-tokens", default="32:256")
    ap.add_argument("--ttft-tokens", type=int, default=1000)
    ap.add_argument("--mixed-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default="ttft,levels,graphs,mixed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--system-tokens", help="LO:HI tokens of one system prompt before every prompt")
    ap.add_argument("--prefix-cache", choices=["on", "off"], help="serve.prefix_cache (default: the config's)")
    ap.add_argument("--profile-hit", type=int, help="levels: profile the iteration with this index (from 0) among "
                                                    "those with a prompt row starting from a cached prefix")
    ap.add_argument("--profile-prompt", type=int, help="levels: profile the iteration with this index (from 0) "
                                                       "among those with a new prompt row, none from a cached prefix")
    ap.add_argument("--host-profile", action="store_true", help="levels: the hit iterations under cProfile, their "
                    "host time by Python function")
    ap.add_argument("--prefill-bucket", type=int, help="k3ray.parallel.serving.PREFILL_TOKEN_BUCKET (1: unpadded)")
    ap.add_argument("--prompt-graphs", choices=["on", "off"], default="on",
                    help="prompt iterations as CUDA graphs in pieces (a GPU server's default) or eager")
    args = ap.parse_args()
    if args.prefill_bucket is not None:  # read when the StageServer is made
        serving.PREFILL_TOKEN_BUCKET = args.prefill_bucket
    global DEVICE, PROMPT_GRAPHS
    DEVICE, PROMPT_GRAPHS = args.device, args.prompt_graphs == "on"
    if args.prefix_cache is not None:
        args.set.append(f"serve.prefix_cache={args.prefix_cache == 'on'}")
    if args.system_tokens is not None:
        SYSTEM.extend(draws(ByteTokenizer(), 1, args.system_tokens, "1", args.seed + 10 ** 6)[0][0])
    torch.set_num_threads(1)  # as a k3ray worker runs (grid/worker.py): host-side ops on tiny tensors, one thread
    cfg = load_config(args.config, parse_assignments(args.set + ["parallel.ep=1", "parallel.pp=1"]))
    t0 = time.perf_counter()
    model = build_stage(cfg.model, range(cfg.model.n_layers), seed=cfg.train.seed, device=DEVICE)
    serve = serve_sizes(model, cfg, cfg.serve.gpu_memory_fraction)
    prompt_how = "as CUDA graphs by token bucket" if PROMPT_GRAPHS and DEVICE == "cuda" else \
        f"eager, padded to {serving.PREFILL_TOKEN_BUCKET if DEVICE == 'cuda' else 1} tokens"
    print(f"[prefill] {cfg.name} {cfg.model.n_layers} layers built in {time.perf_counter() - t0:.0f}s; torch "
          f"{torch.__version__}, {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU'}; token budget "
          f"{serve.token_budget}, slots "
          f"{serve.slots_per_rank}, pages {serve.pages_per_rank} x {serve.page_size}, stepwise prefill up to "
          f"{serve.stepwise_prefill_max}, prompt iterations {prompt_how}", flush=True)
    stages = args.stages.split(",")
    if "ttft" in stages:
        try:
            ttft_one(model, cfg, serve, args.ttft_tokens)
        except Exception:  # noqa: BLE001 - the benchmark reports every stage's failure and goes on
            traceback.print_exc()
    if "levels" in stages:
        print(f"prompts {args.prompt_tokens} tokens after a system prompt of {len(SYSTEM)}, max_tokens "
              f"{args.max_tokens}, greedy, no Ray, prefix cache {'on' if serve.prefix_cache else 'off'}")
        print("| concurrency | requests | output tok/s | TTFT p50 / p99 ms | ITL p50 / p90 / p99 ms | tokens per "
              "iteration | prompt tok/s | worker busy | preempted | errors | hit rate | slowest iteration ms |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        inner = executor(model, serve, prefix_sizes(serve, cfg.model))
        for c in args.concurrency:
            try:
                level(model, cfg, serve, args, c, inner, warm_up=True)
                level(model, cfg, serve, args, c, inner)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        graphs = inner.server.prompt_graphs
        if graphs is not None and graphs.capture:
            print(f"  prompt graphs: {len(graphs.buckets)} token buckets captured in {graphs.capture_seconds:.1f} s "
                  f"(each on its first use: {sorted(graphs.buckets)})", flush=True)
        del inner
    if "graphs" in stages and DEVICE == "cuda":
        try:
            graph_captures(model, serve)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    if "mixed" in stages:
        try:
            mixed_profile(model, cfg, serve, args)
        except Exception:  # noqa: BLE001
            traceback.print_exc()


if __name__ == "__main__":
    main()
