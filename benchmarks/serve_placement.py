"""Live expert copies in serving under skewed, shifting traffic: the engine on pp=1 x ep=4 (the tiny config's seeded
weights, float32) with C clients streaming requests back to back. The routing is skewed by a router bias
-beta * log(1 + i) over the experts in hot order i (K3_NOTES' skew for peer MoE layers; top-4 of 16 caps an
expert's share at 1/4 of the routes, so Zipf 1.2's 36 % top share cannot be reached exactly); MoonEP is off, so the
baseline is plain expert parallelism. Phases: `before` (no copies), a move decided (`rebalance`) and `during` until
its switch, `after`; then the hot set shifts to other ranks' experts (`shifted`), another move (`during 2`), `after
2`. Prints per phase: the measured balancedness (mean / max rows each EP rank computed, from the workers'
counters), ITL p50 / p99 over every client, tokens/s; and per move: balancedness the policy planned on the decayed
load before -> after, copies fetched, bytes moved, seconds from decision to switch. Failed requests are counted.

With `--train`: the same skew in training instead (Ray-free: 4 processes over gloo, the tiny config in float32 with
the router's balancing off so the skew stays): plain expert parallelism, the same with copies of the hot experts
in `--slots` spare slots per rank (placed from step 0's load, fetched before step 1, gradients returned home and
copies refreshed every step), and MoonEP's per-micro-batch replicas. Prints per run the median step time and the
part of it after the backward (gradient reductions, the optimizer, and with copies their gradients going home and
their refresh), the balancedness (mean / max rows per EP rank, summed over the MoE layers) and the last loss (the copies' equals plain
EP's up to float32 summation order).

    python benchmarks/serve_placement.py [--clients 16] [--phase-s 8] [--beta 1.5] [--slots 4]
With `--train-scale`: a training job (tiny, float32, pp=1 x ep=4, on a local Ray cluster) scaled to ep=2 before step
2 and back to ep=4 before step 4 (`Controller.request_scale`, what `k3ray scale --ep N` asks for); prints each
resize's seconds at its boundary, every step's time and loss, and the losses of the same job unscaled.

    python benchmarks/serve_placement.py --train [--steps 8] [--beta 1.5] [--slots 4]
    python benchmarks/serve_placement.py --train-scale
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import ray
import torch

from k3ray.config import load_config
from k3ray.control.ray_cluster import init_ray
from k3ray.control.local_nodes import free_port
from k3ray.train.checkpointing import write_seeded_weights
from k3ray.serve.engine import ServingEngine
from k3ray.data import encode
from k3ray.model.sampling import SamplingParams

PROMPTS = ["def ", "import os\n", "class Reader(object):\n    def __init__(self", "for i in range(", "x = ",
           "    if not data:\n        return ", "print(", "with open(path) as f:\n", "return ", "# "]
E, EP = 16, 4


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return float("nan") if not s else s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def skew_bias(hot_first: list[int], beta: float) -> torch.Tensor:
    bias = torch.empty(E)
    for i, e in enumerate(hot_first):
        bias[e] = -beta * torch.log1p(torch.tensor(float(i)))
    return bias


def _set_bias(worker, bias):  # runs inside each worker process
    for moe in worker.seat.engine.stage.moe_layers().values():
        moe.router.bias.copy_(bias.to(moe.router.bias))


def _rank_rows(worker):  # rows each EP rank computed, summed over the stage's MoE layers since the start
    total = None
    for moe in worker.seat.engine.stage.moe_layers().values():
        load = moe.experts.rank_load
        if load is not None:
            total = load.clone() if total is None else total + load
    return total


def on_grid(engine, fn, *args):
    """fn(worker, *args) in every worker of the engine's grid (through the engine actor)."""
    return ray.get(engine.__ray_call__.remote(lambda eng: eng.grid.group.run_on(
        list(range(len(eng.grid.group.workers))), fn, *args)))


