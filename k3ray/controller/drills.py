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


def poison_token(stage, token: int):
    """The embedding of `token` becomes NaN in `stage` (if it is the first), so exactly the sequences holding that
    token blow up. Returns the hook's handle (None on other stages)."""
    if stage.embed is None:
        return None

    def hook(mod, args, out):
        return out.masked_fill((args[0] == token)[..., None], float("nan"))

    return stage.embed.register_forward_hook(hook)


def _poison_token(worker, token: int) -> None:
    handle = poison_token(worker.engine.stage, token)
    worker.drill_hooks = getattr(worker, "drill_hooks", []) + ([handle] if handle is not None else [])


def _hang(worker) -> None:
    """Inside a worker: its next forward never returns, so its peers' collectives wait on it (a hung collective)."""
    worker.engine.stage.register_forward_pre_hook(lambda mod, args: time.sleep(10**6))


def inject(group, kind: str, ranks: list[int], layer: int | None = None, token: int | None = None) -> None:
    """Fault `kind` into the given world ranks of a worker group, now: kill_worker (the actors die), nan (the routed
    output of MoE layer `layer`, default 0, becomes NaN on every worker, until `clear`), nan_token (the embedding of
    byte `token` becomes NaN, until `clear`: the requests holding it blow up, serving), hang_collective."""
    if kind == "kill_worker":
        for rank in ranks:
            if rank < group.size:  # a smaller grid than the drill was written for has no such rank
                group.kill(rank)
    elif kind == "nan":
        group.run_on(list(range(group.size)), _poison, layer or 0)
    elif kind == "nan_token":
        group.run_on(list(range(group.size)), _poison_token, token)
    elif kind == "hang_collective":
        group.run_on(ranks, _hang)
    else:
        raise ValueError(f"drill kind: {kind!r} is not one of kill_worker, nan, nan_token, hang_collective")


def clear(group) -> None:
    """Remove the nan and nan_token drills' hooks from every worker."""
    group.run_on(list(range(group.size)), _poison, None)


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
            inject(group, fault.kind, fault.workers or [fault.worker or 0], fault.layer)
            self.poisoned = fault.kind == "nan"
            return

    def kill_at(self, group, step: int, at: str) -> None:
        """Fire the kill_worker drills due at this point: `at` is "boundary" (of `step`), "after_step" (`step` done)
        or "relaunch" (a new grid just launched at the boundary of `step`)."""
        for i, fault in self.pending:
            due = fault.step <= step if at == "relaunch" else fault.step == step
            if fault.kind == "kill_worker" and fault.at == at and due and i not in self.fired:
                self.fired.add(i)
                log.warning("fault drill: kill_worker %s at step %d", at, step)
                inject(group, "kill_worker", fault.workers or [fault.worker or 0])

    def after_attempt(self, group) -> None:
        if self.poisoned:
            self.poisoned = False
            clear(group)

    def on_checkpoint(self, step: int, path, parts: list, seconds: float) -> None:
        """Truncate the first part of the first checkpoint committed at or after a corrupt_checkpoint drill's step."""
        for i, fault in self.pending:
            if fault.kind == "corrupt_checkpoint" and fault.step <= step and i not in self.fired:
                self.fired.add(i)
                victim = path / parts[0].name
                victim.write_bytes(victim.read_bytes()[: parts[0].bytes // 2])
                log.warning("fault drill: truncated %s", victim)
