"""Serving through a lost worker: the engine on pp x ep with C requests streaming; one worker is killed once every
request has tokens; every request must still end with the tokens of the same requests run undisturbed on the same
engine first. Prints, per drill, the serving gap (the longest stretch without a token at any client, from the kill
on) and the engine's phases, then the medians.

    python benchmarks/serve_faults.py [--checkpoint runs/tiny/checkpoints] [--pp 2 --ep 2] [--drills 3] [--kill 2]
                                      [--spares 1]

--server-defaults: the serving sizes a user gets on the device (on a GPU: pools from free memory, 256 slots, the
token budget, decode graphs), not the small fixed ones.

With --spares, or with standbys (`fault_tolerance.standbys`, on by default on GPUs: a process beside each worker
on its device), the lost worker's place is taken by a hot spare or its standby (column "workers": swapping them in)
rather than by a grid launched anew (column "workers": placing and starting worker processes). The kill waits until
every worker's standby is up (at most 120 s; column "standbys": those that took a place).

Without --checkpoint it first trains the tiny config for a few steps into a temporary directory (serve_load.py's).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import ray

from k3ray.control.ray_cluster import init_ray
from k3ray.serve.engine import ServingEngine
from k3ray.data import encode
from k3ray.model.sampling import SamplingParams

from serve_load import train_checkpoint

PROMPTS = ["def ", "import os\n", "class Reader(object):\n    def __init__(self", "for i in range(",
           "# Licensed to the PSF\n\"\"\"Helpers for ", "    if not data:\n        return ", "x = ", "print(",
           "with open(path) as f:\n", "return "]
PHASES = ["replan", "workers", "worker_process", "worker_imports", "worker_cuda", "process_groups", "restore",
          "cache_pools", "graph_capture", "first_graph", "to_next_token"]


def stream(engine, prompt: str, params: dict, into: list) -> threading.Thread:
    """Collect one request's stream items with their arrival times, in a thread."""
    gen = engine.generate.options(num_returns="streaming").remote(encode(prompt), SamplingParams(**params))

    def run():
        for ref in gen:
            into.append((time.perf_counter(), ray.get(ref)))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def tokens(items: list) -> list[int]:
    return [t for _, item in items for t in item.get("tokens", ())]


def serving_gap(token_times: list[float], t_kill: float) -> float:
    """The longest stretch without a token at any client from the last token before the kill on (tokens of the
    iteration in flight can still arrive after the kill was sent)."""
    times = sorted(token_times)
    start = max((i for i, t in enumerate(times) if t <= t_kill), default=0)
    return max((b - a for a, b in zip(times[start:], times[start + 1:])), default=0.0)


def drill(checkpoint: str, pp: int, ep: int, concurrency: int, max_tokens: int, kill: int, serve: dict,
          spares: int) -> dict:
    engine = ServingEngine.options(num_cpus=0).remote(checkpoint, pp, ep, serve, spares=spares)
    ray.get(engine.ready.remote())
    started = ray.get(engine.__ray_call__.remote(lambda e: e.start_seconds))
    print("engine started in " + ", ".join(f"{k} {v:.1f} s" for k, v in started.items()), flush=True)
    params = [{"max_tokens": max_tokens, "temperature": 0.0 if i % 2 else 0.8, "seed": i} for i in range(concurrency)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]
    try:
        undisturbed = [[] for _ in prompts]
        for t in [stream(engine, p, kw, out) for p, kw, out in zip(prompts, params, undisturbed)]:
            t.join()
        deadline = time.monotonic() + 120  # a serving engine runs for hours: its standbys are up by a fault
        while ((st := ray.get(engine.stats.remote()))["standbys_up"] < st["standbys"]
               and time.monotonic() < deadline):
            time.sleep(0.2)
        got = [[] for _ in prompts]
        threads = [stream(engine, p, kw, out) for p, kw, out in zip(prompts, params, got)]
        while sum(len(tokens(g)) >= 2 for g in got) < concurrency:
            time.sleep(0.02)
        t_kill = time.perf_counter()
        ray.get(engine.drill.remote("kill_worker", [kill]))
        for t in threads:
            t.join()
        incident = [i for i in ray.get(engine.incident_log.remote()) if i["kind"] == "worker_lost"][0]
        gap = serving_gap([at for g in got for at, item in g if item.get("tokens")], t_kill)
        same = sum(tokens(g) == tokens(u) and "error" not in g[-1][1] for g, u in zip(got, undisturbed))
        errors = [g[-1][1]["error"] for g in got if g and "error" in g[-1][1]]
        if errors:
            print(f"{len(errors)} streams ended with an error; the first: {errors[0]}", flush=True)
        seconds = dict(incident["seconds"])
        seconds["workers"] = seconds.pop("swap_in_spares", None) or seconds.pop("place_and_start_workers")
        return {"gap": gap, "same": same, "ep": incident["ep"], "spares_used": incident["spares_used"],
                "standbys_used": incident.get("standbys_used", []), **seconds}
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine, no_restart=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--drills", type=int, default=3)
    ap.add_argument("--kill", type=int, default=2, help="world rank to kill")
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--spares", type=int, default=0, help="hot spares of the serving grid")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--server-defaults", action="store_true", help="the device's default serving sizes")
    args = ap.parse_args()
    init_ray(None, args.pp * args.ep + args.spares + 2)
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = tempfile.mkdtemp(prefix="k3ray-serve-faults-")
        train_checkpoint(checkpoint)
    serve = {"pages_per_rank": 8 * args.concurrency, "page_size": 16, "slots_per_rank": args.concurrency,
             "token_budget": 256, "max_tokens": args.max_tokens}
    if args.server_defaults:
        serve = {"max_tokens": max(args.max_tokens, 256)}
    rows = []
    print(f"{'drill':>5} {'requests same':>13} {'ep':>6} {'spares':>6} {'standbys':>8} {'gap s':>6} "
          + " ".join(f"{p:>14}" for p in PHASES))
    for d in range(args.drills):
        r = drill(checkpoint, args.pp, args.ep, args.concurrency, args.max_tokens, args.kill, serve, args.spares)
        rows.append(r)
        print(f"{d:>5} {r['same']:>6}/{args.concurrency:<6} {'->'.join(map(str, r['ep'])):>6} "
              f"{len(r['spares_used']) - len(r['standbys_used']):>6} {len(r['standbys_used']):>8} {r['gap']:>6.2f} "
              + " ".join(f"{r.get(p, 0.0):>14.3f}" for p in PHASES), flush=True)
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in ["gap", *PHASES]}
    print(f"{'med':>5} {'':>13} {'':>6} {'':>6} {med['gap']:>6.2f} " + " ".join(f"{med[p]:>14.3f}" for p in PHASES))


if __name__ == "__main__":
    main()
