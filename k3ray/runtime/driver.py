"""`k3ray train` on Ray: join (--address / RAY_ADDRESS) or start a local cluster, start the job's Controller, run
the shared training loop through it, and always clean up (Ctrl-C included: workers killed, no orphans)."""
from __future__ import annotations

import os
import uuid

import ray

from k3ray.config import JobConfig
from k3ray.runtime.step import StepReport
from k3ray.trainer import run_training


def init_ray(address: str | None, min_cpus: int) -> bool:
    """Connect to a cluster or start a local one sized for the job. Returns whether this call started Ray."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    logs = os.environ.get("K3RAY_WORKER_LOGS") == "1"
    if address:
        ray.init(address=address, log_to_driver=logs)
    else:  # the embedded default: logical CPUs >= workers, so small machines still run every topology
        ray.init(num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False, log_to_driver=logs,
                 object_store_memory=_object_store_bytes())
    return True


def _object_store_bytes() -> int | None:
    """K3RAY_OBJECT_STORE_GB for a local cluster (snapshots live in the object store: GPU jobs need tens of GB)."""
    value = os.environ.get("K3RAY_OBJECT_STORE_GB")
    if not value:
        return None
    try:
        gb = float(value)
    except ValueError:
        gb = -1.0
    if gb <= 0:
        raise ValueError(f"K3RAY_OBJECT_STORE_GB={value!r}: expected a positive number of GiB")
    return int(gb * 2**30)


class ControllerBackend:
    """The Controller actor seen as a training backend (train_step/evaluate) for `run_training`."""

    def __init__(self, controller):
        self.controller = controller

    def train_step(self, step: int, batch_index: int) -> StepReport:
        return StepReport(**ray.get(self.controller.train_step.remote(step)))  # the controller owns data order

    def evaluate(self) -> float:
        return ray.get(self.controller.evaluate.remote())


def start_controller(cfg: JobConfig, resume: bool = False):
    from k3ray.actors.controller import Controller
    from k3ray.runtime.group import actor_runtime_env

    name = f"k3ray-{cfg.name}-{uuid.uuid4().hex[:8]}"
    controller = Controller.options(name=name, runtime_env=actor_runtime_env(cfg)).remote(cfg.model_dump())
    try:
        ray.get(controller.start.remote(resume=resume))
    except BaseException:
        ray.kill(controller, no_restart=True)  # a controller that could not start owns nothing worth a shutdown
        raise
    return controller


def stop_controller(controller, timeout_s: float = 600.0) -> None:
    """Graceful stop (the final durable checkpoint included: tens of GB on GPU configs), then kill regardless."""
    try:
        ray.get(controller.shutdown.remote(), timeout=timeout_s)
    finally:
        ray.kill(controller, no_restart=True)


def train_distributed(cfg: JobConfig, steps: int, address: str | None = None, progress: bool = True,
                      resume: bool = False, announce=None) -> dict:
    """Run the job to `steps`; `announce(status, cfg)` is called once the workers run (the CLI prints where the
    job writes and how to steer it)."""
    started = init_ray(address, cfg.parallel.world_size)
    controller = None
    try:
        controller = start_controller(cfg, resume=resume)
        status = ray.get(controller.status.remote())
        start = status["step"]
        if announce is not None:
            announce(status, cfg)
        if start >= steps:
            return {"steps": 0, "resumed_from": start, "final_loss": None, "losses": []}
        summary = run_training(ControllerBackend(controller), cfg, steps - start, start_step=start, progress=progress)
        status = ray.get(controller.status.remote())
        summary["incidents"] = ray.get(controller.get_incidents.remote())
        summary["topology"] = {"pp": status["pp"], "ep": status["ep"], "ep_configured": status["ep_configured"]}
        return {**summary, "resumed_from": start} if resume else summary
    finally:
        if controller is not None:
            stop_controller(controller)
        if started:
            ray.shutdown()
