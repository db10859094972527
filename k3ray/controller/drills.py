"""Fault drills (`fault_tolerance.faults`, `k3ray drill`): faults injected from outside the training code.

The FaultInjector is a controller callback. A drill acts on the workers through the worker group only: it kills an
actor, or runs a function inside workers' processes that hooks their stage (a forward hook that turns a layer's
routed output into NaN, a forward pre-hook that never returns), or truncates a committed checkpoint part. Model,
engine and worker code know nothing about drills.
"""
from __future__ import annotations

import logging
import time

from k3ray.config import FaultSpec

log = logging.getLogger("k3ray.controller")


def _poison(worker, layer: int | None) -> None:
    """Inside a worker: the routed output of MoE layer `layer` (if this stage holds it) becomes NaN; None clears."""
    for handle in getattr(worker, "drill_hooks", []):
        handle.remove()
    worker.drill_hooks = []
    for i, moe in worker.engine.stage.moe_layers().items():
        if i == layer:
            worker.drill_hooks.append(moe.experts.register_forward_hook(lambda mod, args, out: out * float("nan")))


def _hang(worker) -> None:
    """Inside a worker: its next forward never returns, so its peers' collectives wait on it (a hung collective)."""
    worker.engine.stage.register_forward_pre_hook(lambda mod, args: time.sleep(10**6))


class FaultInjector:
    """Fires each configured drill once at its step: one per attempt, so a drill listed twice hits the retry too."""

    def __init__(self, faults: list[FaultSpec]):
        self.pending = list(enumerate(faults))
        self.fired: set[int] = set()
        self.poisoned = False  # a NaN drill is armed on the workers for the current attempt

    def before_attempt(self, group, step: int, settle) -> None:
        """Fire the next drill due during this step. `settle()` waits for the boundary's snapshot first, so that
        drills that hit during the step (kill, hang) have a reproducible outcome."""
        for i, fault in self.pending:
            if fault.step != step or i in self.fired or fault.kind == "corrupt_checkpoint" or fault.at != "step":
                continue  # corrupt_checkpoint: at commit; other kills: where `at` says
            self.fired.add(i)
            log.warning("fault drill: %s at step %d", fault.kind, step)
            if fault.kind in ("kill_worker", "hang_collective"):
                settle()
            if fault.kind == "kill_worker":
                self._kill(group, fault)
            elif fault.kind == "nan":
                group.run_on(list(range(group.size)), _poison, fault.layer or 0)
                self.poisoned = True
            elif fault.kind == "hang_collective":
                group.run_on([fault.worker or 0], _hang)
            return

    def kill_at(self, group, step: int, at: str) -> None:
        """Fire the kill_worker drills due at this point: `at` is "boundary" (of `step`), "after_step" (`step` done)
        or "relaunch" (a new grid just launched at the boundary of `step`)."""
        for i, fault in self.pending:
            due = fault.step <= step if at == "relaunch" else fault.step == step
            if fault.kind == "kill_worker" and fault.at == at and due and i not in self.fired:
                self.fired.add(i)
                log.warning("fault drill: kill_worker %s at step %d", at, step)
                self._kill(group, fault)

    @staticmethod
    def _kill(group, fault) -> None:
        for rank in fault.workers or [fault.worker or 0]:
            if rank < group.size:  # a smaller grid than the drill was written for has no such rank
                group.kill(rank)

    def after_attempt(self, group) -> None:
        if self.poisoned:
            self.poisoned = False
            group.run_on(list(range(group.size)), _poison, None)

    def on_checkpoint(self, step: int, path, parts: list, seconds: float) -> None:
        """Truncate the first part of the first checkpoint committed at or after a corrupt_checkpoint drill's step."""
        for i, fault in self.pending:
            if fault.kind == "corrupt_checkpoint" and fault.step <= step and i not in self.fired:
                self.fired.add(i)
                victim = path / parts[0].name
                victim.write_bytes(victim.read_bytes()[: parts[0].bytes // 2])
                log.warning("fault drill: truncated %s", victim)
