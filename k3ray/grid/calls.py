"""Every call to workers and its one failure path: `gather` turns a dead or hung worker, whatever the call, into
WorkerLost naming every lost rank (all of a lost node's at once), told apart from the survivors' collateral errors
(WorkerError when no worker is lost). The worker group (k3ray.grid.worker_group) sends every call through it."""
from __future__ import annotations

import time
from typing import Callable

import ray
from ray.exceptions import ObjectLostError, RayActorError, RayError, RayTaskError


def send(worker, generation: int, name: str, *args) -> ray.ObjectRef:
    """The worker's `call(generation, name, *args)` (k3ray.grid.worker), named in Ray's task table and timeline by
    the call it runs (Worker.train_step, ...)."""
    return worker.call.options(name=f"Worker.{name}").remote(generation, name, *args)


class WorkerError(RuntimeError):
    """A call failed inside workers that are alive (not a lost worker): the first failing rank's error, readable."""


class ObjectsLost(WorkerError):
    """A call failed inside live workers only because objects it read are gone (held on a node that was lost, say a
    snapshot's part before a neighbour's copy was made): the caller can read another source instead."""


def root_cause(err: BaseException) -> BaseException:
    """The error raised inside an actor, Ray's wrapping taken off."""
    cause = err
    while isinstance(cause, RayTaskError) and getattr(cause, "cause", None) is not None \
            and cause.cause is not cause:
        cause = cause.cause
    return cause


def cause_line(err: BaseException) -> str:
    """The error raised inside an actor, as one line (Ray's wrapping taken off; a cause that could not be sent
    back whole still carries its message in Ray's text)."""
    cause = root_cause(err)
    text = str(cause).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return f"{type(cause).__name__}: {lines[-1]}" if lines else type(cause).__name__


# After a worker is found dead its peers are not waited for long (they are pinged instead: a live one answers on its
# second thread): a survivor still in the call is usually blocked in a collective with the dead rank until
# parallel.collective_timeout_s, and one still computing leaves that call's engine when it joins the next grid (its
# collectives then refuse: k3ray.parallel.grid_groups.LeftGrid), so waiting would only delay the recovery.
AFTER_DEATH_GRACE_S = 0.5


class TopologyError(RuntimeError):
    """The cluster cannot hold the requested topology."""


class WorkerLost(RuntimeError):
    """Workers died or hung (in any call to them); `ranks` are their world ranks, every one found lost; `hung`: found
    by a timeout (some gave no answer) rather than by Ray reporting them dead."""

    def __init__(self, ranks: set[int], why: str, hung: bool = False):
        super().__init__(f"lost world ranks {sorted(ranks)}: {why}")
        self.ranks, self.why, self.hung = ranks, why, hung

    def __reduce__(self):  # raised on through Ray to the driver: unpickled with its own arguments, readable there
        return WorkerLost, (self.ranks, self.why, self.hung)


class WorkerSlow(RuntimeError):
    """Workers gave no answer to a call within its timeout but answer pings: alive and slow (a snapshot's bytes
    spilled to disk, say), not lost. Raised only for calls whose caller can do without their answer."""

    def __init__(self, ranks: set[int], why: str):
        super().__init__(f"slow world ranks {sorted(ranks)}: {why}")
        self.ranks = ranks


def gather(calls: list[tuple[int, ray.ObjectRef]], timeout_s: float | None, what: str,
           dead_ranks: Callable[..., set[int]], grace_s: float = 5.0, slow_is_lost: bool = True) -> list:
    """The one failure path of every call to workers: the results of (world rank, call) in order, or WorkerLost
    naming every dead or hung worker. A dead worker (RayActorError) is lost, together with every other worker a
    ping finds dead or whose node Ray reports lost (a lost node takes all of its ranks); the survivors are given
    AFTER_DEATH_GRACE_S (at most grace_s) to finish or fail first. A worker is hung when it gives no answer within
    timeout_s, or within grace_s after some peers have already failed (their collectives timed out waiting for
    it). Survivors' errors caused by a lost peer (RayTaskError) do not
    count as lost; errors with no worker lost are raised as WorkerError (the first failing rank's, readable).
    dead_ranks(exclude=...): the ranks found dead besides (the group's `dead_ranks`). slow_is_lost=False: workers
    that gave no answer within timeout_s but answer a ping are WorkerSlow, not WorkerLost (a step's or a
    collective's caller cannot tell a hung collective from a slow one: its workers answer pings too)."""
    index = {ref: i for i, (_, ref) in enumerate(calls)}
    results: dict[int, object] = {}
    errors: dict[int, Exception] = {}
    dead: set[int] = set()
    pending = [ref for _, ref in calls]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            break
        i = index[ready[0]]
        try:
            results[i] = ray.get(ready[0])
            continue
        except RayActorError as err:
            if err.actor_init_failed:  # its __init__ raised: an error to show, not a worker to replace
                errors[i] = err
            else:
                dead.add(calls[i][0])
        except RayTaskError as err:
            errors[i] = err
        wait = min(grace_s, AFTER_DEATH_GRACE_S) if dead else grace_s
        deadline = time.monotonic() + wait if deadline is None else min(deadline, time.monotonic() + wait)
    answered = {calls[j][0] for j in results} | {calls[j][0] for j in errors}
    if dead:
        first = next(iter(sorted(dead)))
        raise WorkerLost(dead | dead_ranks(exclude=answered | dead) | dead,
                         f"ActorDiedError in {what} (rank {first} first)")
    if pending:
        silent = {calls[index[f]][0] for f in pending}
        found_dead = dead_ranks(exclude=answered)
        if not slow_is_lost and not errors and not found_dead:
            raise WorkerSlow(silent, f"no answer to {what} within {timeout_s:g}s, but they answer pings")
        hung = silent | found_dead
        raise WorkerLost(hung, f"no answer to {what} within {timeout_s if not errors else grace_s:g}s "
                               f"(hung collective or silent node?)", hung=True)
    if errors:
        rank, err = min((calls[i][0], e) for i, e in errors.items())
        lost_objects = all(isinstance(root_cause(e), ObjectLostError) for e in errors.values())
        raise (ObjectsLost if lost_objects else WorkerError)(
            f"{what} failed on {len(errors)} of {len(calls)} workers (rank {rank}: {cause_line(err)})") from None
    return [results[i] for i in range(len(calls))]

def dead_ranks(workers: list, nodes: list[str], exclude: set[int] = frozenset(), timeout_s: float = 2.0) -> set[int]:
    """World ranks whose node Ray reports lost, or whose actor it reports dead or unreachable: each worker
    answers a ping on its second thread even mid-step, so a ping that fails names a lost worker; one that is
    merely slow does not."""
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    dead = {r for r, node in enumerate(nodes) if node not in alive and r not in exclude}
    pings = {w.__ray_ready__.remote(): r for r, w in enumerate(workers) if r not in exclude | dead}
    ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref)
        except RayError:
            dead.add(pings[ref])
    return dead
