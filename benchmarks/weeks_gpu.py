"""What a weeks-long job pays again and again, on one GPU machine: snapshot stalls and skips, and the first step of a
job cold against one that finds the kept kernel caches (k3ray.grid.kernel_cache).

Job 1 trains --steps steps through k3ray (Controller and Worker actors on a local Ray cluster) with a snapshot every
--snapshot-every steps: each step's driver-timed seconds, each snapshot's staging stall, the boundary steps' excess
over the median step, skipped snapshots, the one-line warnings the job gave. Job 2 is the same config started again
(the caches job 1 filled): its first steps. Point K3RAY_KERNEL_CACHE at an empty folder for a cold job 1.

    python benchmarks/weeks_gpu.py --config configs/gpu2.yaml --set parallel.ep=1 --steps 40 --snapshot-every 10
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_gpu import RayProgram  # noqa: E402
from k3ray.config import load_config, parse_assignments  # noqa: E402
from k3ray.parallel.step import StepReport  # noqa: E402


def run_steps(program, steps: int) -> tuple[list[float], list[dict]]:
    """Driver-timed seconds and reports of steps 0..steps-1, each printed as it ends."""
    times, reports = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        reports.append(program.step(step))
        times.append(time.perf_counter() - t0)
        vio = StepReport(**{k: v for k, v in reports[-1].items() if k not in ("warnings", "worker_seconds")})
        print(f"step {step}: {times[-1]:.3f} s, loss {vio.loss:.4f}, MaxVio mean {vio.mean_maxvio:.3f}"
              + "".join(f"; warning: {w}" for w in reports[-1].get("warnings", [])), flush=True)
    return times, reports


def launched(cfg) -> RayProgram:
    t0 = time.perf_counter()
    program = RayProgram(cfg)
    print(f"launched in {time.perf_counter() - t0:.1f} s", flush=True)
    return program


def snapshot_job(cfg, steps: int) -> dict:
    program = launched(cfg)
    try:
        times, reports = run_steps(program, steps)
        snaps = program.call(lambda self: {
            "stall_s": list(self.snapshots.stall_seconds), "total_s": list(self.snapshots.total_seconds),
            "read_wait_s": list(self.snapshots.read_wait_seconds), "skipped": list(self.snapshots.skipped),
            "store_warmed": self.snapshots.warmed(), "taken": list(self.snapshots.taken),
            "worker_stage_s": list(self.snapshots.worker_stage_seconds),
            "every": self.cadence.interval,
            "bytes": self.snapshots.committed.nbytes if self.snapshots.committed is not None else 0})
        maxvio = [StepReport(**{k: v for k, v in r.items() if k not in ("warnings", "worker_seconds")}).mean_maxvio
                  for r in reports]
        others = [t for s, t in enumerate(times) if s not in snaps["taken"] and s > 1]
        median = statistics.median(others) if others else float("nan")
        boundary = {s: times[s] - median for s in snaps["taken"]}
        job = {"step_seconds": times, "median_step_s": median, "boundary_excess_s": boundary, "snapshots": snaps,
               "warnings": [w for r in reports for w in r.get("warnings", [])],
               "maxvio": maxvio, "losses": [r["loss"] for r in reports]}
        print_snapshots(job)  # before the job ends: its end may outlast the time a run was given
    finally:
        program.close()
    return job


def print_snapshots(j1: dict) -> None:
    snaps = j1["snapshots"]
    print(f"\nstate per snapshot {snaps['bytes'] / 2**30:.1f} GiB; median step {j1['median_step_s']:.3f} s; "
          f"store warmed before the first (GiB, slowest worker's s): {snaps['store_warmed']}")
    print("| snapshot | staging stall ms | of which the slowest worker's own staging ms | optimizer waited for live "
          "reads ms | boundary step excess ms | arrived after s |")
    print("|---|---|---|---|---|---|")
    for i, s in enumerate(snaps["taken"]):  # the first boundary takes none (the job's start point stands in)
        stall = snaps["stall_s"][i] * 1e3 if i < len(snaps["stall_s"]) else float("nan")
        total = snaps["total_s"][i] if i < len(snaps["total_s"]) else float("nan")
        waited = snaps["read_wait_s"][i] * 1e3 if i < len(snaps["read_wait_s"]) else float("nan")
        own = snaps["worker_stage_s"][i] * 1e3 if i < len(snaps["worker_stage_s"]) else float("nan")
        excess = j1["boundary_excess_s"].get(s)
        print(f"| step {s} | {stall:.1f} | {own:.1f} | {waited:.0f} | {'-' if excess is None else f'{excess * 1e3:.0f}'} | "
              f"{total:.2f} |")
    print(f"skipped: {snaps['skipped'] or 'none'}; interval at the end: {snaps['every']} steps; "
          f"warnings: {j1['warnings'] or 'none'}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/gpu2.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--snapshot-every", default="10", help="steps, or auto")
    ap.add_argument("--warm-steps", type=int, default=3, help="steps of job 2 (0: no job 2)")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/weeks"))
    args = ap.parse_args()
    sets = parse_assignments(args.set)
    every = args.snapshot_every if args.snapshot_every == "auto" else int(args.snapshot_every)
    cfg = load_config(args.config, {**sets, "fault_tolerance.snapshot_every": every})
    out = {"job1": snapshot_job(cfg, args.steps)}
    if args.warm_steps:
        program = launched(load_config(args.config, sets))
        try:
            times, _ = run_steps(program, args.warm_steps)
        finally:
            program.close()
        out["job2_step_seconds"] = times
    j1 = out["job1"]
    print(f"first step: job 1 {j1['step_seconds'][0]:.1f} s"
          + (f", job 2 (kept caches) {out['job2_step_seconds'][0]:.1f} s" if args.warm_steps else ""))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "weeks.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
