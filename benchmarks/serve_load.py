"""Serving under a bounded load: `k3ray serve` on a local Ray cluster, driven by the `openai` async client at fixed
concurrencies (each of C clients sends its next streaming completion when the previous one ends, `--requests` in
all per level). Prints output tokens/s, time to first token and inter-token latency (p50 / p99) per concurrency.

    python benchmarks/serve_load.py [--checkpoint runs/tiny/checkpoints] [--pp 1 --ep 1] [--concurrency 1 4 16 64]

Without --checkpoint it first trains the tiny config for a few steps into a temporary directory.
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import tempfile
import time

import openai
import ray

from k3ray.config import load_config
from k3ray.control.driver import init_ray, running_job
from k3ray.control.serve import start_serving, stop_serving

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


async def level(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    ttft, itl, tokens, left = [], [], [0], [requests]

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
                now = time.perf_counter()  # one chunk per engine iteration that gave this request a token
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    wall = time.perf_counter() - t0
    await api.close()
    return {"concurrency": concurrency, "requests": requests, "tokens": tokens[0], "seconds": wall,
            "tokens_per_s": tokens[0] / wall, "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests", type=int, default=0, help="requests per level (default: max(2C, 16))")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    init_ray(None, args.pp * args.ep + 2)
    root = args.checkpoint
    if root is None:
        root = tempfile.mkdtemp(prefix="k3ray-serve-bench-")
        train_checkpoint(root)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    top = max(args.concurrency)
    serve_cfg = {"slots_per_rank": -(-top // args.ep), "pages_per_rank": 8 * -(-top // args.ep),
                 "max_waiting": top, "token_budget": 256}
    engine, info = start_serving(root, args.pp, args.ep, port=port, serve_overrides=serve_cfg)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(level(url, info["model"], 1, 2, 4))  # warm-up: first iteration, connections
        rows = [asyncio.run(level(url, info["model"], c, args.requests or max(2 * c, 16), args.max_tokens))
                for c in args.concurrency]
    finally:
        stop_serving(engine)
    print(f"k3ray serve, {info['model']} (checkpoint step {info['step']}), pp={args.pp} x ep={args.ep}, "
          f"max_tokens={args.max_tokens}, greedy, streaming")
    print("| concurrency | requests | output tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:,.1f} | {r['ttft_p50']:.3f} / "
              f"{r['ttft_p99']:.3f} | {1e3 * r['itl_p50']:.1f} / {1e3 * r['itl_p99']:.1f} |")
    base = rows[0]["tokens_per_s"]
    print("throughput vs concurrency 1: " + ", ".join(f"{r['concurrency']}: {r['tokens_per_s'] / base:.2f}x"
                                                      for r in rows))


if __name__ == "__main__":
    main()