class Clients:
    """C clients, each streaming requests back to back; every token's arrival time, and failed requests."""

    def __init__(self, engine, clients: int, max_tokens: int):
        self.engine, self.max_tokens = engine, max_tokens
        self.arrivals: list[list[float]] = [[] for _ in range(clients)]
        self.failed, self.done, self.stop = 0, 0, False
        self.threads = [threading.Thread(target=self.run, args=(c,), daemon=True) for c in range(clients)]
        for t in self.threads:
            t.start()

    def run(self, c: int) -> None:
        i = c
        while not self.stop:
            params = SamplingParams(max_tokens=self.max_tokens, temperature=0.8, seed=i)
            gen = self.engine.generate.options(num_returns="streaming").remote(encode(PROMPTS[i % len(PROMPTS)]),
                                                                               params)
            last = None
            for ref in gen:
                item = ray.get(ref)
                if "error" in item:
                    self.failed += 1
                    break
                if item.get("tokens"):
                    now = time.perf_counter()
                    if last is not None:  # inter-token latency: gaps inside one request's stream
                        self.arrivals[c].append((now, (now - last) / len(item["tokens"])))
                    last = now
            self.done += 1
            i += len(self.threads)

    def itl(self, t0: float, t1: float) -> list[float]:
        return [gap for arr in self.arrivals for at, gap in arr if t0 <= at < t1]


TRAIN_RUNS = {"plain EP": {"policies.moonep.enabled": False}, "plain EP + copies": {"policies.moonep.enabled": False},
              "MoonEP": {"policies.moonep.enabled": True}}


