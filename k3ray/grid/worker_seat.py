"""The place a Worker holds in a grid (k3ray.grid.worker owns one): the newest grid generation it was told of, and
the StageEngine of its place (pipeline stage p, expert shard e; None on standby), with the process-group setup.

Grid generations: every grid a worker joins has a number, and every call to a worker names the generation it is
meant for: a call for an older one (queued before a regroup, or a stale thread's) is refused with StaleGeneration
(`check`), and the engine of a left grid refuses its collectives (k3ray.parallel.grid_groups.LeftGrid)."""
from __future__ import annotations

import os
import socket

import ray

from k3ray.config import JobConfig


class StaleGeneration(RuntimeError):
    """A call meant for an older grid generation than the one the worker holds now."""


class WorkerSeat:
    def __init__(self, cfg: JobConfig, device: str):
        self.cfg, self.device = cfg, device
        self.generation = 0  # the newest grid generation this worker was told of
        self.engine = None  # StageEngine of the place this worker holds (None on standby)

    def check(self, generation: int, what: str) -> None:
        """StaleGeneration (before the call runs) when a call (`what`) for grid `generation` comes after this worker
        joined a newer grid."""
        if generation < self.generation:
            raise StaleGeneration(f"{what} for grid generation {generation} refused: this worker holds "
                                  f"generation {self.generation}")

    def join_generation(self, generation: int, what: str) -> None:
        """`check`, then refuse calls for generations older than `generation` from now on (what the calls that move
        a worker between grids do first: `assume`, before the calls that place it, and `stand_by`)."""
        self.check(generation, what)
        self.generation = generation

    def take(self, pp_rank: int, ep_rank: int, home: list[int], ep_size: int, init_weights: bool) -> None:
        """A new engine for place (pp_rank, ep_rank) of ep_size EP ranks, its weights initialised or
        (init_weights=False) left for the restore that follows."""
        from k3ray.parallel.engine import StageEngine

        self.engine = StageEngine(self.cfg, pp_rank, ep_rank, home, ep_size, self.device, init_weights)

    def leave(self) -> None:
        """Leave the place held: its engine's process groups, and the engine."""
        if self.engine is not None:
            self.engine.leave_process_groups()
        self.engine = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port, for the process-group rendezvous (asked of world rank 0)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(self, init_method: str | None, backend: str | None) -> bool:
        """Join the grid's process groups (this generation's; init_method None: a one-worker grid without any) and
        build the stage."""
        if init_method is not None and init_method.startswith("tcp://127.0.0.1"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.engine.init_process_groups(init_method, backend, self.generation)
        return True
