"""Serving under a bounded load: `k3ray serve` on a local Ray cluster, driven by the `openai` async client at fixed
concurrencies (each of C clients sends its next streaming completion when the previous one ends, `--requests` in
all per level). Prints output tokens/s, time to first token and inter-token latency (p50 / p99) per concurrency.

    python benchmarks/serve_load.py [--checkpoint runs/tiny/checkpoints] [--pp 1 --ep 1] [--concurrency 1 4 16 64]
    python benchmarks/serve_load.py --config configs/gpu2.yaml --set model.n_layers=4 ...   # seeded weights

Without --checkpoint: with --config, the config's seeded weights (`k3ray init`) in a temporary directory; else it
first trains the tiny config for a few steps there. On a GPU machine the GPU's busy share (nvidia-smi, sampled every
0.2 s) is printed per level. Every streamed chunk counts once for ITL; "tokens per chunk" says how many tokens the
chunks carried on average (above 1 when the client falls behind and an SSE event carries several).
`--front-doors N` serves HTTP from N processes; `--client-procs N` spreads the clients over N processes. The host
CPU table gives each process kind's share of a core during a level and its CPU time per 1000 output tokens: where
the host work per token goes.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import openai
import ray

from k3ray.config import load_config, parse_assignments
from k3ray.control.driver import init_ray, running_job
from k3ray.serve.app import start_serving, stop_serving

PROMPTS = ["def ", "import os\n", "class Reader(object):\n    def __init__(self", "for i in range(",
           "# Licensed to the PSF\n\"\"\"Helpers for ", "    if not data:\n        return "]


def train_checkpoint(root: str) -> None:
    cfg = load_config("configs/tiny.yaml", {"train.eval_every": 0, "parallel.pp": 1, "parallel.ep": 1,
                                            "checkpoint.dir": root, "checkpoint.every_n_steps": 4})
    with running_job(cfg) as controller:
        for s in range(4):
            ray.get(controller.train_step.remote(s), timeout=600)


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


async def clients(url: str, model: str, concurrency: int, requests: int, max_tokens: int, offset: int = 0) -> dict:
    """`concurrency` clients in this process, `requests` completions in all: their TTFTs, ITLs, tokens, chunks."""
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    ttft, itl, tokens, left, chunks = [], [], [0], [requests], [0]

    async def client(c: int) -> None:
        while left[0] > 0:
            left[0] -= 1
            t0 = time.perf_counter()
            last = None
            stream = await api.completions.create(model=model, prompt=PROMPTS[(c + left[0]) % len(PROMPTS)],
                                                  max_tokens=max_tokens, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens[0] += chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                chunks[0] += 1
                now = time.perf_counter()  # one chunk per engine iteration that gave this request a token
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now

    await asyncio.gather(*(client(offset + c) for c in range(concurrency)))
    await api.close()
    return {"ttft": ttft, "itl": itl, "tokens": tokens[0], "chunks": chunks[0]}


def client_process(job: tuple) -> dict:
    return asyncio.run(clients(*job))


def level(pool: ProcessPoolExecutor | None, procs: int, engine, url: str, model: str, concurrency: int,
          requests: int, max_tokens: int) -> dict:
    """One concurrency level, its clients spread over the pool's processes (one process's openai client parses
    a few thousand SSE events per second: more would measure the client)."""
    procs = 1 if pool is None else min(procs, concurrency)
    jobs = [(url, model, len(range(i, concurrency, procs)), len(range(i, requests, procs)), max_tokens, i)
            for i in range(procs)]
    busy = GpuBusy()
    stats0 = ray.get(engine.stats.remote())
    cpu0 = process_cpu_seconds()
    t0 = time.perf_counter()
    parts = [client_process(jobs[0])] if pool is None else list(pool.map(client_process, jobs))
    wall = time.perf_counter() - t0
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in process_cpu_seconds().items()}
    stats = ray.get(engine.stats.remote())
    iterations = max(stats["iterations"] - stats0["iterations"], 1)
    phases = {k: (v - stats0["phase_seconds"][k]) / iterations for k, v in stats["phase_seconds"].items()}
    ttft = [x for p in parts for x in p["ttft"]]
    itl = [x for p in parts for x in p["itl"]]
    tokens, chunks = sum(p["tokens"] for p in parts), sum(p["chunks"] for p in parts)
    return {"concurrency": concurrency, "requests": requests, "tokens": tokens, "seconds": wall,
            "gpu_busy": busy.stop(), "tokens_per_chunk": tokens / max(chunks, 1),
            "tokens_per_s": tokens / wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "cpu": cpu, "wall": wall,
            "iterations": iterations, "phases": phases}


def process_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by each kind of process on this machine that serves: Ray's actors by
    class (ray::ServingEngine, ray::Worker, the Serve replica and proxy), the raylet and GCS, and this client."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")[0].decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(pid) == os.getpid() or int(fields[1]) == os.getpid():
            name = "clients (this benchmark)"
        elif cmd.startswith("ray::"):
            name = re.split(r"[.\s]", cmd, maxsplit=1)[0]
        elif os.path.basename(cmd) in ("raylet", "gcs_server"):
            name = os.path.basename(cmd)
        else:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


class GpuBusy:
    """The GPU's busy share (nvidia-smi utilization.gpu, every 0.2 s) from construction to `stop`; None without one."""

    def __init__(self):
        self.samples: list[float] = []
        self.done = threading.Event()
        self.thread = None
        if shutil.which("nvidia-smi"):
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.2):
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split()
            if out:
                self.samples.append(float(out[0]))

    def stop(self) -> float | None:
        self.done.set()
        if self.thread is None:
            return None
        self.thread.join()
        return sum(self.samples) / len(self.samples) if self.samples else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default: max(4C, 16))")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--config", help="serve this config's seeded weights (no --checkpoint)")
    ap.add_argument("--set", action="append", default=[], help="config override, with --config")
    ap.add_argument("--token-budget", type=int, default=256, help="serve.token_budget")
    ap.add_argument("--stream-interval", type=int, default=1, help="serve.stream_interval")
    ap.add_argument("--prefill-hold-ms", type=float, help="serve.prefill_hold_ms (default: the config's)")
    ap.add_argument("--overlap", choices=["on", "off"], help="serve.overlap (default: the config's: on for pp=1)")
    ap.add_argument("--stepwise-prefill-max", type=int, help="serve.stepwise_prefill_max (default: the config's)")
    ap.add_argument("--front-doors", type=int, default=1, help="HTTP front-door processes")
    ap.add_argument("--client-procs", type=int, default=1, help="processes the clients are spread over")
    args = ap.parse_args()
    root = args.checkpoint
    if root is None:
        root = tempfile.mkdtemp(prefix="k3ray-serve-bench-")
        if args.config:
            from k3ray.train.checkpointing import write_seeded_weights

            cfg = load_config(args.config, parse_assignments(args.set))
            t0 = time.perf_counter()
            info = write_seeded_weights(cfg, root)
            print(f"[serve_load] seeded weights of {args.config} ({info['parameters'] / 1e9:.2f} B parameters, "
                  f"{info['bytes'] / 1e9:.1f} GB) in {time.perf_counter() - t0:.0f}s", flush=True)
    init_ray(None, args.pp * args.ep + 2)
    if root is not None and not args.checkpoint and not args.config:
        train_checkpoint(root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    top = max(args.concurrency)
    serve_cfg = {"slots_per_rank": -(-top // args.ep), "pages_per_rank": 8 * -(-top // args.ep),
                 "max_waiting": top, "token_budget": args.token_budget, "stream_interval": args.stream_interval,
                 **({} if args.prefill_hold_ms is None else {"prefill_hold_ms": args.prefill_hold_ms}),
                 **({} if args.overlap is None else {"overlap": args.overlap == "on"}),
                 **({} if args.stepwise_prefill_max is None else {"stepwise_prefill_max": args.stepwise_prefill_max})}
    t_start = time.perf_counter()
    serving = start_serving(root, args.pp, args.ep, port=port, serve_overrides=serve_cfg,
                            front_doors=args.front_doors)
    url, info = serving.url, serving.info
    hold_ms = 1e3 * ray.get(serving.engine.__ray_call__.remote(lambda e: e.sched.limits.prefill_hold_s))
    overlap = ray.get(serving.engine.__ray_call__.remote(lambda e: e.overlap))
    stepwise = ray.get(serving.engine.__ray_call__.remote(lambda e: e.sched.limits.stepwise_prefill_max))
    pool = ProcessPoolExecutor(args.client_procs, mp_context=get_context("spawn")) if args.client_procs > 1 else None
    try:
        if pool is not None:  # every client process started (Python, the openai import) before any level
            list(pool.map(time.sleep, [0.5] * args.client_procs))
        print(f"[serve_load] serving after {time.perf_counter() - t_start:.0f}s", flush=True)

        def run_level(concurrency: int, requests: int, max_tokens: int) -> dict:
            t0 = time.perf_counter()
            row = level(pool, args.client_procs, serving.engine, url, info["model"], concurrency, requests,
                        max_tokens)
            print(f"[serve_load] concurrency {concurrency}: {row['tokens_per_s']:,.0f} tok/s, "
                  f"{time.perf_counter() - t0:.1f}s", flush=True)
            return row

        run_level(1, 2, 4)  # warm-up: first iteration, connections
        rows = [run_level(c, args.requests or max(4 * c, 16), args.max_tokens) for c in args.concurrency]
    finally:
        if pool is not None:
            pool.shutdown()
        stop_serving(serving)
    print(f"k3ray serve, {info['model']} (checkpoint step {info['step']}), pp={args.pp} x ep={args.ep}, "
          f"max_tokens={args.max_tokens}, greedy, streaming, stream_interval={args.stream_interval}, "
          f"{args.front_doors} front doors, clients in {args.client_procs} processes, prefill hold "
          f"{hold_ms:g} ms, overlap {'on' if overlap else 'off'}, prompts of up to {stepwise} tokens stepwise")
    print("| concurrency | requests | output tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | tokens per chunk "
          "| GPU busy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        busy = "-" if r["gpu_busy"] is None else f"{r['gpu_busy']:.0f} %"
        print(f"| {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:,.1f} | {r['ttft_p50']:.3f} / "
              f"{r['ttft_p99']:.3f} | {1e3 * r['itl_p50']:.2f} / {1e3 * r['itl_p99']:.2f} | "
              f"{r['tokens_per_chunk']:.2f} | {busy} |", flush=True)
    print("\nHost CPU per process kind: share of one core during the level (CPU seconds / wall seconds), and CPU ms "
          "per 1000 output tokens")
    names = sorted({k for r in rows for k, v in r["cpu"].items() if v > 0.05 * r["wall"]})
    print("| process | " + " | ".join(f"c={r['concurrency']} core share / ms per 1k tok" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in names:
        cells = [f"{r['cpu'].get(name, 0) / r['wall']:.2f} / {1e6 * r['cpu'].get(name, 0) / max(r['tokens'], 1):,.0f}"
                 for r in rows]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nThe engine's iterations (ms each, means over the level): its wall time, and in it scheduling, "
          "waiting for the grid (of which the workers' own step), completing and waking the streams; host = schedule "
          "+ complete + wake, " + ("run while the workers run the iteration before (overlap: hidden where shorter "
                                   "than the step)" if overlap else "between the workers' steps (overlap off)"))
    print("| concurrency | iterations | wall | schedule | grid wait | worker step | complete | wake | host |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["phases"]
        print(f"| {r['concurrency']} | {r['iterations']} | {1e3 * r['wall'] / r['iterations']:.2f} | "
              + " | ".join(f"{1e3 * p[k]:.2f}" for k in ("schedule", "grid", "worker", "complete", "wake"))
              + f" | {1e3 * (p['schedule'] + p['complete'] + p['wake']):.2f} |")
    base = rows[0]["tokens_per_s"]
    print("throughput vs concurrency 1: " + ", ".join(f"{r['concurrency']}: {r['tokens_per_s'] / base:.2f}x"
                                                      for r in rows))


if __name__ == "__main__":
    main()
