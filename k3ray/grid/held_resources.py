"""What a worker group holds of the cluster (`HeldResources`): its Ray placement groups, a slot (placement group,
bundle index) per worker or spare, the hot spares started in slots of their own and the standbys sharing workers'
slots. It places slots (all of a grid's at once, or one per spare), starts Worker actors in them, says how many more workers the group can seat without
placing anything, and gives every placement group back when the group closes. The group (k3ray.grid.worker_group)
decides which worker takes which place; this part only holds the room."""
from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from k3ray.config import JobConfig
from k3ray.grid.alive_nodes import AliveNodes
from k3ray.grid.kernel_cache import kernel_cache_env
from k3ray.grid.spares import SparePool
from k3ray.grid.standbys import Standbys
from k3ray.grid.worker import Worker

# Ray starts actor processes at nice 15. In a GPU job the controller sits on every step's critical path and a
# worker's host thread feeds its GPU (launches, the per-layer count sync), so they run at normal priority: nice 15
# cost 2 % of the step on 2 H200s (benchmarks/RESULTS.md). Ray's own job supervisor does the same.
NORMAL_PRIORITY = {"env_vars": {"RAY_worker_niceness": "0"}}


def actor_runtime_env(cfg: JobConfig) -> dict | None:
    """The controller's and the workers' runtime env: for GPU jobs normal priority and the kept kernel caches
    (k3ray.grid.kernel_cache). CPU jobs keep Ray's default (and workers inherit the controller's env), so their
    compute leaves Ray's own processes the CPU on small hosts: at normal priority the CPU test suite ran 10 % slower
    on 2 cores."""
    if cfg.parallel.device != "cuda":
        return None
    return {"env_vars": {**NORMAL_PRIORITY["env_vars"], **kernel_cache_env()}}


def node_of(slot: tuple) -> str:
    """The Ray node a placement group's bundle (slot: placement group, bundle index) is on."""
    pg, index = slot
    return ray.util.placement_group_table(pg)["bundles_to_node_id"][index]


class HeldResources:
    """cfg: the job (the workers' config and runtime env); bundle: one worker's resources; alive_nodes: the room
    the alive nodes have; spares: the group's hot spare pool, started here; serving: the workers serve (they read
    no training data)."""

    def __init__(self, cfg: JobConfig, bundle: dict[str, float], alive_nodes: AliveNodes, spares: SparePool,
                 serving: bool = False):
        self.cfg, self.bundle, self.alive_nodes, self.spares = cfg, bundle, alive_nodes, spares
        self.serving = serving
        self.pgs: list = []  # every placement group holding the group's workers and spares
        self.standbys = Standbys()  # a standby process per worker's slot, holding no resources (fault_tolerance)

    def place(self, n: int, timeout_s: float) -> list[tuple] | None:
        """n slots in one placement group packed on the alive nodes, once placed; None (the group given back) if it
        was not placed within timeout_s."""
        pg = placement_group([dict(self.bundle) for _ in range(n)], strategy="PACK",
                             bundle_label_selector=self.alive_nodes.label_selector(n))
        if not ray.wait([pg.ready()], timeout=timeout_s)[0]:
            remove_placement_group(pg)
            return None
        self.pgs.append(pg)
        return [(pg, i) for i in range(n)]

    def start_worker(self, slot: tuple):
        """A Worker actor started in `slot`, on standby."""
        pg, index = slot
        return Worker.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0), runtime_env=actor_runtime_env(self.cfg),
        ).remote(self.cfg.model_dump(), self.serving)

    def start_standby(self, slot: tuple, devices: str | None):
        """A standby Worker in `slot` beside the worker that holds it, holding none of Ray's resources: it uses
        `devices` (CUDA_VISIBLE_DEVICES of that worker; None on CPU) once it takes the place."""
        pg, index = slot
        return Worker.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            num_cpus=0, num_gpus=0, runtime_env=actor_runtime_env(self.cfg),
        ).remote(self.cfg.model_dump(), self.serving, devices)

    def start_spares(self) -> int:
        """Start standby workers up to `fault_tolerance.spares`, without waiting for them: in slots lost workers
        left first, then in one-worker placement groups of their own where the alive nodes have room (a spare is
        capacity held, never borrowed from the grid). Returns how many were started."""
        def new_slot() -> tuple:
            pg = placement_group([dict(self.bundle)], bundle_label_selector=self.alive_nodes.label_selector(1))
            self.pgs.append(pg)
            return pg, 0

        return self.spares.start(self.alive_nodes.capacity(free=True), self.start_worker, new_slot)

    def spares_ready(self) -> int:
        """How many spares are up on alive nodes (not waiting for those still starting); dead ones, those on silent
        nodes and those that never came up are given up (and new ones started after the step)."""
        return self.spares.ready(self.alive_nodes.healthy())

    def places_held(self) -> int:
        """Places for more workers already held: ready spares (survivors standing by among them) and slots lost
        workers left; a grow needs room on the alive nodes only for the rest."""
        return self.spares_ready() + len(self.spares.free_slots)

    def top_up_spares(self) -> int:
        """Start the hot spares the group lacks (none found room when it was launched, or some died on standby),
        where the alive nodes have room now; the dead ones are dropped first, their slots free for new ones. Returns
        how many were started."""
        if not self.spares.want:
            return 0
        self.spares_ready()
        if len(self.spares) >= self.spares.want:
            return 0
        return self.start_spares()

    def release(self) -> None:
        """Every placement group back to the cluster (the group's workers and spares are killed first)."""
        for pg in self.pgs:
            remove_placement_group(pg)
        self.pgs = []
