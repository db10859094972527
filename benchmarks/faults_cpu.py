"""Fault tolerance on the tiny config (pp=1, ep=4, CPU): MTTR of a killed worker, of a lost node (a second raylet on
this machine, every process of it SIGKILLed between steps) and of a silent node (that raylet and its workers
SIGSTOPped), split into their phases, rollback time after a NaN blow-up, snapshot overhead per step, and a hung
collective's detection time.

    python benchmarks/faults_cpu.py [--steps 14] [--only worker,node,silent] [--repeat 3] [--spares 1]
                                    [--snapshot-every 5|auto] [--pp 2]

--repeat runs each MTTR drill that many times (a fresh job, and a fresh second raylet, each) and prints the medians,
each run's figure in brackets; --spares, --snapshot-every and --pp set fault_tolerance.spares, .snapshot_every and
parallel.pp (ep = 4 / pp) for the worker kill.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray

from k3ray.config import load_config
from k3ray.control.driver import running_job
from k3ray.control.ray_cluster import init_ray
from k3ray.control.local_nodes import (free_port, head_room, join_node, kill_node, silence_node, start_raylet,
                                       stop_node)


def run(overrides: dict, steps: int, before_step=None) -> tuple[list[float], list[dict], list[float]]:
    cfg = load_config("configs/tiny.yaml", {"train.eval_every": 0, "parallel.pp": 1, "parallel.ep": 4, **overrides})
    with running_job(cfg) as controller:
        times = []
        for s in range(steps):
            if before_step is not None:
                before_step(s)
            t0 = time.perf_counter()
            ray.get(controller.train_step.remote(s), timeout=600)
            times.append(time.perf_counter() - t0)
        incidents = ray.get(controller.get_incidents.remote())
        snaps = ray.get(controller.__ray_call__.remote(lambda self: list(self.snapshots.stall_seconds)))
        return times, incidents, snaps


def guard_check_us() -> float:
    from k3ray.config import GuardPolicy
    from k3ray.policies import guards

    report = {"loss": 2.0, "grad_norm": 0.5, "activations": {i: {"routed_maxabs": 3.0, "resid_maxabs": 5.0}
                                                             for i in range(93)}}
    state = guards.GuardState(accepted=50, loss_mean=2.0, loss_var=0.01, loss_max=6.0, grad_norm_mean=0.5)
    policy = GuardPolicy()
    t0 = time.perf_counter()
    for _ in range(1000):
        guards.check(report, state, policy)
    return (time.perf_counter() - t0) * 1e3  # us per call (1000 calls)


def mttr_split(times: list[float], incidents: list[dict], k: int) -> tuple[dict, dict[str, float]]:
    """(the worker_lost incident, MTTR and its phases in seconds) of one run that lost workers before step k. The
    MTTR runs from the start of step k to the report of the step the recovery finished in (a lost node's workers may
    still finish step k, so the loss is met a step later; "resumed step" then holds that step too)."""
    lost = next(i for i in incidents if i["kind"] == "worker_lost")
    mttr = sum(times[k:lost["replayed_steps"][1] + 1])
    return lost, {"MTTR": mttr, **lost["seconds"], "resumed step": mttr - sum(lost["seconds"].values()),
                  "(for scale: a step before the kill, median)": statistics.median(times[1:k])}


def mttr_rows(label: str, runs: list[tuple[dict, dict[str, float]]]) -> list[tuple[str, str]]:
    """The median of each phase over the runs, each run's figure in brackets when there are several."""
    lost = runs[0][0]
    first, until = lost["replayed_steps"]
    spares = f", {len(lost['spares_used'])} hot spares used" if lost.get("spares_used") else ""
    names = list(dict.fromkeys(name for _, split in runs for name in split))
    rows = []
    for name in names:
        values = [split.get(name, 0.0) for _, split in runs]
        figure = f"{statistics.median(values):.2f} s" + (
            f" ({', '.join(f'{v:.2f}' for v in values)})" if len(values) > 1 else "")
        if name == "MTTR":
            name = (f"MTTR: {label} -> first resumed step (ranks {lost['ranks']}, ep {lost['ep'][0]} -> "
                    f"{lost['ep'][1]}{spares}), median of {len(runs)}")
        elif name == "replay":
            name, figure = "  replay", figure + f" ({until - first} steps since the snapshot)"
        else:
            name = f"  {name}"
        rows.append((name, figure))
    return rows


