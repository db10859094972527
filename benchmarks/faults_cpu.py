"""Fault tolerance on the tiny config (pp=1, ep=4, CPU): MTTR of a killed worker and of a lost node (a second raylet
on this machine whose raylet is SIGKILLed between steps) split into their phases, rollback time after a NaN blow-up,
snapshot overhead per step, and a hung collective's detection time.

    python benchmarks/faults_cpu.py [--steps 14] [--only worker,node] [--repeat 3] [--spares 1] [--snapshot-every 5]

--repeat runs the worker kill that many times (a fresh job each) and prints the medians, each run's figure in
brackets; --spares and --snapshot-every set fault_tolerance.spares and .snapshot_every for the worker kill.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

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


def mttr_split(times: list[float], incidents: list[dict], k: int) -> tuple[dict, dict[str, float]]:
    """(the worker_lost incident, MTTR and its phases in seconds) of one run that lost workers at step k."""
    lost = next(i for i in incidents if i["kind"] == "worker_lost")
    mttr = times[k]  # from the step's start (the worker is already dead) to the resumed step's report
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_raylet(temp_dir: str, *args: str) -> None:
    """`ray start` with ports of its own (other clusters may share this machine)."""
    ports = [f"--{name}={_free_port()}" for name in ("metrics-export-port", "dashboard-agent-listen-port",
                                                     "dashboard-agent-grpc-port", "runtime-env-agent-port")]
    subprocess.run([shutil.which("ray"), "start", "--temp-dir", temp_dir, "--node-ip-address", "127.0.0.1",
                    "--disable-usage-stats", *ports, *args], check=True, timeout=300, capture_output=True)


def _kill(temp_dir: str, only_raylet: bool) -> None:
    """SIGKILL the processes of the node living under temp_dir (only its raylet: a lost node)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if temp_dir.encode() in cmd and (not only_raylet or b"raylet" in cmd.split(b"\0")[0]):
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def node_loss(steps: int, k: int) -> list[tuple[str, str]]:
    """4 workers, 2 on a head of their own and 2 on a second raylet of this machine (`ray start`, own temp dirs);
    the second raylet is SIGKILLed before step k."""
    from ray.util.placement_group import placement_group, remove_placement_group

    head, node = tempfile.mkdtemp(prefix="k3ray-bench-head-"), tempfile.mkdtemp(prefix="k3ray-bench-node-")
    port = _free_port()
    try:
        _start_raylet(head, "--head", "--port", str(port), "--num-cpus", "8", "--include-dashboard", "false")
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        _start_raylet(node, "--address", f"127.0.0.1:{port}", "--num-cpus", "2")
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            time.sleep(0.5)
        blocker = placement_group([{"CPU": 6}], strategy="STRICT_PACK")  # 2 head CPUs left: 2 workers there
        ray.get(blocker.ready(), timeout=120)
        times, incidents, _ = run({"fault_tolerance.snapshot_every": 5, "fault_tolerance.grow_back": False}, steps,
                                  before_step=lambda s: s == k and _kill(node, only_raylet=True))
        remove_placement_group(blocker)
    finally:
        ray.shutdown()
        for d in (node, head):
            _kill(d, only_raylet=False)
    return mttr_rows("node lost (raylet SIGKILL)", [mttr_split(times, incidents, k)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--only", default="plain,worker,nan,hang,node")
    ap.add_argument("--repeat", type=int, default=1, help="worker kills to run (medians)")
    ap.add_argument("--spares", type=int, default=0, help="fault_tolerance.spares for the worker kill")
    ap.add_argument("--snapshot-every", type=int, default=5, help="fault_tolerance.snapshot_every, worker kill")
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
            times, incidents, _ = run({"fault_tolerance.snapshot_every": args.snapshot_every,
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
        rows += node_loss(k + 2, k)

    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