def _train_rank(rank: int, ports: list[int], steps: int, beta: float, slots: int, out: str) -> None:
    from k3ray.parallel.engine import StageEngine
    from k3ray.policies import copies

    torch.set_num_threads(1)
    results = {}
    for port, (name, overrides) in zip(ports, TRAIN_RUNS.items()):
        cfg = load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": EP, "model.balancing": "none",
                                                "train.eval_every": 0, **overrides})
        home = [e * EP // E for e in range(E)]
        engine = StageEngine(cfg, 0, rank, home, EP)
        engine.init_process_groups(f"tcp://127.0.0.1:{port}", "gloo")
        for moe in engine.stage.moe_layers().values():
            moe.router.bias.copy_(skew_bias(list(range(E)), beta))
        seconds, boundary, balance, loss = [], [], [], None
        for step in range(steps):
            report = engine.train_step(step, step)
            if step == 0 and name.endswith("copies"):  # placed from step 0's load, used from step 1 on
                load = sum(torch.tensor(t, dtype=torch.float64).sum(0) for t in report["tokens_per_expert"].values())
                engine.copies.set_trained(copies.place_copies(load, home, EP, slots))
            if step > 0:
                per_rank = sum(torch.tensor(r, dtype=torch.float64) for r in report["rank_load"].values())
                seconds.append(report["timings"]["total"])
                boundary.append(report["timings"]["optimizer"])  # with copies: gradients home, copies refreshed
                balance.append(float(per_rank.mean() / per_rank.max()))
            loss = report["loss"]
        results[name] = {"seconds": seconds, "boundary": boundary, "balance": balance, "loss": loss}
        engine.leave_process_groups()
    torch.save(results, f"{out}/{rank}.pt")


def train_main(args) -> None:
    out = tempfile.mkdtemp(prefix="k3ray-train-copies-")
    torch.multiprocessing.spawn(_train_rank, args=([free_port() for _ in TRAIN_RUNS], args.steps, args.beta,
                                                   args.slots, out), nprocs=EP, join=True)
    ranks = [torch.load(f"{out}/{r}.pt") for r in range(EP)]
    print(f"training, pp=1 x ep={EP} over gloo (4 processes), tiny float32, balancing off, beta={args.beta}, "
          f"spare slots per rank={args.slots}, steps 1-{args.steps - 1} (step 0 places the copies), "
          f"torch {torch.__version__}")
    print(f"{'run':18} {'step s (median)':>15} {'of it after backward s':>22} {'balancedness':>12} "
          f"{'last loss':>10}")
    for name in TRAIN_RUNS:
        step_s, after_s = (statistics.median(max(r[name][k][i] for r in ranks) for i in range(args.steps - 1))
                           for k in ("seconds", "boundary"))
        print(f"{name:18} {step_s:15.3f} {after_s:22.3f} {statistics.median(ranks[0][name]['balance']):12.3f} "
              f"{ranks[0][name]['loss']:10.5f}")


def train_scale_main() -> None:
    from k3ray.control.driver import running_job

    init_ray(None, 2 * EP + 1)
    root = tempfile.mkdtemp(prefix="k3ray-train-scale-")
    runs = {}
    for name, sizes in (("scaled", {2: 2, 4: EP}), ("unscaled", {})):
        cfg = load_config("configs/tiny.yaml", {"name": f"scale-{name}", "parallel.pp": 1, "parallel.ep": EP,
                                                "train.eval_every": 0, "train.steps": 6, "checkpoint.at_end": False,
                                                "checkpoint.dir": f"{root}/{name}", "api.enabled": False})
        steps = []
        with running_job(cfg) as controller:
            for step in range(6):
                if step in sizes:
                    ray.get(controller.request_scale.remote(sizes[step]))
                t0 = time.perf_counter()
                report = ray.get(controller.train_step.remote(step), timeout=600)
                steps.append((time.perf_counter() - t0, report["loss"]))
            incidents = [i for i in ray.get(controller.get_incidents.remote()) if i["kind"] == "scaled"]
        runs[name] = (steps, incidents)
    print(f"training job, tiny float32, pp=1, ep {EP} -> 2 at step 2 -> {EP} at step 4, torch {torch.__version__}, "
          f"ray {ray.__version__}")
    for i in runs["scaled"][1]:
        print(f"scale ep {i['ep'][0]} -> {i['ep'][1]} at step {i['step']}: {i['seconds']:.2f}s at the boundary "
              f"(snapshot, regroup or grow, restore)")
    print(f"{'step':>4} {'scaled s':>9} {'loss':>9} {'unscaled s':>10} {'loss':>9}")
    for step, ((a, la), (b, lb)) in enumerate(zip(runs["scaled"][0], runs["unscaled"][0])):
        print(f"{step:4d} {a:9.2f} {la:9.5f} {b:10.2f} {lb:9.5f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--phase-s", type=float, default=8.0)
    ap.add_argument("--beta", type=float, default=1.5)
    ap.add_argument("--slots", type=int, default=4, help="replication.spare_slots_per_rank")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--scale", action="store_true", help="then scale the grid to ep=2 and back to 4 under the load")
    ap.add_argument("--train", action="store_true", help="training with and without copies instead (Ray-free)")
    ap.add_argument("--steps", type=int, default=8, help="training steps per run (--train)")
    ap.add_argument("--train-scale", action="store_true", help="a training job scaled down and up instead")
    args = ap.parse_args()
    if args.train:
        train_main(args)
        return
    if args.train_scale:
        train_scale_main()
        return
    init_ray(None, 2 * EP + 1)  # room for a second grid: scaling launches the new one beside the serving one
    root = tempfile.mkdtemp(prefix="k3ray-placement-") + "/ckpt"
    write_seeded_weights(load_config("configs/tiny.yaml"), root)
    serve = {"page_size": 4, "pages_per_rank": 256, "slots_per_rank": 8, "token_budget": 64, "max_waiting": 64,
             "max_tokens": 64}
    engine = ServingEngine.options(num_cpus=0).remote(root, 1, EP, serve)
    ray.get(engine.ready.remote(), timeout=300)
    ray.get(engine.set_policy.remote("moonep", {"enabled": False}, "benchmark"))
    ray.get(engine.set_policy.remote("replication", {"enabled": True, "every_n_steps": 10 ** 6, "history_decay": 0.0,
                                                     "spare_slots_per_rank": args.slots}, "benchmark"))
    hot = list(range(E))  # hottest first: experts 0, 1, ... all homed on rank 0 first
    on_grid(engine, _set_bias, skew_bias(hot, args.beta))
    clients = Clients(engine, args.clients, args.max_tokens)
    phases, moves = [], []

    def phase(name: str, until=None) -> None:
        rows0, t0 = on_grid(engine, _rank_rows), time.perf_counter()
        if until is None:
            time.sleep(args.phase_s)
        else:
            until()
        rows1, t1 = on_grid(engine, _rank_rows), time.perf_counter()
        rows = [(b - (a if a is not None else 0)).double() for a, b in zip(rows0, rows1)]
        per_rank = torch.stack(rows).sum(0)
        itl = clients.itl(t0, t1)
        phases.append({"phase": name, "seconds": t1 - t0, "balancedness": float(per_rank.mean() / per_rank.max()),
                       "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "tokens": len(itl)})

    def move() -> None:
        n = len(ray.get(engine.placement_view.remote())["moves"])
        ray.get(engine.rebalance.remote())
        while len((view := ray.get(engine.placement_view.remote()))["moves"]) == n:
            time.sleep(0.01)
        moves.append(view["moves"][-1])

    time.sleep(2.0)  # every client streaming
    phase("before")
    phase("during", move)
    phase("after")
    hot = hot[8:] + hot[:8]  # the hot set moves to ranks 2 and 3's experts
    on_grid(engine, _set_bias, skew_bias(hot, args.beta))
    ray.get(engine.expert_load.remote())  # the counts so far are the old traffic's: the next move sees the new only
    phase("shifted")
    phase("during 2", move)
    phase("after 2")
    scales = []
    if args.scale:
        for ep in (2, EP):
            t0 = time.perf_counter()
            out = ray.get(engine.scale.remote(ep), timeout=600)
            t1 = time.perf_counter()
            time.sleep(5)  # the gap shows when the next token of each request arrives
            scales.append((out, max(clients.itl(t0, t1 + 5), default=float("nan"))))
    clients.stop = True
    for t in clients.threads:
        t.join(timeout=120)
    ray.get(engine.shutdown.remote(), timeout=120)
    print(f"pp=1 x ep={EP}, {args.clients} clients, beta={args.beta}, spare slots per rank={args.slots}, "
          f"torch {torch.__version__}, ray {ray.__version__}")
    print(f"{'phase':10} {'seconds':>8} {'balancedness':>12} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'tokens':>7}")
    for p in phases:
        print(f"{p['phase']:10} {p['seconds']:8.2f} {p['balancedness']:12.3f} {p['itl_p50'] * 1e3:10.1f} "
              f"{p['itl_p99'] * 1e3:10.1f} {p['tokens']:7d}")
    print(f"\n{'move':5} {'planned before -> after':>24} {'copies fetched':>15} {'bytes moved':>12} "
          f"{'decision->switch s':>19}")
    for i, m in enumerate(moves, 1):
        fetched = sum(len(f) for f in m["fetched"].values())
        print(f"{i:<5} {m['balancedness_before']:11.3f} -> {m['balancedness_after']:.3f} {fetched:15d} "
              f"{m['bytes_moved']:12,d} {m['seconds_decision_to_switch']:19.3f}")
    for out, gap in scales:
        print(f"scale ep {out['ep'][0]} -> {out['ep'][1]} ({out['action']}): {out['seconds']['total']:.2f}s from the "
              f"call to the new grid serving, {out['requeued']} requests prefilled again, longest gap between two "
              f"tokens of a request {gap:.2f}s")
    print(f"\nrequests completed {clients.done}, failed {clients.failed}; median ITL over all phases "
          f"{statistics.median(clients.itl(0, float('inf'))) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
