"""Tiny config on this machine: tokens/s of the single-process reference vs the Ray runtime (pp=2, ep=2), the
step-time breakdown, and seconds from `k3ray train` (process start, local Ray cluster included) to the first step.

    python benchmarks/runtime_cpu.py [--steps 12]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import ray

from k3ray.config import load_config
from k3ray.control.driver import running_job
from k3ray.control.ray_cluster import init_ray
from k3ray.parallel.reference import ReferenceTrainer


def median_tokens_per_s(times: list[float], tokens: int, warmup: int = 2) -> float:
    return tokens / statistics.median(times[warmup:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    over = {"train.eval_every": 0, "train.steps": args.steps}
    rows = []

    cfg = load_config("configs/tiny.yaml", {**over, "parallel.pp": 1, "parallel.ep": 2})
    ref = ReferenceTrainer(cfg)
    times = []
    for s in range(args.steps):
        t0 = time.perf_counter()
        r = ref.train_step(s, s)
        times.append(time.perf_counter() - t0)
    tokens = r.tokens
    rows.append(("single process (reference)", median_tokens_per_s(times, tokens), {}))

    cfg = load_config("configs/tiny.yaml", {**over, "parallel.pp": 2, "parallel.ep": 2})
    init_ray(None, cfg.parallel.world_size)
    times, phases = [], []
    with running_job(cfg) as controller:
        for s in range(args.steps):
            t0 = time.perf_counter()
            rep = ray.get(controller.train_step.remote(s, s))
            times.append(time.perf_counter() - t0)
            phases.append(rep["timings"])
    ray.shutdown()
    breakdown = {k: statistics.median(p[k] for p in phases[2:]) for k in phases[0]}
    rows.append(("Ray runtime pp=2 ep=2 (4 workers)", median_tokens_per_s(times, tokens), breakdown))

    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "k3ray", "train", "--config", "configs/tiny.yaml", "--steps", "1",
                          "--set", "train.eval_every=0", "--no-progress", "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    summary = json.loads(out.stdout.strip().splitlines()[-1])["summary"]

    print(f"{'mode':<36} {'tokens/s':>10}  step-time breakdown (median s)")
    for name, tps, br in rows:
        print(f"{name:<36} {tps:>10,.0f}  " + " ".join(f"{k}={v:.3f}" for k, v in br.items()))
    print(f"ratio distributed/single: {rows[1][1] / rows[0][1]:.2f}")
    print(f"`k3ray train` process start to end of first step (1-step run incl. local Ray start + teardown): "
          f"{wall:.1f} s; the step itself {summary['seconds']:.2f} s")


if __name__ == "__main__":
    main()
