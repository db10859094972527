"""The Worker actor: one per device, a thin holder of a StageEngine (pipeline stage p, expert shard e) and of its
snapshot buffers (k3ray.grid.snapshots).

A worker starts on standby (its process up, torch and the model code imported, on GPU its CUDA context made) and
takes a place in a grid with `assume`: every grid worker right after its start, a hot spare when it replaces a lost
rank, a survivor when its grid is rebuilt around spares.

Threaded: a snapshot's device-to-host copy runs beside the next training step, and further threads cover calls left
waiting in lost grids' collectives until their timeout (gloo cannot abort them) after the worker joined another.

Grid generations: every grid a worker joins has a number (`assume`, `stand_by`), and every call to a worker names
the generation it is meant for: a call for an older one (queued before a regroup, or a stale thread's) is refused
with StaleGeneration, and the engine of a left grid refuses its collectives (k3ray.parallel.engine.LeftGrid)."""
from __future__ import annotations

import functools
import os
import socket

import ray
import torch

from k3ray.config import JobConfig, PoliciesConfig
from k3ray.grid.snapshots import Packed, SnapshotStager, as_state
from k3ray.io.checkpoint import AsyncWriter, part_name


# Calls a worker must absorb while still answering its current grid: losses that come close together (inside one
# collective timeout) each leave a call waiting in a left grid's gloo collective until that timeout.
STUCK_CALLS = 4
THREADS = 2 + STUCK_CALLS  # the current grid's call, a snapshot or ping beside it, and the stuck ones


class StaleGeneration(RuntimeError):
    """A call meant for an older grid generation than the one the worker holds now."""


def fenced(method):
    """A worker method whose first argument is the grid generation the call is meant for: refused (before it runs)
    when the worker has since joined a newer grid."""
    @functools.wraps(method)
    def call(self, generation: int, *args):
        if generation < self.generation:
            raise StaleGeneration(f"{method.__name__} for grid generation {generation} refused: this worker holds "
                                  f"generation {self.generation}")
        return method(self, *args)
    del call.__wrapped__  # Ray reads the signature: it is (self, generation, *args), not the method's own
    return call


