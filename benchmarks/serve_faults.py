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

--kills N: one engine, N kills instead of one per drill. In each round C requests start (two of them with long
prompts, prefilled over several iterations) and the worker of world rank --kill is SIGKILLed from outside at a random
moment, aimed in turn during the prefill, mid-iteration while every request decodes (a decode graph's replay on a
GPU: a random offset) and between iterations (as a token arrives); the standbys are given --standby-wait seconds to
be up again before each kill. Prints one row per kill: where it landed as the clients saw it (prefill: a request had
no token yet, else decode) and the ms since the last token reached a client, the gap (the longest time no token
reached any client), the recovery's own seconds and the loss to its next token, the requests that completed (no
error), those that ended with an error, and those with exactly their undisturbed tokens (all in float64; in bf16 a
re-prefilled row's rounding differs from the decode steps', so fewer); then the median and the worst gap.

Without --checkpoint it first trains the tiny config for a few steps into a temporary directory (serve_load.py's).
"""
from __future__ import annotations

import argparse
import os
import random
import signal
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
LONG_PROMPT = "# The arguments, checked once here: every function below trusts them.\n" * 20  # 1,360 bytes
AIMS = ["prefill", "mid-iteration", "between iterations"]
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
          spares: int, standbys: bool | str) -> dict:
    engine = ServingEngine.options(num_cpus=0).remote(checkpoint, pp, ep, serve, spares=spares, standbys=standbys)
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


def kill_rounds(checkpoint: str, args, serve: dict) -> list[dict]:
    """--kills: one engine, args.kills rounds of C requests, each with one SIGKILL at a random moment (module doc)."""
    engine = ServingEngine.options(num_cpus=0).remote(checkpoint, args.pp, args.ep, serve, spares=args.spares,
                                                      standbys=args.standbys)
    info = ray.get(engine.ready.remote())
    rng = random.Random(args.seed)
    long = LONG_PROMPT[:max(0, info["max_seq_len"] - args.max_tokens - 32)]  # bytes: at least as many as tokens
    prompts = [long + PROMPTS[i] if i < 2 else PROMPTS[i % len(PROMPTS)] for i in range(args.concurrency)]
    params = [{"max_tokens": args.max_tokens, "temperature": 0.0 if i % 2 else 0.8, "seed": i}
              for i in range(args.concurrency)]
    try:
        undisturbed = [[] for _ in prompts]
        for t in [stream(engine, p, kw, out) for p, kw, out in zip(prompts, params, undisturbed)]:
            t.join()
        rows = []
        for k in range(args.kills):
            deadline = time.monotonic() + args.standby_wait
            while ((st := ray.get(engine.stats.remote()))["standbys_up"] < st["standbys"]
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            worker = ray.get(engine.__ray_call__.remote(lambda e, r=args.kill: e.grid.group.workers[r]))
            pid = ray.get(worker.__ray_call__.remote(lambda w: os.getpid()))
            known = {i["time"] for i in ray.get(engine.incident_log.remote())}
            aim = AIMS[k % len(AIMS)]
            got = [[] for _ in prompts]
            threads = [stream(engine, p, kw, out) for p, kw, out in zip(prompts, params, got)]
            t_kill = aimed_kill(pid, aim, got, rng)
            for t in threads:
                t.join(timeout=300)
            lost = [i for i in ray.get(engine.incident_log.remote()) if i["time"] not in known]
            token_times = sorted(at for g in got for at, item in g if item.get("tokens"))
            before = [t for t in token_times if t <= t_kill]
            seconds = next((i.get("seconds", {}) for i in lost if i["kind"] == "worker_lost"), {})
            rows.append({
                "aim": aim, "landed": landed(got, t_kill),
                "since_token_ms": 1e3 * (t_kill - before[-1]) if before else float("nan"),
                "gap": serving_gap(token_times, t_kill), "recovery": seconds.get("total", float("nan")),
                "to_next_token": seconds.get("to_next_token", float("nan")),
                "completed": sum(bool(g) and g[-1][1].get("finish") is not None for g in got),
                "errors": sum(bool(g) and "error" in g[-1][1] for g in got),
                "same": sum(tokens(g) == tokens(u) and "error" not in g[-1][1] for g, u in zip(got, undisturbed)),
                "standbys_up": f"{st['standbys_up']}/{st['standbys']}",
                "actions": ",".join(str(i.get("action", i["kind"])) for i in lost),
                "phases": " ".join(f"{p}={v:.2f}" for p, v in seconds.items() if p not in ("total", "to_next_token"))})
            print_kill(k, rows[-1], args.concurrency)
        return rows
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine, no_restart=True)


def aimed_kill(pid: int, aim: str, got: list, rng: random.Random) -> float:
    """SIGKILL `pid` at a random moment of the kind `aim` in the streams `got` (filling in their threads); when."""
    if aim == "prefill":  # the long prompts' chunks take several iterations before their first token
        time.sleep(rng.uniform(0.0, 0.1))
    else:
        while sum(len(tokens(g)) >= 2 for g in got) < len(got):
            time.sleep(0.002)
        if aim == "mid-iteration":
            time.sleep(rng.uniform(0.0, 0.05))
        else:  # as the next token arrives: an iteration's answers just came back
            seen = sum(len(g) for g in got)
            while sum(len(g) for g in got) == seen:
                time.sleep(0.0005)
    t_kill = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    return t_kill


def landed(got: list, t_kill: float) -> str:
    """Where the kill landed, as the clients saw it."""
    return "prefill" if any(not tokens([(at, item) for at, item in g if at <= t_kill]) for g in got) else "decode"


def print_kill(k: int, r: dict, concurrency: int) -> None:
    if k == 0:
        print(f"{'kill':>4} {'aimed at':>18} {'landed':>7} {'since token ms':>14} {'gap s':>6} {'recovery s':>10} "
              f"{'next token s':>12} {'completed':>9} {'errors':>6} {'same':>4} {'standbys up':>11}  incidents: the "
              f"recovery's phases (s)", flush=True)
    print(f"{k:>4} {r['aim']:>18} {r['landed']:>7} {r['since_token_ms']:>14.1f} {r['gap']:>6.2f} "
          f"{r['recovery']:>10.2f} {r['to_next_token']:>12.2f} {r['completed']:>4}/{concurrency:<4} {r['errors']:>6} "
          f"{r['same']:>4} {r['standbys_up']:>11}  {r['actions']}: {r['phases']}", flush=True)


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
    ap.add_argument("--kills", type=int, default=0, help="kills at random moments on one engine (module doc)")
    ap.add_argument("--standbys", choices=["auto", "on", "off"], default="auto",
                    help="fault_tolerance.standbys (auto: on GPUs, as `k3ray serve`)")
    ap.add_argument("--standby-wait", type=float, default=30.0, help="--kills: seconds given to standbys before a kill")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.standbys = {"on": True, "off": False}.get(args.standbys, args.standbys)
    init_ray(None, args.pp * args.ep + args.spares + 2)
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = tempfile.mkdtemp(prefix="k3ray-serve-faults-")
        train_checkpoint(checkpoint)
    serve = {"pages_per_rank": 8 * args.concurrency, "page_size": 16, "slots_per_rank": args.concurrency,
             "token_budget": 256, "max_tokens": args.max_tokens}
    if args.server_defaults:
        serve = {"max_tokens": max(args.max_tokens, 256)}
    if args.kills:
        rows = kill_rounds(checkpoint, args, serve)
        gaps = [r["gap"] for r in rows]
        print(f"gap s: median {statistics.median(gaps):.2f}, worst {max(gaps):.2f}; streams completed "
              f"{sum(r['completed'] for r in rows)}/{args.concurrency * len(rows)}, with an error "
              f"{sum(r['errors'] for r in rows)}, with the undisturbed tokens {sum(r['same'] for r in rows)}",
              flush=True)
        return
    rows = []
    print(f"{'drill':>5} {'requests same':>13} {'ep':>6} {'spares':>6} {'standbys':>8} {'gap s':>6} "
          + " ".join(f"{p:>14}" for p in PHASES))
    for d in range(args.drills):
        r = drill(checkpoint, args.pp, args.ep, args.concurrency, args.max_tokens, args.kill, serve, args.spares,
                  args.standbys)
        rows.append(r)
        print(f"{d:>5} {r['same']:>6}/{args.concurrency:<6} {'->'.join(map(str, r['ep'])):>6} "
              f"{len(r['spares_used']) - len(r['standbys_used']):>6} {len(r['standbys_used']):>8} {r['gap']:>6.2f} "
              + " ".join(f"{r.get(p, 0.0):>14.3f}" for p in PHASES), flush=True)
    med = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in ["gap", *PHASES]}
    print(f"{'med':>5} {'':>13} {'':>6} {'':>6} {med['gap']:>6.2f} " + " ".join(f"{med[p]:>14.3f}" for p in PHASES))


if __name__ == "__main__":
    main()
