"""The spare pool of a worker grid (`fault_tolerance.spares`): standby Worker actors, each holding its own resources,
that take lost ranks' places without a process start (k3ray.grid.worker_group: `WorkerGroup.regroup`).

The pool starts spares (in slots lost workers left on healthy nodes first, else in placement groups of their own),
tells which are up on alive nodes, gives up the dead ones, those on nodes found silent and those that never came up
(so that new ones are started elsewhere), hands ready ones to a regroup and takes survivors left out of a grid back
as spares. It holds no grid state: the group passes what it needs (the alive nodes, how to start a worker)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import ray
from ray.exceptions import RayError

# A spare that has not come up this long after its start never will (its node is silent, or it cannot be placed):
# it is given up, and another one is started where the alive nodes have room.
SPARE_START_TIMEOUT_S = 120.0


@dataclass
class Spare:
    """A standby Worker holding its own resources (`slot`: placement group, bundle index). `up` answers with its node
    once the worker's process is up (None when it came from a grid, already up)."""
    actor: object
    slot: tuple
    up: ray.ObjectRef | None
    node: str | None = None
    started: float = field(default_factory=time.monotonic)

    def keep(self, healthy: set[str]) -> bool:
        """Whether to keep it (its node learned once `up` has answered, without waiting): up on a `healthy` node, or
        still starting within SPARE_START_TIMEOUT_S; not dead, on another node, or never come up."""
        if self.node is None and ray.wait([self.up], timeout=0)[0]:
            try:
                self.node = ray.get(self.up)
            except RayError:
                self.node = ""  # died starting
        return self.node in healthy or (self.node is None
                                        and time.monotonic() - self.started < SPARE_START_TIMEOUT_S)


class SparePool:
    def __init__(self, want: int):
        self.want = want  # fault_tolerance.spares
        self.spares: list[Spare] = []
        self.free_slots: list[tuple] = []  # slots lost workers left on healthy nodes: new spares, grow

    def __len__(self) -> int:
        return len(self.spares)

    def __iter__(self) -> Iterator[Spare]:
        return iter(self.spares)

    def start(self, room: int, start_worker: Callable[[tuple], object], new_slot: Callable[[], tuple]) -> int:
        """Start spares up to `want`, without waiting for them: in free slots first, then in new one-worker slots
        (`new_slot`) while the alive nodes have `room`. Returns how many were started."""
        started = 0
        while len(self.spares) < self.want and (self.free_slots or room > 0):
            if self.free_slots:
                slot = self.free_slots.pop(0)
            else:
                slot, room = new_slot(), room - 1
            actor = start_worker(slot)
            self.spares.append(Spare(actor, slot, actor.node_id.remote()))
            started += 1
        return started

    def ready(self, healthy: set[str]) -> int:
        """How many spares are up on `healthy` nodes (alive and not silent; those still starting are not waited
        for). The dead, those on other nodes and those that never came up are killed and dropped."""
        kept = []
        for spare in self.spares:
            if spare.keep(healthy):
                kept.append(spare)
            else:
                ray.kill(spare.actor, no_restart=True)
                self.free(spare.slot, spare.node, healthy)
        self.spares = kept
        return sum(s.node is not None for s in self.spares)

    def free(self, slot: tuple, node: str | None, healthy: set[str]) -> None:
        """Keep a slot a worker left for a new spare, unless it is on a node that is not healthy (lost or silent):
        a spare started there never comes up; one is started in a new slot off those nodes instead."""
        if node and node in healthy:
            self.free_slots.append(slot)

    def take(self, n: int) -> list[Spare]:
        """Up to n spares that are up, taken out of the pool (the caller checked `up_count`)."""
        ready = [s for s in self.spares if s.node][:n]
        self.spares = [s for s in self.spares if s not in ready]
        return ready

    def take_free_slots(self, n: int) -> list[tuple]:
        """n of the slots lost workers left, taken out of the pool (for workers of a grown grid)."""
        taken, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return taken

    def up_count(self) -> int:
        return sum(1 for s in self.spares if s.node)

    def stand_by(self, survivors: list[tuple], ask: Callable[[object], ray.ObjectRef], healthy: set[str],
                 timeout_s: float) -> None:
        """Survivors left out of a grid, (actor, slot, node) each, told to stand by (`ask(actor)`: True once it
        refuses the old grid's calls): those that answer are spares already up; one that does not is killed and its
        slot freed."""
        answers = [ask(actor) for actor, _, _ in survivors]
        done, _ = ray.wait(answers, num_returns=len(answers), timeout=timeout_s)
        for (actor, slot, node), answer in zip(survivors, answers):
            try:
                ok = answer in done and ray.get(answer)
            except RayError:
                ok = False
            if ok:
                self.spares.append(Spare(actor, slot, None, node))
            else:
                ray.kill(actor, no_restart=True)
                self.free(slot, node, healthy)

    def clear(self) -> list:
        """Forget every spare and free slot; returns the spares' actors (for the caller to kill)."""
        actors = [s.actor for s in self.spares]
        self.spares, self.free_slots = [], []
        return actors
