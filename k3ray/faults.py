"""The fault kinds k3ray can inject, in one registry, and what injects and clears them in a worker group.

`FAULT_KINDS` is the one list: the config (`fault_tolerance.faults[].kind`) and the CLI (`k3ray drill --kind`)
take its training kinds, and `inject` (what the training drills, k3ray.train.drills, and the serving engine's `drill`
call) refuses any kind it does not name. A kind is a training drill (a `fault_tolerance.faults` entry fired by the
controller at its step), a serving drill (injected into a serving grid now, `ServingEngine.drill`), or both.

`inject` acts on workers through the worker group only (duck-typed: `size`, `kill(rank)`, `run_on(ranks, fn, *args)`):
it kills actors, or runs a function inside workers' processes that hooks their stage (a forward hook that turns a
layer's routed output into NaN, a forward pre-hook that never returns). Model, engine and worker code know nothing
about faults. This module imports nothing of k3ray, so every layer can use it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultKind:
    name: str
    what: str
    training: bool  # a `fault_tolerance.faults` entry / `k3ray drill --kind`
    serving: bool  # injected into a serving grid (`ServingEngine.drill`)


FAULT_KINDS: dict[str, FaultKind] = {k.name: k for k in (
    FaultKind("kill_worker", "the actors of the given world ranks die", training=True, serving=True),
    FaultKind("nan", "the routed output of MoE layer `layer` (default 0) becomes NaN on every worker",
              training=True, serving=True),
    FaultKind("hang_collective", "the given ranks' next forward never returns: their peers' collectives wait",
              training=True, serving=True),
    FaultKind("corrupt_checkpoint", "the first checkpoint committed at or after the step loses half a part",
              training=True, serving=False),
    FaultKind("nan_token", "the embedding of byte `token` becomes NaN: the requests holding it blow up",
              training=False, serving=True),
    FaultKind("slow_copies", "each fetch of read-only expert copies takes `seconds` more", training=False,
              serving=True),
    FaultKind("slow_recovery", "each phase of the serving grid's recoveries from now on ends `seconds` later",
              training=False, serving=True),
)}
SNAPSHOT_PHASES = ("snapshot_stage", "snapshot_stream", "snapshot_commit", "snapshot_hold")
KILL_AT = ("step", "boundary", "after_step", "relaunch", *SNAPSHOT_PHASES)  # where a kill_worker drill lands
TRAINING_FAULTS: tuple[str, ...] = tuple(k.name for k in FAULT_KINDS.values() if k.training)
SERVING_FAULTS: tuple[str, ...] = tuple(k.name for k in FAULT_KINDS.values() if k.serving)


def _poison(worker, layer: int | None) -> None:
    """Inside a worker: the routed output of MoE layer `layer` (if this stage holds it) becomes NaN; None clears."""
    for handle in getattr(worker, "drill_hooks", []):
        handle.remove()
    worker.drill_hooks = []
    for i, moe in worker.seat.engine.stage.moe_layers().items():
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
    handle = poison_token(worker.seat.engine.stage, token)
    worker.drill_hooks = getattr(worker, "drill_hooks", []) + ([handle] if handle is not None else [])


def _hang(worker) -> None:
    """Inside a worker: its next forward never returns, so its peers' collectives wait on it (a hung collective)."""
    worker.seat.engine.stage.register_forward_pre_hook(lambda mod, args: time.sleep(10**6))


def _slow_copies(worker, seconds: float) -> None:
    """Inside a worker: each of its fetches of read-only expert copies (serving) first waits `seconds`, so a fault
    can land while copies are on their way."""
    copies = worker.seat.engine.copies
    fetch = copies.stage_read_only

    def slow(*args):
        time.sleep(seconds)
        return fetch(*args)

    copies.stage_read_only = slow


def _die_in(worker, phase: str) -> None:
    """Inside a worker: its process dies (SIGKILL) in the given phase of its next snapshot: entering the staging
    (snapshot_stage), after streaming the skeleton (snapshot_stream), after streaming every chunk, before the
    controller commits (snapshot_commit), or entering the mapping of a neighbour's copy (snapshot_hold)."""
    import os
    import signal

    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    state = worker.state
    if phase == "snapshot_stage":
        worker.calls["stage_snapshot"] = die
    elif phase == "snapshot_hold":
        worker.calls["hold_peer_snapshot"] = die
    else:
        chunks = state.snapshot_chunks

        def dying(step: int):
            stream = chunks(step)
            yield next(stream)
            if phase == "snapshot_commit":
                yield from stream
            die()

        state.snapshot_chunks = dying


def slow_recovery(grid, seconds: float) -> None:
    """The serving grid's recoveries and relaunches from now on (`grid.recover(lost, progress)`,
    `grid.relaunch(progress)`): each of their phases ends `seconds` later (their thread waits before it reports the
    phase), so that a recovery that progresses can outlast serve.unavailable_wait_s."""
    def slowed(rebuild):
        def call(*args):
            *first, progress = args

            def late(phase: str) -> None:
                time.sleep(seconds)
                progress(phase)
            return rebuild(*first, late)
        return call

    grid.recover, grid.relaunch = slowed(grid.recover), slowed(grid.relaunch)


def inject(group, kind: str, ranks: list[int], layer: int | None = None, token: int | None = None,
           seconds: float = 5.0, phase: str | None = None) -> None:
    """Fault `kind` (FAULT_KINDS, all but corrupt_checkpoint, which acts on a committed checkpoint) into the given
    world ranks of a worker group, now (kill_worker with a `phase` of SNAPSHOT_PHASES: armed now, dying there). nan
    and nan_token hold until `clear`. (slow_recovery acts on the serving grid, not its workers: `slow_recovery`.)"""
    if kind == "kill_worker" and phase is not None:
        group.run_on([r for r in ranks if r < group.size], _die_in, phase)
    elif kind == "kill_worker":
        for rank in ranks:
            if rank < group.size:  # a smaller grid than the drill was written for has no such rank
                group.kill(rank)
    elif kind == "nan":
        group.run_on(list(range(group.size)), _poison, layer or 0)
    elif kind == "nan_token":
        group.run_on(list(range(group.size)), _poison_token, token)
    elif kind == "hang_collective":
        group.run_on(ranks, _hang)
    elif kind == "slow_copies":
        group.run_on(ranks, _slow_copies, seconds)
    else:
        injectable = [k for k in FAULT_KINDS if k not in ("corrupt_checkpoint", "slow_recovery")]
        raise ValueError(f"drill kind: {kind!r} is not one of {', '.join(injectable)}")


def clear(group) -> None:
    """Remove the nan and nan_token drills' hooks from every worker."""
    group.run_on(list(range(group.size)), _poison, None)
