"""`k3ray train`: the training loop shared by both modes (progress bar, a log line per step, evaluation, a final
summary) over a backend, either the single-process reference or a job on Ray: join (--address / RAY_ADDRESS) or
start a local cluster, start the job's Controller with the control API and metrics as its callbacks, drive the loop
through it, and always clean up (Ctrl-C included: workers killed, no orphans)."""
from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import contextmanager
from typing import Iterator, Protocol

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm import tqdm

from k3ray.config import JobConfig
from k3ray.control import preflight
from k3ray.control.api import ApiCallback
from k3ray.control.ray_cluster import init_ray
from k3ray.control.metrics import MetricsCallback
from k3ray.train.controller import ControllerActor
from k3ray.grid.held_resources import actor_runtime_env
from k3ray.parallel.step import StepReport

log = logging.getLogger("k3ray")


class Backend(Protocol):
    def train_step(self, step: int, batch_index: int, ahead: bool = False) -> StepReport:
        """`ahead`: the next call is step + 1 (the backend may start it early)."""
    def evaluate(self) -> float: ...


def run_training(backend: Backend, cfg: JobConfig, steps: int | None = None, start_step: int = 0,
                 progress: bool = True, log_json: bool = False) -> dict:
    """Drive `steps` steps through a backend (reference trainer or the Ray controller) and summarise."""
    steps = cfg.train.steps if steps is None else steps
    history: list[StepReport] = []
    evals: dict[int, float] = {}
    t_start = time.perf_counter()
    if cfg.train.eval_every:
        evals[start_step] = backend.evaluate()
    bar = tqdm(range(start_step, start_step + steps), desc=cfg.name, disable=not progress, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        done = step + 1 - start_step
        evaluates = bool(cfg.train.eval_every) and (done % cfg.train.eval_every == 0 or done == steps)
        report = backend.train_step(step, step, ahead=done < steps and not evaluates)
        dt = time.perf_counter() - t0
        history.append(report)
        bar.set_postfix(loss=f"{report.loss:.3f}", tok_s=f"{report.tokens / dt:,.0f}", maxvio=f"{report.mean_maxvio:.3f}")
        if step % cfg.train.log_every == 0:
            line = {"step": step, "loss": round(report.loss, 5), "grad_norm": round(report.grad_norm, 4),
                    "lr": float(f"{report.lr:.4g}"), "tokens_per_s": round(report.tokens / dt, 1),
                    "maxvio": round(report.mean_maxvio, 4), **{k: round(v, 4) for k, v in report.timings.items()}}
            msg = json.dumps(line) if log_json else " ".join(f"{k}={v}" for k, v in line.items())
            (tqdm.write(msg) if progress else log.info(msg))
        if evaluates:
            evals[step + 1] = backend.evaluate()
    elapsed = time.perf_counter() - t_start
    tokens = sum(r.tokens for r in history)
    return {
        "steps": steps,
        "final_loss": history[-1].loss if history else None,
        "val_loss": evals,
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "final_maxvio": history[-1].mean_maxvio if history else None,
        "losses": [r.loss for r in history],
    }


class ControllerBackend:
    """The Controller actor seen as a training backend (train_step/evaluate) for `run_training`."""

    def __init__(self, controller):
        self.controller = controller

    def train_step(self, step: int, batch_index: int, ahead: bool = False) -> StepReport:
        report = ray.get(self.controller.train_step.remote(step, ahead=ahead))  # the controller owns data order
        _show_warnings(report.pop("warnings", []))
        return StepReport(**report)

    def evaluate(self) -> float:
        return ray.get(self.controller.evaluate.remote())


def _show_warnings(warnings: list[str]) -> None:
    """What the controller wants the user to see (checkpoint fallbacks, damaged or failed checkpoints), on the
    driver's console: a warning line each."""
    for message in warnings:
        log.warning("%s", message)


def start_controller(cfg: JobConfig, resume: bool = False, fresh: bool = False, resume_from: str | None = None):
    """The job's Controller actor, started (workers up, control API serving, metrics exported)."""
    name = f"k3ray-{cfg.name}-{uuid.uuid4().hex[:8]}"
    # on the driver's node, hard: a lost worker node must not take the job's controller (and its snapshots' owner)
    # with it, and a soft affinity lets the driver's raylet spill the actor to another node
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    controller = ControllerActor.options(name=name, runtime_env=actor_runtime_env(cfg),
                                         scheduling_strategy=here).remote(
        cfg.model_dump(), [ApiCallback(), MetricsCallback()])
    try:
        status = ray.get(controller.start.remote(resume=resume, fresh=fresh, resume_from=resume_from))
    except BaseException:
        ray.kill(controller, no_restart=True)  # a controller that could not start owns nothing worth a shutdown
        raise
    _show_warnings(status.get("warnings", []))
    return controller


def stop_controller(controller, timeout_s: float = 600.0) -> None:
    """Graceful stop (the final durable checkpoint included: tens of GB on GPU configs), then kill regardless."""
    try:
        ray.get(controller.shutdown.remote(), timeout=timeout_s)
    finally:
        ray.kill(controller, no_restart=True)


@contextmanager
def running_job(cfg: JobConfig, resume: bool = False, fresh: bool = False,
                resume_from: str | None = None) -> Iterator:
    """The job's Controller actor for the with-block (`start_controller`), stopped on the way out (`stop_controller`:
    the final checkpoint when the config asks for one)."""
    controller = start_controller(cfg, resume=resume, fresh=fresh, resume_from=resume_from)
    try:
        yield controller
    finally:
        stop_controller(controller)


def train_distributed(cfg: JobConfig, steps: int, address: str | None = None, progress: bool = True,
                      resume: bool = False, fresh: bool = False, resume_from: str | None = None,
                      announce=None) -> dict:
    """Run the job to `steps`, after the pre-flight device-memory check (k3ray.control.preflight: it may turn on
    recompute or split micro-batches, or refuse); `announce(status, cfg)` is called once the workers run (the CLI
    prints where the job writes and how to steer it)."""
    started = init_ray(address, cfg.parallel.world_size + cfg.fault_tolerance.spares)
    try:
        cfg = preflight.checked(cfg, preflight.device_bytes(cfg))  # before any worker builds its part of the model
        with running_job(cfg, resume=resume, fresh=fresh, resume_from=resume_from) as controller:
            status = ray.get(controller.status.remote())
            start = status["step"]
            if announce is not None:
                announce(status, cfg)
            if start >= steps:
                return {"steps": 0, "resumed_from": start, "final_loss": None, "losses": []}
            summary = run_training(ControllerBackend(controller), cfg, steps - start, start_step=start,
                                   progress=progress)
            status = ray.get(controller.status.remote())
            summary["incidents"] = ray.get(controller.get_incidents.remote())
            summary["topology"] = {"pp": status["pp"], "ep": status["ep"], "ep_configured": status["ep_configured"]}
            summary["snapshots"] = status["snapshots"]
            return {**summary, "resumed_from": start} if resume else summary
    finally:
        if started:
            ray.shutdown()
