"""Standbys of a worker grid (`fault_tolerance.standbys`): a Worker process beside each grid worker, in the same
slot (placement group, bundle index) and on the same devices, holding none of Ray's resources. Its process is up and
has imported torch and the model code, but it makes no CUDA context while it waits: the device stays the worker's.
When that worker's process dies (its device memory goes with it), the standby takes its place in a regroup, so a lost
worker costs a restore, not a process start and its imports (9-12 s on an H200 host, most of a serving gap).

Unlike a hot spare (k3ray.grid.spares) a standby holds no capacity of its own and can take only its own slot's place:
a lost node takes its standbys with it. This part holds them by slot and says which are up; the group
(k3ray.grid.worker_group) starts them once its grid has joined and hands them to `regroup`."""
from __future__ import annotations

from typing import Callable

import ray

from k3ray.grid.spares import Spare


class Standbys:
    def __init__(self):
        self.by_slot: dict[tuple, Spare] = {}  # slot -> its standby (up answers with its node once it is up)

    def __len__(self) -> int:
        return len(self.by_slot)

    def __contains__(self, slot: tuple) -> bool:
        return slot in self.by_slot

    def start(self, slots: dict[tuple, str | None], start_standby: Callable[[tuple, str | None], object]) -> int:
        """A standby started (not waited for) in each of `slots` (slot -> the devices its worker uses) that has none.
        Returns how many were started."""
        started = 0
        for slot, devices in slots.items():
            if slot not in self.by_slot:
                actor = start_standby(slot, devices)
                self.by_slot[slot] = Spare(actor, slot, actor.node_id.remote())
                started += 1
        return started

    def ready(self, healthy: set[str]) -> set[tuple]:
        """The slots whose standby is up on a `healthy` node (those still starting are not waited for). The dead,
        those on other nodes and those that never came up are killed and dropped (started again with the grid's
        next change)."""
        for slot, standby in list(self.by_slot.items()):
            if not standby.keep(healthy):
                ray.kill(standby.actor, no_restart=True)
                del self.by_slot[slot]
        return {slot for slot, standby in self.by_slot.items() if standby.node in healthy}

    def up_count(self) -> int:
        """How many have come up (read only: dead ones are found and dropped by `ready`)."""
        standbys = list(self.by_slot.values())  # asked from other threads (status) while a recovery changes them
        refs = [s.up for s in standbys if s.node is None]
        up = sum(1 for s in standbys if s.node)
        return up + (len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else 0)

    def take(self, slot: tuple) -> Spare:
        """The standby of `slot`, taken out (it becomes that slot's worker)."""
        return self.by_slot.pop(slot)

    def clear(self) -> list:
        """Forget every standby; returns their actors (for the caller to kill)."""
        actors = [s.actor for s in self.by_slot.values()]
        self.by_slot = {}
        return actors
