"""Fault tolerance on the tiny config (pp=1, ep=4, CPU): MTTR of a killed worker and of a lost node (a second raylet
on this machine whose raylet is SIGKILLed between steps) split into their phases, rollback time after a NaN blow-up,
snapshot overhead per step, and a hung collective's detection time.

    python benchmarks/faults_cpu.py [--steps 14] [--only worker,node]
"""
from __future__ import annotations

import argparse
import statistics
import time

import ray

from k3ray.config import load_config
from k3ray.control.driver import init_ray, start_controller, stop_controller


def run(overrides: dict, steps: int, before_step=None) -> tuple[list[float], list[dict], list[float]]:
    cfg = load_config("configs/tiny.yaml", {"train.eval_every": 0, "parallel.pp": 1, "parallel.ep": 4, **overrides})
    controller = start_controller(cfg)
    try:
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
    finally:
        stop_controller(controller)


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


def mttr_rows(label: str, times: list[float], incidents: list[dict], k: int) -> list[tuple[str, str]]:
    lost = next(i for i in incidents if i["kind"] == "worker_lost")
    phases = lost["seconds"]
    mttr = times[k]  # from the step's start (the worker is already dead) to the resumed step's report
    first, until = lost["replayed_steps"]
    rows = [(f"MTTR: {label} -> first resumed step (ranks {lost['ranks']}, ep {lost['ep'][0]} -> {lost['ep'][1]})",
             f"{mttr:.2f} s")]
    for name, value in phases.items():
        rows.append((f"  {name}", f"{value:.2f} s" + (f" ({until - first} steps since the snapshot)"
                                                     if name == "replay" else "")))
    rows.append(("  the resumed step itself", f"{mttr - sum(phases.values()):.2f} s"))
    return rows


def node_loss(steps: int, k: int) -> list[tuple[str, str]]:
    """4 workers, 2 on the head and 2 on a second raylet of this machine; its raylet SIGKILLed before step k."""
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, remove_placement_group

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8})
    ray.init(address=cluster.address, log_to_driver=False)
    node = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    blocker = placement_group([{"CPU": 6}], strategy="STRICT_PACK")  # 2 head CPUs left: 2 workers there
    ray.get(blocker.ready(), timeout=120)

    def kill(s: int) -> None:
        if s == k:
            cluster.remove_node(node, allow_graceful=False)  # SIGKILL: the raylet and its workers

    try:
        times, incidents, _ = run({"fault_tolerance.snapshot_every": 5, "fault_tolerance.grow_back": False}, steps,
                                  before_step=kill)
    finally:
        remove_placement_group(blocker)
        ray.shutdown()
        cluster.shutdown()
    return mttr_rows("node lost (raylet SIGKILL)", times, incidents, k)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--only", default="plain,worker,nan,hang,node")
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
        times, incidents, _ = run({"fault_tolerance.snapshot_every": 5, "fault_tolerance.grow_back": False,
                                   "fault_tolerance.faults": [{"kind": "kill_worker", "step": k, "worker": 2}]},
                                  args.steps)
        rows += mttr_rows("worker killed", times, incidents, k)

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
        rows += node_loss(k + 2, k)

    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
