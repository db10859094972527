"""The goodput simulator against a real run: the tiny config on a local Ray cluster (CPU, pp=1 x ep=4) under an
injected failure process, its measured goodput next to what k3ray.goodput predicts for that small grid.

    python benchmarks/goodput_validate.py [--steps 24] [--faults 3] [--seed 1] [--out runs/goodput_validate]
                                          [--calibration FILE]

1. Calibration run: `--calibration-steps` steps, one worker killed mid-run; its incidents.jsonl, median step and
   snapshot stalls become a calibration file (OUT/calibration.json, k3ray.goodput.calibration);
   `--calibration FILE` takes an earlier one instead.
2. The failure process: every worker dies once in H hours (H chosen so that about `--faults` faults land in the
   run; the place is usable again at once, as after a software fault), sampled by the simulator's own sampler and
   placed on steps by the simulator's timeline; those steps become `fault_tolerance.faults` (kill_worker) drills.
   The first seed from `--seed` on whose draw puts at least 2 faults in the run is taken (printed).
3. Validation run: `--steps` steps with those faults; measured goodput = steps x median step / wall seconds.
4. The simulator on the same faults, calibrated by run 1 only: its goodput and its losses by phase; then with the
   validation run's own phase medians (what is left is how the simulator composes the phases).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import ray

from k3ray.config import load_config
from k3ray.control.driver import running_job
from k3ray.control.local_nodes import free_port, start_raylet, stop_node
from k3ray.goodput import calibration
from k3ray.goodput.costs import phase_costs, state_bytes
from k3ray.goodput.profiles import FailureClass, Profile
from k3ray.goodput.simulate import PHASES, Faults, Policy, sample_faults, simulate

SNAPSHOT_EVERY = 3


def job_config(out: Path, name: str, faults: list[dict]):
    return load_config("configs/tiny.yaml", {
        "name": name, "train.eval_every": 0, "parallel.pp": 1, "parallel.ep": 4, "checkpoint.every_n_steps": 0,
        "checkpoint.at_end": False, "checkpoint.dir": str(out / name / "checkpoints"), "api.enabled": False,
        "fault_tolerance.snapshot_every": SNAPSHOT_EVERY, "fault_tolerance.incidents_file":
        str(out / name / "incidents.jsonl"), "fault_tolerance.faults": faults})


def run(cfg, steps: int) -> tuple[list[float], float, list[float]]:
    """(each step's seconds, wall seconds of the steps, snapshot stalls)."""
    print(f"{cfg.name}: {steps} steps, faults {[(f.step, f.worker) for f in cfg.fault_tolerance.faults]}", flush=True)
    with running_job(cfg) as controller:
        times = []
        t0 = time.perf_counter()
        for s in range(steps):
            t1 = time.perf_counter()
            ray.get(controller.train_step.remote(s), timeout=900)
            times.append(time.perf_counter() - t1)
        wall = time.perf_counter() - t0
        stalls = ray.get(controller.__ray_call__.remote(lambda self: list(self.snapshots.stall_seconds)))
    return times, wall, stalls


def calibrate(cfg, steps: int, out: Path):
    """Run 1: (calibration, its measured figures, the median step) from a run with one worker killed at step 5."""
    times, _, stalls = run(cfg, steps)
    step_s = statistics.median(times[1:5] + times[7:])     # not the faulted step, nor the grow-back after it
    per_worker = state_bytes(cfg, calibration.Calibration()) / cfg.parallel.world_size
    calib, measured = calibration.from_incidents(
        calibration.read_incidents([str(out / "calibrate" / "incidents.jsonl")]), 1, per_worker, step_s,
        sources=("benchmarks/goodput_validate.py calibration run",))
    stall = statistics.median(stalls) if stalls else 1e-3
    calib = replace(calib, stall_gb_per_s=per_worker / 1e9 / max(stall, 1e-6))
    (out / "calibration.json").write_text(json.dumps({**calib.to_json(), "measured": measured}, indent=1) + "\n")
    return calib, measured, step_s


def faults_at_steps(costs, profile: Profile, policy: Policy, steps: list[int], workers: list[int]) -> Faults:
    """The faults placed in time so that each lands in the middle of its step on the simulator's timeline (the run's
    drills fire by step): fault i at the second the simulation, with faults 0..i-1, reaches step steps[i] + 0.5."""
    times: list[float] = []
    for k in steps:
        sofar = Faults(np.array(times), np.zeros(len(times), dtype=int), np.array(workers[:len(times)], dtype=int))
        times.append(simulate(costs, profile, policy, sofar, math.inf, steps=k + 0.5).seconds)
    return Faults(np.array(times), np.zeros(len(times), dtype=int), np.array(workers, dtype=int))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--calibration-steps", type=int, default=10)
    ap.add_argument("--faults", type=float, default=3.0, help="faults expected in the validation run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="runs/goodput_validate")
    ap.add_argument("--calibration", help="a calibration file of an earlier run: no calibration run")
    ap.add_argument("--from-result", action="store_true", help="with --calibration and the same flags: simulate the "
                                                               "validation run recorded in OUT again, no Ray")
    args = ap.parse_args()
    out = Path(args.out).absolute()
    if args.from_result:
        return validate(args, out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*/incidents.jsonl"):
        old.unlink()
    head, port = tempfile.mkdtemp(prefix="k3ray-goodput-"), free_port()  # a loopback cluster of its own
    try:
        start_raylet(head, "--head", "--port", str(port), "--num-cpus", "8", "--include-dashboard", "false")
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        validate(args, out)
    finally:
        ray.shutdown()
        stop_node(head)


def validate(args, out: Path) -> None:

    # 1. calibration
    cal_cfg = job_config(out, "calibrate", [{"kind": "kill_worker", "step": 5, "worker": 2}])
    if args.calibration:
        calib = calibration.load(args.calibration)
        measured = json.loads(Path(args.calibration).read_text()).get("measured", {})
        step_s = calib.step_s
    else:
        calib, measured, step_s = calibrate(cal_cfg, args.calibration_steps, out)

    # 2. the failure process, placed on steps by the simulator
    costs = phase_costs(cal_cfg, 4, calib)
    policy = Policy(SNAPSHOT_EVERY, 0, 0)
    one_fault = (costs.detect_s["crash"] + costs.relaunch_s + costs.restore_s + costs.warmup_s + costs.grow_back_s
                 + SNAPSHOT_EVERY * step_s * 2)                # a fault's cost as modelled, roughly
    horizon = args.steps * step_s + args.faults * one_fault    # the run's expected wall seconds
    hours = 4 * horizon / 3600 / args.faults                   # per-worker MTBF: `--faults` faults expected
    profile = Profile(f"mtbf {hours * 3600:.0f} s", (FailureClass("killed worker", 1 / hours, "gpu", "crash", False),),
                      repair_hours=0.0, gpus_per_node=1)
    for seed in range(args.seed, args.seed + 100):
        faults = sample_faults(profile, 4, 10 * horizon, seed)
        predicted = simulate(costs, profile, policy, faults, 10 * horizon, steps=args.steps)
        if len(predicted.fault_steps) >= 2:
            break
    drills, taken = [], set()
    for s, gpu in zip(predicted.fault_steps, faults.gpu.tolist()):
        s = max(s, 1)                                           # after the first step
        while s in taken:                                       # one fault per step
            s += 1
        taken.add(s)
        drills.append({"kind": "kill_worker", "step": s, "worker": gpu % 3})  # ranks 0-2 exist on a shrunk grid too

    # 3. the validation run
    if args.from_result:
        recorded = json.loads((out / "result.json").read_text())
        assert recorded["drills"] == drills, "the recorded run had other faults: give the same flags"
        times, wall = recorded["times"], recorded["wall"]
    else:
        times, wall, _ = run(job_config(out, "validate", drills), args.steps)
    median = statistics.median(times)
    measured_goodput = args.steps * median / wall
    incidents = calibration.read_incidents([str(out / "validate" / "incidents.jsonl")])
    kinds = [i["kind"] for i in incidents]

    # 4. the simulator on those faults (at the same steps), with the validation run's median step (the load drifts)
    costs = phase_costs(cal_cfg, 4, replace(calib, step_s=median))
    placed = faults_at_steps(costs, profile, policy, [d["step"] for d in drills], [d["worker"] for d in drills])
    sim = simulate(costs, profile, policy, placed, math.inf, steps=args.steps)
    # and with this run's own phase medians: what is left is the simulator's composition of the phases
    own, _ = calibration.from_incidents(incidents, 1, state_bytes(cal_cfg, calib) / 4, median, base=calib)
    own_costs = phase_costs(cal_cfg, 4, own)
    own_faults = faults_at_steps(own_costs, profile, policy, [d["step"] for d in drills], [d["worker"] for d in drills])
    sim_own = simulate(own_costs, profile, policy, own_faults, math.inf, steps=args.steps)
    rows = [(f"faults injected (steps; seed {seed}, MTBF a worker {hours * 3600:.0f} s)",
             ", ".join(str(d["step"]) for d in drills)),
            ("incidents", ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))),
            ("median step, calibration run / validation run", f"{step_s:.3f} s / {median:.3f} s"),
            ("wall seconds of the steps, measured / simulated", f"{wall:.1f} / {sim.seconds:.1f}"),
            ("goodput, measured", f"{100 * measured_goodput:.1f} %"),
            ("goodput, simulated (same faults, calibration run's phases)", f"{100 * sim.goodput:.1f} %"),
            ("difference", f"{100 * (sim.goodput - measured_goodput):+.1f} points"),
            ("goodput, simulated with this run's own phase medians (wall s)",
             f"{100 * sim_own.goodput:.1f} % ({sim_own.seconds:.1f} s), "
             f"{100 * (sim_own.goodput - measured_goodput):+.1f} points")]
    rows += [(f"  simulated loss: {k}", f"{100 * sim.losses[k]:.1f} %") for k in PHASES if sim.losses[k] > 0]
    rows += [(f"  calibration: {k}", f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in measured.items()]
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    (out / "result.json").write_text(json.dumps({"drills": drills, "times": times, "wall": wall,
                                                 "measured_goodput": measured_goodput, "simulated": sim.to_json(),
                                                 "simulated_own_phases": sim_own.to_json(),
                                                 "calibration": measured}, indent=1) + "\n")


if __name__ == "__main__":
    main()
