"""Serving grids started from the checkpoint's weights (`GridLauncher`, owned by the ServingGrid): the weights are
put into the object store once, packed into one byte buffer (`k3ray.grid.snapshots.pack`: one copy in, none out),
and held for as long as the engine lives, so any grid started later (after a loss,
any pp x ep) loads from them without reading the checkpoint again; every grid started gets empty cache pools of
the same size."""
from __future__ import annotations

import logging
import time

import ray

from k3ray.config import JobConfig
from k3ray.grid.snapshots import pack
from k3ray.grid.worker_group import WorkerGroup

log = logging.getLogger("k3ray.serve")


class GridLauncher:
    def __init__(self, cfg: JobConfig, weights_state: dict, timeout_s: float = 300.0):
        self.cfg, self.timeout_s = cfg, timeout_s  # cfg: the serving grid's (serve resolved for the device)
        self.weights = ray.put(pack(weights_state))  # once: every worker of every grid reads its part of this object

    def sources(self) -> dict[int, list]:
        """stage -> the states its workers restore from: the held weights, for every stage."""
        return {p: [self.weights] for p in range(self.cfg.parallel.pp)}

    def start(self, group: WorkerGroup, wait_for_spares: bool = True) -> dict[str, float]:
        """Launch `group`'s workers (and its hot spares) holding the weights, with empty cache pools. Returns the
        launch's phases in seconds."""
        group.launch(self.timeout_s, restore=self.sources(), wait_for_spares=wait_for_spares)
        return {**group.launch_seconds, **self.cache_pools(group)}

    def cache_pools(self, group: WorkerGroup) -> dict[str, float]:
        """Every worker's cache pools (and decode graphs); the first time on GPUs with serve.pages_per_rank unset,
        as many pages as every worker's free memory holds (serve.gpu_memory_fraction), the fewest any worker
        holds: every grid started later keeps that size. Returns the seconds it took: `cache_pools` in all, of
        which `graph_capture` the slowest worker's decode graph captures (serve.graphs_at_start_s)."""
        t0, s = time.perf_counter(), self.cfg.serve
        if s.pages_per_rank is None:
            fits = group.call("serve_pages_that_fit", s.page_size, s.slots_per_rank, s.gpu_memory_fraction,
                              timeout_s=self.timeout_s)
            self.cfg.serve = s = s.model_copy(update={"pages_per_rank": max(1, min(fits))})
            log.info("serving: %d KV pages of %d tokens per rank (free GPU memory)", min(fits), s.page_size)
        captures = group.call("serve_init", s.pages_per_rank, s.page_size, s.slots_per_rank, s.graphs_at_start_s,
                              timeout_s=self.timeout_s)
        return {"cache_pools": time.perf_counter() - t0, "graph_capture": max(captures, default=0.0)}
