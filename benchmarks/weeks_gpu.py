"""What a weeks-long job pays again and again, on one GPU machine: snapshot stalls and skips, and the first step of a
job cold against one that finds the kept kernel caches (k3ray.grid.kernel_cache).

Job 1 trains --steps steps through k3ray (Controller and Worker actors on a local Ray cluster; the config as `k3ray
train`'s pre-flight check would run it, e.g. the GPU filled with fewer, larger micro-batches) with a snapshot every
--snapshot-every steps: each step's driver-timed seconds, each snapshot's staging stall, the boundary steps' excess
over the median step, skipped snapshots, the one-line warnings the job gave, and the object store it used (sampled
every second: the most it held, and what it spilled to disk) against one snapshot's size. --kill-at STEP SIGKILLs world
rank 0's process from outside during that step: the job's incidents and its losses after it show the recovery. Job
2 is the same config started again (the caches job 1 filled): its first steps. Point K3RAY_KERNEL_CACHE at an empty
folder for a cold job 1.

    python benchmarks/weeks_gpu.py --config configs/gpu2.yaml --set parallel.ep=1 --steps 40 --snapshot-every 10
    python benchmarks/weeks_gpu.py ... --steps 100 --snapshot-every auto --kill-at 50 --warm-steps 0
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_gpu import RayProgram  # noqa: E402
from k3ray.config import load_config, parse_assignments  # noqa: E402
from k3ray.parallel.step import StepReport  # noqa: E402


class StoreSampler:
    """The object stores' use across the cluster, sampled every `every_s` seconds on a thread (Ray's memory summary):
    the most held in them at once and the most spilled to disk, in bytes."""

    def __init__(self, every_s: float = 1.0):
        import ray
        from ray._private.internal_api import memory_summary

        self.address = ray.get_runtime_context().gcs_address
        self.summary, self.every_s = memory_summary, every_s
        self.peak_used = self.peak_spilled = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                text = self.summary(address=self.address, stats_only=True)
            except Exception:  # noqa: BLE001 - a sample missed (the GCS busy): the next one counts
                continue
            used = re.search(r"Plasma memory usage (\d+) MiB", text)
            spilled = re.search(r"Spilled (\d+) MiB", text)
            self.peak_used = max(self.peak_used, int(used.group(1)) << 20 if used else 0)
            self.peak_spilled = max(self.peak_spilled, int(spilled.group(1)) << 20 if spilled else 0)

    def close(self) -> dict:
        self.stop.set()
        self.thread.join(timeout=10)
        return {"store_peak_bytes": self.peak_used, "spilled_peak_bytes": self.peak_spilled}


def kill_rank0_during(program, delay_s: float) -> threading.Timer:
    """SIGKILL world rank 0's worker process `delay_s` from now (the step about to run is under way then)."""
    pid = program.call(lambda self: self.grid.group.run_on([0], lambda worker: os.getpid())[0])
    timer = threading.Timer(delay_s, os.kill, (pid, signal.SIGKILL))
    timer.start()
    return timer


def run_steps(program, steps: int, kill_at: int | None = None) -> tuple[list[float], list[dict]]:
    """Driver-timed seconds and reports of steps 0..steps-1, each printed as it ends; rank 0's process killed during
    step `kill_at`."""
    times, reports = [], []
    for step in range(steps):
        if step == kill_at:
            kill_rank0_during(program, 0.5 * statistics.median(times[-5:]))
            print(f"step {step}: world rank 0's process SIGKILLed mid-step", flush=True)
        t0 = time.perf_counter()
        reports.append(program.step(step, ahead=step + 1 < steps))  # as `k3ray train` steps
        times.append(time.perf_counter() - t0)
        vio = StepReport(**{k: v for k, v in reports[-1].items() if k not in ("warnings", "worker_seconds")})
        print(f"step {step}: {times[-1]:.3f} s, loss {vio.loss:.4f}, MaxVio mean {vio.mean_maxvio:.3f}"
              + "".join(f"; warning: {w}" for w in reports[-1].get("warnings", [])), flush=True)
        if step == kill_at:  # the recovery's incident at once: a run cut short still shows where its seconds went
            lost = [i for i in program.call(lambda self: self.get_incidents()) if i["kind"] == "worker_lost"]
            print(f"step {step}: recovered: {lost[-1] if lost else 'no worker_lost incident'}", flush=True)
    return times, reports


