"""The process groups of one grid generation that a stage engine holds: the world (pipeline sends and receives, the
loss and grad-norm reductions) and its stage's EP group (MoE all-to-alls, dense-gradient and balancing-statistics
all-reduces).

Every collective names one of these groups, never the default one: a worker that joins a new grid (a hot spare
taking a lost rank's place) may still have a thread waiting in the old grid's collective, which gloo cannot abort;
that thread must fail on the old groups rather than slip into the new grid's. `None` would name the default group,
which is the newest grid's: leaving never sets a group to None, it makes asking for one raise LeftGrid."""
from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from k3ray.parallel.gloo_sockets import GlooConnections


class LeftGrid(RuntimeError):
    """A collective asked of an engine whose grid was left: a stale thread of an older grid generation, which must
    fail rather than reach the grid the worker holds now."""


class LeftGroup:
    """What a left engine's EP context holds instead of its group: any use by a collective raises LeftGrid."""

    def __init__(self, generation: int):
        self.generation = generation

    def _refuse(self, *_):
        raise LeftGrid(f"grid generation {self.generation} was left: its collectives are refused")

    __bool__ = _refuse

    def __getattr__(self, name):
        self._refuse()


class NoGroups:
    """The groups of a one-worker grid that needs no collectives (serving on one worker: no exchange, no pipeline):
    none are built, and a collective that asks for one is refused naming why."""

    def __init__(self, generation: int):
        self.generation = generation

    def _refuse(self, *_):
        raise RuntimeError(f"grid generation {self.generation} is one worker without process groups: no collective "
                           f"may run in it")

    __bool__ = _refuse

    def __getattr__(self, name):
        self._refuse()


class GridGroups:
    def __init__(self):
        self.generation = 0  # the grid generation whose groups these are (set when joined)
        self._world = self._ep_group = None
        self.left = False  # the grid was left: its groups are gone, and asking for them raises LeftGrid
        self._connections = GlooConnections()  # the gloo groups' TCP pairs, ended on leaving

    def join(self, init_method: str, backend: str, generation: int, pp_rank: int, ep_rank: int, pp: int, ep: int,
             timeout_s: float) -> None:
        """Build grid `generation`'s groups, as world rank pp_rank * ep + ep_rank of pp x ep; init_method None (a
        one-worker grid that runs no collective): none are built (`NoGroups`), skipping the rendezvous and the
        backend's start (seconds for NCCL)."""
        self.generation = generation
        if init_method is None:
            self._world = self._ep_group = NoGroups(generation)
            return
        timeout = timedelta(seconds=timeout_s)
        gloo = backend == "gloo"  # NCCL's groups end their waits with their own abort (leave)
        if gloo:
            self._connections.listening()
        dist.init_process_group(backend, init_method=init_method, world_size=pp * ep, rank=pp_rank * ep + ep_rank,
                                timeout=timeout)
        self._world = dist.group.WORLD
        groups = [dist.new_group(list(range(p * ep, (p + 1) * ep)), timeout=timeout) for p in range(pp)]
        self._ep_group = groups[pp_rank]
        if gloo:
            self._connections.find(self._world, urlparse(init_method).port)

    def leave(self, cuda: bool) -> None:
        """Leave the groups (before the worker joins another grid), so that a peer (or a thread of this worker)
        waiting in one of their collectives fails at once instead of at the collective timeout. NCCL's are aborted.
        gloo's abort ends no wait, and a gloo group closes its connections only once freed, which whatever still
        holds it (a failed call's frames, the C++ side) can put off: its connections are shut down here instead
        (k3ray.parallel.gloo_sockets)."""
        if self._world is None or self.left:
            return
        self.left = True  # first: a thread asking for a group from now on gets LeftGrid
        self._world = self._ep_group = None
        if dist.is_initialized():
            if cuda:
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        self._connections.shut_down()

    def _held(self, group):
        if self.left:
            raise LeftGrid(f"grid generation {self.generation} was left: its collectives are refused")
        if group is None:
            raise LeftGrid("no process groups yet (setup has not run)")
        return group

    @property
    def world(self):
        """This grid generation's world group (LeftGrid once the grid was left; never None, the default group)."""
        return self._held(self._world)

    @property
    def ep_group(self):
        return self._held(self._ep_group)