def node_runs(how: str, steps: int, k: int, repeat: int) -> list[tuple[dict, dict[str, float]]]:
    """4 workers, 2 on a head of their own and 2 on a second raylet of this machine, which is lost before step k
    (how: "kill" its raylet, or "silence" it); a fresh second raylet for every run."""
    head = tempfile.mkdtemp(prefix="k3ray-bench-head-")
    port = free_port()
    runs = []
    try:
        start_raylet(head, "--head", "--port", str(port), "--num-cpus", "8", "--include-dashboard", "false")
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        for _ in range(repeat):
            node = tempfile.mkdtemp(prefix="k3ray-bench-node-")
            join_node(node, f"127.0.0.1:{port}", 2)
            lose = kill_node if how == "kill" else silence_node
            try:
                with head_room(2):  # 2 workers on the head, 2 on the node
                    times, incidents, _ = run({"fault_tolerance.snapshot_every": 5, "fault_tolerance.grow_back": False,
                                               "parallel.collective_timeout_s": 10}, steps,
                                              before_step=lambda s: s == k and lose(node))
                runs.append(mttr_split(times, incidents, k))
            finally:
                stop_node(node)
    finally:
        ray.shutdown()
        stop_node(head)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--only", default="plain,worker,nan,hang,node,silent")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each MTTR drill (medians)")
    ap.add_argument("--spares", type=int, default=0, help="fault_tolerance.spares for the worker kill")
    ap.add_argument("--snapshot-every", default=None,
                    help="fault_tolerance.snapshot_every for the worker kill (steps or auto; default: the config's)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages for the worker kill (ep = 4 / pp)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    k = 7
    rows = []
    init_ray(None, 8)

    if "plain" in only:
        plain, _, snaps = run({"fault_tolerance.snapshot_every": 5}, args.steps)
        step_s = statistics.median(plain[2:])
        snap_s = statistics.median(snaps)
        rows.append(("step time, no fault (median)", f"{step_s:.3f} s"))
        rows.append(("snapshot: training stalled while staging, median", f"{snap_s:.3f} s"))
        rows.append(("snapshot overhead per step, every 5 steps", f"{100 * snap_s / 5 / step_s:.1f} %"))
        rows.append(("snapshot overhead per step, every 20 steps", f"{100 * snap_s / 20 / step_s:.1f} %"))

    if "worker" in only:
        runs = []
        for _ in range(args.repeat):
            every = {} if args.snapshot_every is None else {"fault_tolerance.snapshot_every": args.snapshot_every}
            times, incidents, _ = run({**every, "parallel.pp": args.pp, "parallel.ep": 4 // args.pp,
                                       "fault_tolerance.spares": args.spares, "fault_tolerance.grow_back": False,
                                       "fault_tolerance.faults": [{"kind": "kill_worker", "step": k, "worker": 2}]},
                                      min(args.steps, k + 2))
            runs.append(mttr_split(times, incidents, k))
        rows += mttr_rows("worker killed", runs)

    if "nan" in only:
        times, incidents, _ = run({"fault_tolerance.snapshot_every": 5,
                                   "fault_tolerance.faults": [{"kind": "nan", "step": k, "layer": 1}]}, args.steps)
        blow = next(i for i in incidents if i["kind"] == "blowup")
        rows.append((f"rollback after NaN (rule {blow['rule']}): restore the snapshot",
                     f"{blow['restore_seconds']:.2f} s"))
        rows.append((f"  restore + replay of the {k - 5} steps since the snapshot", f"{blow['rollback_seconds']:.2f} s"))
        rows.append(("  step with the blow-up, end to end", f"{times[k]:.2f} s"))

    if "hang" in only:
        times, incidents, _ = run({"fault_tolerance.snapshot_every": 5, "fault_tolerance.grow_back": False,
                                   "parallel.collective_timeout_s": 5,
                                   "fault_tolerance.faults": [{"kind": "hang_collective", "step": k, "worker": 1}]},
                                  k + 2)
        rows.append(("hung collective (timeout 5 s): step end to end", f"{times[k]:.2f} s"))
    ray.shutdown()
    rows.append(("guard check per step (pure function on the merged report)", f"{guard_check_us():.1f} us"))

    if "node" in only:
        rows += mttr_rows("node lost (every process SIGKILLed)", node_runs("kill", k + 2, k, args.repeat))
    if "silent" in only:
        rows += mttr_rows("silent node (raylet and workers SIGSTOP)", node_runs("silence", k + 2, k, args.repeat))

    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
