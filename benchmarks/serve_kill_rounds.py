"""Serving under repeated SIGKILLs from outside: the engine on pp x ep (with hot spares) while C clients stream
requests back to back; in each of R rounds, a few seconds apart, one of the engine's worker processes (grid workers
and spares alike, chosen at random, also one still starting) is SIGKILLed. Every request must end with the tokens of
the same request undisturbed, none with an error, and requests after the last round too. Prints one row per drill
(requests, errors, differing texts, the incidents' actions) and the totals.

    python benchmarks/serve_kill_rounds.py [--checkpoint DIR] [--pp 2 --ep 2 --spares 1] [--rounds 3] [--gap 3]
                                           [--drills 3] [--seed 0]

The processes are found through Ray's state API (this script's own local cluster, with the dashboard), so nothing
outside the cluster is touched. Without --checkpoint it first trains the tiny config for a few steps.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import tempfile
import threading
import time

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.state import list_actors

from k3ray.control.local_nodes import free_port
from k3ray.serve.engine import ServingEngine
from k3ray.data import encode
from k3ray.model.sampling import SamplingParams

from serve_load import train_checkpoint

PROMPTS = ["def ", "import os\n", "class Reader(object):\n    def __init__(self", "for i in range(", "x = ",
           "with open(path) as f:\n", "return ", "print("]


def worker_pids(dashboard: str) -> list[int]:
    """The cluster's live Worker actors' processes (those still starting included, once they have one)."""
    return [a.pid for a in list_actors(address=dashboard, filters=[("class_name", "=", "Worker")], limit=1000)
            if a.state in ("ALIVE", "PENDING_CREATION") and a.pid]


def run(engine, prompt: str, params: dict, arrivals: list[float]) -> tuple[list[int], str | None]:
    """One request's tokens and its error (None if it ended well); when tokens arrived goes to `arrivals`."""
    tokens, error = [], None
    for ref in engine.generate.options(num_returns="streaming").remote(encode(prompt), SamplingParams(**params)):
        item = ray.get(ref)
        if item.get("tokens"):
            arrivals.append(time.monotonic())
        tokens += item.get("tokens", [])
        error = item.get("message") if "error" in item else error
    return tokens, error


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f"{t % 1:.2f}"[1:]


def round_gaps(arrivals: list[float], kills: list[float]) -> list[float]:
    """Per kill, the serving gap the clients saw: from the last token any stream got before the kill to the first
    one after it (kills inside one gap share it)."""
    gaps = []
    for k in kills:
        before = [t for t in arrivals if t <= k]
        after = [t for t in arrivals if t > k]
        gaps.append(round(after[0] - before[-1], 2) if before and after else float("inf"))
    return gaps


def drill(checkpoint: str, args, rng: random.Random, serve: dict, dashboard: str) -> dict:
    engine = ServingEngine.options(num_cpus=0).remote(checkpoint, args.pp, args.ep, serve, spares=args.spares)
    ray.get(engine.ready.remote())
    params = {"max_tokens": args.max_tokens, "temperature": 0.0}
    try:
        want = {p: run(engine, p, params, [])[0] for p in PROMPTS}
        stop, results, arrivals, kills = threading.Event(), [], [], []

        def client(c: int) -> None:
            k = c
            while not stop.is_set():
                prompt = PROMPTS[k % len(PROMPTS)]
                tokens, error = run(engine, prompt, params, arrivals)
                results.append((time.time(), tokens == want[prompt], error))
                k += 1

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.concurrency)]
        for t in threads:
            t.start()
        time.sleep(args.gap)
        for _ in range(args.rounds):
            pids = worker_pids(dashboard)
            if pids:
                pid = rng.choice(pids)
                os.kill(pid, signal.SIGKILL)
                kills.append(time.monotonic())
                print(f"      {clock(time.time())} SIGKILL pid {pid} of {sorted(pids)}", flush=True)
            time.sleep(args.gap)
        t_last = time.time()
        time.sleep(args.after)
        stop.set()
        for t in threads:
            t.join(timeout=600)
        gaps = round_gaps(sorted(arrivals), kills)  # once every request ended: a recovery may outlast `after`
        incidents = ray.get(engine.incident_log.remote())
        health = ray.get(engine.health.remote())
        for i in incidents:
            print(f"      {clock(i['time'])} {i['kind']} ranks={i.get('ranks')} ep={i.get('ep')} "
                  f"action={i.get('action')} "
                  f"attempts={i.get('attempts')} interrupted={i.get('interrupted')} "
                  f"failed={i.get('failed_attempts')} total_s={i.get('seconds', {}).get('total')} "
                  f"gap_s={i.get('seconds', {}).get('to_next_token')}", flush=True)
        if health["status"] != "ok":
            print(f"      health: {health}", flush=True)
        return {"requests": len(results), "errors": sum(e is not None for _, _, e in results),
                "differ": sum(not same and e is None for _, same, e in results),
                "after_last": sum(t > t_last + args.after / 2 for t, _, _ in results),
                "errors_after": sum(e is not None for t, _, e in results if t > t_last + args.after / 2),
                "max_gap_s": round(max(gaps, default=0.0), 2), "gaps": gaps,
                "actions": ",".join(str(i.get("action", i["kind"])) for i in incidents),
                "health": health["status"]}
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine, no_restart=True)
        for pg_id, pg in ray.util.placement_group_table().items():  # an engine killed mid-recovery leaves its own
            if pg["state"] != "REMOVED":
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap", type=float, default=3.0, help="seconds between kills")
    ap.add_argument("--after", type=float, default=15.0, help="seconds of load after the last kill")
    ap.add_argument("--drills", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    # as `k3ray serve` sizes a local cluster (workers + spares), with the dashboard for the state API
    port = free_port()
    ray.init(num_cpus=max(os.cpu_count() or 1, args.pp * args.ep + args.spares), include_dashboard=True,
             dashboard_port=port, log_to_driver=False)
    dashboard = f"http://127.0.0.1:{port}"
    print(f"cluster: {ray.get_runtime_context().gcs_address}", flush=True)
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = tempfile.mkdtemp(prefix="k3ray-serve-kills-")
        train_checkpoint(checkpoint)
    serve = {"pages_per_rank": 8 * args.concurrency, "page_size": 16, "slots_per_rank": args.concurrency,
             "token_budget": 256, "max_tokens": args.max_tokens}
    rng = random.Random(args.seed)
    cols = ["requests", "errors", "differ", "after_last", "errors_after", "max_gap_s", "health", "actions"]
    print(f"{'drill':>5} " + " ".join(f"{c:>12}" for c in cols[:-1]) + "  actions", flush=True)
    rows = []
    for d in range(args.drills):
        r = drill(checkpoint, args, rng, serve, dashboard)
        rows.append(r)
        print(f"{d:>5} " + " ".join(f"{r[c]:>12}" for c in cols[:-1]) + f"  {r['actions']}  gaps {r['gaps']}",
              flush=True)
    total = {c: sum(r[c] for r in rows) for c in cols[:5]}
    print(f"{'all':>5} " + " ".join(f"{total[c]:>12}" for c in cols[:5]))


if __name__ == "__main__":
    main()
