"""Serving grids started from the checkpoint's weights (`GridLauncher`, owned by the ServingGrid): the weights are
put into the object store once, packed into one byte buffer (`k3ray.grid.snapshots.pack`: one copy in, none out),
and held for as long as the engine lives, so any grid started later (after a loss, any pp x ep) loads from them
without reading the checkpoint again; every grid started gets empty cache pools of the same size.

The weights are read by a Ray task (`hold_weights`, started by `k3ray serve` before the engine actor, else by the
engine) on the caller's node, whose result is the held object itself:
its reference exists at once, so the first grid's worker processes start (their imports, the CUDA context) while
the checkpoint is read, and each worker's restore waits for the object only when it runs (Ray resolves the
reference first)."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from k3ray.config import JobConfig
from k3ray.formats.release_folder import is_hf_folder
from k3ray.grid.worker_group import WorkerGroup
from k3ray.io import checkpoint as ckpt

if TYPE_CHECKING:
    from k3ray.formats.serving_weights import ServingWeights
    from k3ray.grid.snapshots import Packed

log = logging.getLogger("k3ray.serve")


@ray.remote(num_returns=2, max_retries=0)
def _read_and_pack(checkpoint: str) -> tuple[tuple[ServingWeights, dict], Packed]:
    # imported here, in the task's process: this module is the engine's before it imports torch (`start_workers`)
    from k3ray.formats.serving_weights import serving_weights
    from k3ray.grid.snapshots import pack

    t0, started = time.perf_counter(), time.time()
    weights = serving_weights(checkpoint)
    t_read = time.perf_counter()
    packed = pack(weights.state)
    seconds = {"read_weights": t_read - t0, "pack_weights": time.perf_counter() - t_read, "started": started}
    return (dataclasses.replace(weights, state={}), seconds), packed


def hold_weights(checkpoint: str) -> tuple[ray.ObjectRef, ray.ObjectRef]:
    """Start reading `checkpoint` (`serving_weights`) on this node: (reference to (the weights' path, step and job
    config without their state, the read's seconds), reference to the packed weights). The caller owns both: the
    weights are held while it keeps the second."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return _read_and_pack.options(num_cpus=0, scheduling_strategy=here).remote(checkpoint)


def serving_job_config(root: str) -> dict | None:
    """The job config of the newest committed step under a checkpoint root, its parts neither read nor verified: what
    `serving_weights(root)` returns but for a damaged newest step (workers start with it while the weights are read).
    None for a released folder (its config comes with its weights) and a root without a committed step."""
    if is_hf_folder(root):
        return None
    found = ckpt.owner(root)
    return None if found is None else found["config"]


def start_workers(cfg: JobConfig, ep: int, timeout_s: float) -> WorkerGroup:
    """The first grid's pp x ep workers (and its hot spares) placed and their processes started, not waited for:
    they import torch and the model code while the engine imports its own (`ServingGrid.launch(started=...)` joins
    them and gives them the experts' homes). Imports no torch."""
    group = WorkerGroup(cfg, ep, [], serving=True)
    group.start(timeout_s)
    return group


class GridLauncher:
    def __init__(self, cfg: JobConfig, weights, timeout_s: float = 300.0):
        """weights: the packed weights (a reference from `hold_weights`, which may still be being read)."""
        self.cfg, self.timeout_s = cfg, timeout_s  # cfg: the serving grid's (serve resolved for the device)
        self.weights = weights  # every worker of every grid reads its part of this object

    def sources(self) -> dict[int, list]:
        """stage -> the states its workers restore from: the held weights, for every stage."""
        return {p: [self.weights] for p in range(self.cfg.parallel.pp)}

    def start(self, group: WorkerGroup, wait_for_spares: bool = True, traffic: list | None = None
              ) -> dict[str, float]:
        """Launch `group`'s workers (and its hot spares) holding the weights, with empty cache pools (`traffic`:
        as `cache_pools`'). Returns the launch's phases in seconds, with the slowest started worker's own start
        (`worker_*`, parts of `place_and_start_workers`)."""
        group.launch(self.timeout_s, restore=self.sources(), wait_for_spares=wait_for_spares)
        return {**group.launch_seconds, **group.worker_start_seconds, **self.cache_pools(group, traffic)}

    def cache_pools(self, group: WorkerGroup, traffic: list | None = None) -> dict[str, float]:
        """Every worker's cache pools (and decode graphs); the first time on GPUs with serve.pages_per_rank unset,
        as many pages as every worker's free memory holds (serve.gpu_memory_fraction), the fewest any worker
        holds: every grid started later keeps that size. traffic: the decode shapes served so far, most used first
        (`DecodeTraffic.ranked`): a grid that replaces one captures the graphs they replay first, and only those;
        else the likeliest. Returns the seconds it took: `cache_pools` in all, of which `graph_capture` the
        slowest worker's CUDA graph captures (decode graphs within serve.graphs_at_start_s; without traffic, then
        prompt graphs' buckets within as long again), of which `first_graph` the longest first capture (a new
        process's kernels load in it)."""
        from k3ray.serve.prefix_cache import prefix_sizes

        t0, s = time.perf_counter(), self.cfg.serve
        prefix = prefix_sizes(s, self.cfg.model)
        checkpoints = 0 if prefix is None else prefix.checkpoints
        if s.pages_per_rank is None:
            fits = group.call("serve_pages_that_fit", s.page_size, s.slots_per_rank, s.gpu_memory_fraction,
                              checkpoints, timeout_s=self.timeout_s)
            self.cfg.serve = s = s.model_copy(update={"pages_per_rank": max(1, min(fits))})
            log.info("serving: %d KV pages of %d tokens per rank (free GPU memory)", min(fits), s.page_size)
        captures = group.call("serve_init", s.pages_per_rank, s.page_size, s.slots_per_rank, checkpoints,
                              s.graphs_at_start_s, traffic or None, timeout_s=self.timeout_s)
        return {"cache_pools": time.perf_counter() - t0,
                "graph_capture": max((c["seconds"] for c in captures), default=0.0),
                "first_graph": max((c["first"] for c in captures), default=0.0)}