def launched(cfg) -> RayProgram:
    t0 = time.perf_counter()
    program = RayProgram(cfg, preflight=True)  # the shape `k3ray train` would run
    shape = f"{program.cfg.parallel.micro_batches} micro-batches of {program.cfg.data.micro_batch_size} x {cfg.data.seq_len}"
    print(f"launched in {time.perf_counter() - t0:.1f} s ({shape}, recompute {program.cfg.execution.recompute})",
          flush=True)
    return program


def snapshot_job(cfg, steps: int, kill_at: int | None = None) -> dict:
    program = launched(cfg)
    store = StoreSampler()
    try:
        times, reports = run_steps(program, steps, kill_at)
        incidents = program.call(lambda self: self.get_incidents())
        snaps = program.call(lambda self: {
            "stall_s": list(self.snapshots.stall_seconds), "total_s": list(self.snapshots.total_seconds),
            "read_wait_s": list(self.snapshots.read_wait_seconds), "skipped": list(self.snapshots.skipped),
            "store_warmed": self.snapshots.warmed(), "taken": list(self.snapshots.taken),
            "worker_stage_s": list(self.snapshots.worker_stage_seconds),
            "every": self.cadence.interval, "one_at_a_time": self.snapshots.one_at_a_time,
            "abandoned": list(self.snapshots.abandoned),
            "bytes": self.snapshots.committed.nbytes or sum(p.nbytes for p in getattr(self.snapshots.pending, "refs",
                                                                                            ()))})
        snaps.update(store.close())
        maxvio = [StepReport(**{k: v for k, v in r.items() if k not in ("warnings", "worker_seconds")}).mean_maxvio
                  for r in reports]
        others = [t for s, t in enumerate(times) if s not in snaps["taken"] and s > 1]
        median = statistics.median(others) if others else float("nan")
        boundary = {s: times[s] - median for s in snaps["taken"]}
        job = {"step_seconds": times, "median_step_s": median, "boundary_excess_s": boundary, "snapshots": snaps,
               "warnings": [w for r in reports for w in r.get("warnings", [])], "incidents": incidents,
               "maxvio": maxvio, "losses": [r["loss"] for r in reports]}
        print_snapshots(job)  # before the job ends: its end may outlast the time a run was given
    finally:
        store.close()
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
    print(f"skipped: {snaps['skipped'] or 'none'}; abandoned: {snaps['abandoned'] or 'none'}; interval at the end: "
          f"{snaps['every']} steps; one at a time: {snaps['one_at_a_time']}; warnings: {j1['warnings'] or 'none'}")
    size = snaps["bytes"] or float("nan")
    print(f"object store: at most {snaps['store_peak_bytes'] / 2**30:.1f} GiB held ({snaps['store_peak_bytes'] / size:.2f}"
          f" x a snapshot), {snaps['spilled_peak_bytes'] / 2**30:.1f} GiB spilled to disk; median stall "
          f"{statistics.median(snaps['stall_s']) * 1e3 if snaps['stall_s'] else float('nan'):.1f} ms = "
          f"{statistics.median(snaps['stall_s']) / j1['median_step_s'] if snaps['stall_s'] else float('nan'):.2%} "
          f"of a step")
    for i in j1["incidents"]:
        print(f"incident {i['kind']} at step {i.get('step')}: {i.get('action', '')} {i.get('why', '')} replayed "
              f"{i.get('replayed_steps')} seconds {i.get('seconds')}")
    print("losses:", " ".join(f"{loss:.3f}" for loss in j1["losses"]), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/gpu2.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--snapshot-every", default="10", help="steps, or auto")
    ap.add_argument("--warm-steps", type=int, default=3, help="steps of job 2 (0: no job 2)")
    ap.add_argument("--kill-at", type=int, help="SIGKILL world rank 0's process during this step of job 1")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/weeks"))
    args = ap.parse_args()
    sets = parse_assignments(args.set)
    every = args.snapshot_every if args.snapshot_every == "auto" else int(args.snapshot_every)
    cfg = load_config(args.config, {**sets, "fault_tolerance.snapshot_every": every})
    out = {"job1": snapshot_job(cfg, args.steps, args.kill_at)}
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