@ray.remote(max_concurrency=THREADS)
class Worker:
    def __init__(self, cfg_dict: dict):
        from k3ray import data
        from k3ray.parallel import engine  # noqa: F401 - here: the import is part of a standby worker's warm-up

        self.cfg = JobConfig.model_validate(cfg_dict)
        torch.set_num_threads(max(1, int(os.environ.get("K3RAY_THREADS_PER_WORKER", "1"))))
        self.device = "cuda" if self.cfg.parallel.device == "cuda" else "cpu"
        if self.device == "cuda":
            torch.zeros(1, device=self.device)  # the CUDA context, before a spare is needed
        data.warm(self.cfg.data)  # cached: every engine of this worker reads it
        self.engine = None  # StageEngine of the place this worker holds (None on standby)
        self.server = None  # serving: the StageServer beside the engine
        self.stager: SnapshotStager | None = None  # made on the first snapshot
        self.peer_snapshots: dict[int, tuple[int, Packed]] = {}  # world rank -> (step, its snapshot)
        self.writer: AsyncWriter | None = None  # made on first use
        self.generation = 0  # the newest grid generation this worker was told of (assume, stand_by)

    def node_id(self) -> str:
        """The Ray node this worker runs on (its answer also says the worker is up)."""
        return ray.get_runtime_context().get_node_id()

    def assume(self, generation: int, pp_rank: int, ep_rank: int, home: list[int], ep_size: int,
               init_weights: bool) -> bool:
        """Take place (pp_rank, ep_rank) of grid `generation`, of ep_size EP ranks, leaving the grid held before (if
        any): a new engine, its weights initialised or (init_weights=False) left for the restore that follows."""
        from k3ray.parallel.engine import StageEngine

        self.join_generation(generation)
        self._leave()
        self.engine = StageEngine(self.cfg, pp_rank, ep_rank, home, ep_size, self.device, init_weights)
        return True

    def join_generation(self, generation: int) -> bool:
        """From now on, refuse calls for generations older than `generation` (the first thing a grid's workers are
        told, before the calls that place them)."""
        if generation < self.generation:
            raise StaleGeneration(f"grid generation {generation} refused: this worker holds {self.generation}")
        self.generation = generation
        return True

    def stand_by(self, generation: int) -> bool:
        """Leave the grid held (its process groups, its engine's memory, the neighbours' snapshot copies, the
        checkpoint parts it was writing: their checkpoint is abandoned) and wait on standby, refusing calls for
        generations before `generation`."""
        self.join_generation(generation)
        self._leave()
        self.peer_snapshots = {}
        return True

    def _leave(self) -> None:
        """Leave the grid held. The neighbours' snapshot copies stay pinned: the restore that follows a regroup reads
        them (they may be the only copies of a lost node's parts); a newer snapshot replaces them."""
        if self.engine is not None:
            self.engine.leave_process_groups()
        self.engine = self.server = None
        if self.writer is not None:
            self.writer.forget()

    @fenced
    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port, for the process-group rendezvous (asked of world rank 0)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    @fenced
    def setup(self, init_method: str, backend: str) -> bool:
        if init_method.startswith("tcp://127.0.0.1"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.engine.init_process_groups(init_method, backend, self.generation)
        return True

    @fenced
    def train_step(self, step: int, batch_index: int) -> dict:
        return self.engine.train_step(step, batch_index)

    @fenced
    def evaluate(self) -> float:
        return self.engine.evaluate()

    @fenced
    def export_shard(self, expert_ids: list[int] | None = None) -> dict:
        return self.engine.export_shard(expert_ids)

    @fenced
    def set_placement(self, home: list[int], imports: dict | None = None) -> bool:
        self.engine.set_placement(home, imports)
        return True

    @fenced
    def set_trained_copies(self, table: list[list[int]]) -> int:
        """Hold copies of hot experts in spare slots from the next step on (k3ray.parallel.engine.StageEngine.
        set_trained_copies); the bytes fetched."""
        return self.engine.set_trained_copies(table)

    @fenced
    def set_policies(self, policies: dict) -> bool:
        self.engine.set_policies(PoliciesConfig.model_validate(policies))
        return True

    @fenced
    def set_lr_scale(self, scale: float) -> bool:
        self.engine.lr_scale = scale
        return True

    # -- snapshots -----------------------------------------------------------------------------------------------
    @fenced
    def stage_snapshot(self, step: int) -> int:
        """Copy the state to run `step` from aside (the short part, at the step boundary) and return its size in
        bytes. Dense state only from EP rank 0 of the stage: the other EP ranks hold identical copies, and restores
        read it from rank 0's."""
        self.stager = self.stager or SnapshotStager(self.engine.device)
        nbytes, still_reading = self.stager.stage(self.engine.state_tensors(dense=self.engine.ep_rank == 0), step)
        if still_reading is not None:
            self.engine.state_reads.append(still_reading)
        return nbytes

    @ray.method(num_returns=2)
    @fenced
    def snapshot(self, step: int) -> tuple[Packed, int]:
        """The staged state as host bytes, and their size (a small object to check for success without fetching
        the bytes); runs on the second thread while the next step trains. The bytes land in the object store,
        owned by the controller."""
        packed = self.stager.packed(step)
        return packed, packed.nbytes

    @fenced
    def hold_peer_snapshot(self, rank: int, step: int, packed: Packed) -> bool:
        """Keep a neighbour's snapshot mapped, so a copy of it lives on this node too (it survives the loss of the
        neighbour's node; on one node it is the same memory, no copy)."""
        self.peer_snapshots = {r: v for r, v in self.peer_snapshots.items() if v[0] == step}
        self.peer_snapshots[rank] = (step, packed)
        return True

    @fenced
    def restore(self, *states) -> bool:
        """Load the stage's state from the snapshots or checkpoint parts of every EP rank of an old grid of any EP
        size: dense state from the first (they are identical), the experts homed here from all of them."""
        states = [as_state(s) for s in states]
        self.engine.load_state(states[0], {layer: [s["experts"][layer] for s in states] for layer in states[0]["experts"]})
        return True

    # -- durable checkpoints --------------------------------------------------------------------------------------
    @fenced
    def save_checkpoint(self, root: str, step: int) -> bool:
        """Copy the state now (training may go on) and write it in the background as this rank's part. The dense
        state goes into EP rank 0's part only: every EP rank of a stage holds the same, and restores read rank 0's."""
        self.writer = self.writer or AsyncWriter()
        engine = self.engine
        self.writer.submit(root, step, part_name(engine.pp_rank * engine.ep + engine.ep_rank),
                           engine.state_dict(dense=engine.ep_rank == 0))
        return True

    @fenced
    def checkpoint_parts(self) -> list[dict]:
        """Wait for this worker's pending part writes; their PartInfos as dicts."""
        return [] if self.writer is None else [p.to_json() for p in self.writer.wait()]

    @fenced
    def state(self) -> dict:
        return self.engine.state_dict()

    # -- serving ---------------------------------------------------------------------------------------------------
    @fenced
    def serve_init(self, pages: int, page_size: int, slots: int, capture_graphs: bool = False) -> int:
        """Cache pools for serving beside the stage this worker holds (loaded by `restore`), and with
        `capture_graphs` every decode CUDA graph they can ask for (GPU); how many graphs were captured."""
        from k3ray.model.cache import new_pools
        from k3ray.parallel.serving import StageServer

        e = self.engine
        pools = new_pools(e.cfg.model, e.layers, pages, page_size, slots, e.device)
        rank = e.pp_rank * e.ep + e.ep_rank
        self.server = StageServer(e.stage, pools, e.device, rank - e.ep if e.pp_rank > 0 else None,
                                  rank + e.ep if e.pp_rank < e.pp - 1 else None, e.world)
        graphs = self.server.graphs
        return graphs.capture_all() if capture_graphs and graphs is not None else 0

    @fenced
    def serve_pages_that_fit(self, page_size: int, slots: int, fraction: float) -> int:
        """Latent pages of this worker's stage that `fraction` of its device's free memory holds beside `slots`
        sequences' state (k3ray.model.cache.pages_that_fit)."""
        from k3ray.model.cache import pages_that_fit

        e = self.engine
        free, _ = torch.cuda.mem_get_info(e.device)
        return pages_that_fit(e.cfg.model, e.layers, page_size, slots, fraction * free)

    @fenced
    def serve_step(self, plan):
        """This worker's part of a serving iteration: its rank's plan (k3ray.parallel.serving.RankPlan) in, a
        StageOutput out."""
        return self.server.step(plan)

    @fenced
    def expert_load(self) -> dict[int, list[int]]:
        return self.server.expert_load()

    @fenced
    def stage_copies(self, experts: list[int], *states) -> int:
        """Fetch read-only copies of `experts` from the held weights (object refs, resolved by Ray before this runs)
        beside the iterations; the bytes fetched."""
        return self.engine.stage_copies(experts, [as_state(s) for s in states])

    @fenced
    def use_copies(self, table: list[list[int]]) -> bool:
        """Switch to a copy table between two iterations (k3ray.parallel.engine.StageEngine.use_copies)."""
        self.engine.use_copies(table)
        return True
