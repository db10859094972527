"""The Worker actor: one per device, a thin remote API over the parts it owns, each holding one role's logic:

    seat       the place held in a grid: its generation, its StageEngine (stage p, expert shard e), process groups
               (k3ray.grid.worker_seat)
    training   the step, the evaluation, expert moves and trained copies, live settings (k3ray.grid.worker_training)
    state      snapshots, the neighbours' snapshot copies, restores, checkpoint parts (k3ray.grid.worker_state)
    serving    cache pools, serving iterations, read-only expert copies (k3ray.grid.worker_serving)

A worker starts on standby (its process up, torch and the model code imported, on GPU its CUDA context made, but for
a standby sharing a worker's device: k3ray.grid.standbys) and takes a place in a grid with `assume`: every grid worker
right after its start, a hot spare or a standby when it replaces a lost rank, a survivor when its grid is rebuilt
around spares.

Its remote API: `call` (every call a worker group makes by name, `assume`, `stand_by` and `leave_grid` among them:
`calls` says which part runs each), and two calls that Ray needs as methods of their own: `snapshot` (a streaming
call) and `serve_step` (bound into the serving iteration's compiled graph); `node_id` says a spare is up. Every
call but `node_id` names the grid generation it is meant for; one for an older generation is refused
(StaleGeneration, k3ray.grid.worker_seat).

Threaded: a snapshot's device-to-host copy runs beside the next training step, and further threads cover calls left
waiting in lost grids' collectives (until the worker leaves that grid, which ends them) after the worker joined
another."""
from __future__ import annotations

import functools
import inspect
import os
import time

import ray

from k3ray.config import JobConfig

# Calls a worker must absorb while still answering its current grid: losses that come close together each leave a
# call waiting in a lost grid's collective until the worker leaves that grid (or, if it never does, its timeout).
STUCK_CALLS = 4
THREADS = 2 + STUCK_CALLS  # the current grid's call, a snapshot or ping beside it, and the stuck ones
MOVES = ("assume", "stand_by")  # the calls that move a worker to the grid generation they name
# the calls that leave the engine's step ahead standing: the step itself, a snapshot's staging, which copies the
# state (the step ahead writes none of it) on a side stream, and the object store's warming (host memory only, on
# another thread: it may meet a step under way); any other may change what a step reads or writes
KEEP_STEP_AHEAD = ("train_step", "stage_snapshot", "warm_store")


def fenced(method):
    """A worker method whose first argument is the grid generation the call is meant for: refused (before it runs)
    when the worker has since joined a newer grid."""
    if inspect.isgeneratorfunction(method):  # Ray streams only what is a generator function itself
        @functools.wraps(method)
        def call(self, generation: int, *args):
            self.seat.check(generation, method.__name__)
            yield from method(self, *args)
    else:
        @functools.wraps(method)
        def call(self, generation: int, *args):
            self.seat.check(generation, method.__name__)
            return method(self, *args)
    del call.__wrapped__  # Ray reads the signature: it is (self, generation, *args), not the method's own
    return call


@ray.remote(max_concurrency=THREADS)
class Worker:
    def __init__(self, cfg_dict: dict, serving: bool = False, shared_devices: str | None = None):
        """serving: a serving grid's worker, which reads no training data. shared_devices: a standby's (it holds none
        of Ray's resources, k3ray.grid.standbys): the devices of the worker whose slot it shares, used once it takes
        that worker's place; its CUDA context is made then, not now (the device is that worker's until its process
        is gone)."""
        t_begun = time.time()  # the process is up and has loaded this class
        if shared_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = shared_devices  # before CUDA is initialised, which reads it
        # torch and the model code are imported here, not at the module's top: Ray sends this class by value and a
        # process loading it imports what its methods name, so whoever starts workers (the serving engine) does so
        # before importing torch itself, and each worker's imports are a phase of its start
        import torch

        from k3ray import data
        # the model code and the parts' modules (own_parts): their import is part of a standby worker's warm-up
        from k3ray.grid import worker_serving, worker_state, worker_training  # noqa: F401
        from k3ray.parallel import engine  # noqa: F401

        cfg = JobConfig.model_validate(cfg_dict)
        torch.set_num_threads(max(1, int(os.environ.get("K3RAY_THREADS_PER_WORKER", "1"))))
        device = "cuda" if cfg.parallel.device == "cuda" else "cpu"
        t_imported = time.time()
        if device == "cuda" and shared_devices is None:
            torch.zeros(1, device=device)  # the CUDA context, before a spare is needed
        t_context = time.time()
        if not serving:
            data.warm(cfg.data)  # cached: every engine of this worker reads it
        self.own_parts(cfg, device)
        # when each phase of this worker's start ended (WorkerGroup reports the slowest worker's of a launch)
        self.started = {"constructor": t_begun, "imports": t_imported, "cuda_context": t_context,
                        "ready": time.time()}

    def own_parts(self, cfg: JobConfig, device: str) -> None:
        """The parts, on standby, and the calls a worker group makes by name (WorkerGroup.call, call_each): each
        goes to the part whose method of that name runs it (the actor's own for the two that move it between
        grids)."""
        from k3ray.grid.worker_seat import WorkerSeat
        from k3ray.grid.worker_serving import WorkerServing
        from k3ray.grid.worker_state import WorkerState
        from k3ray.grid.worker_training import WorkerTraining

        self.seat = WorkerSeat(cfg, device)
        self.training = WorkerTraining(self.seat)
        self.state = WorkerState(self.seat)
        self.serving = WorkerServing(self.seat)
        self.calls = {name: getattr(part, name) for part, names in [
            (self, ("assume", "stand_by", "leave_grid", "started_at")),
            (self.seat, ("rendezvous_address", "setup")),
            (self.training, ("train_step", "evaluate", "export_shard", "set_placement", "set_trained_copies",
                             "set_policies", "set_lr_scale")),
            (self.state, ("stage_snapshot", "warm_store", "hold_peer_snapshot", "restore", "save_checkpoint",
                          "checkpoint_parts", "state")),
            (self.serving, ("serve_init", "serve_pages_that_fit", "expert_load", "stage_copies", "use_copies")),
        ] for name in names}

    def started_at(self) -> dict[str, float]:
        """When (epoch seconds) this worker's constructor began (its process up, this class loaded), and when its
        imports of torch and the model code, its CUDA context (GPU) and its parts (with the training data) were
        done."""
        return dict(self.started)

    def node_id(self) -> str:
        """The Ray node this worker runs on (its answer also says the worker is up)."""
        return ray.get_runtime_context().get_node_id()

    def assume(self, pp_rank: int, ep_rank: int, home: list[int], ep_size: int, init_weights: bool) -> str | None:
        """Take place (pp_rank, ep_rank) of the grid this call names, of ep_size EP ranks, leaving the grid held
        before (if any): a new engine, its weights initialised or (init_weights=False) left for the restore that
        follows. Returns the devices it uses (CUDA_VISIBLE_DEVICES, Ray's for its bundle; None on CPU): the standby
        beside it takes them."""
        self._leave()
        self.seat.take(pp_rank, ep_rank, home, ep_size, init_weights)
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    def stand_by(self) -> bool:
        """Leave the grid held (its process groups, its engine's memory, the neighbours' snapshot copies, the
        checkpoint parts it was writing: their checkpoint is abandoned) and wait on standby, refusing calls for
        generations before the one this call names."""
        self._leave()
        self.state.drop_peer_snapshots()
        return True

    def leave_grid(self) -> bool:
        """Leave the grid held now that it lost workers (before the next is built): its process groups' connections
        end, so a peer still waiting on this worker in one of them fails at once instead of at the collective
        timeout (k3ray.parallel.grid_groups)."""
        self._leave()
        return True

    def _leave(self) -> None:
        """Leave the grid held: the engine and its process groups, the cache pools, the parts being written."""
        self.seat.leave()
        self.serving.leave()
        self.state.forget_writes()

    def call(self, generation: int, name: str, *args):
        """The call `name` (a key of `calls`) for grid `generation`, with `args`: refused when the worker has since
        joined a newer grid (k3ray.grid.worker_seat), else run by the part that holds it; `assume` and `stand_by`
        join `generation` first."""
        if name in MOVES:
            self.seat.join_generation(generation, name)
        else:
            self.seat.check(generation, name)
        if name not in KEEP_STEP_AHEAD and self.seat.engine is not None:
            self.seat.engine.discard_ahead()
        return self.calls[name](*args)

    @ray.method(num_returns="streaming")
    @fenced
    def snapshot(self, step: int):
        """The staged state: its skeleton, then its chunks of bytes, each written into the object store (owned by
        the caller: the controller) before the next is read; runs on the second thread while the next step
        trains."""
        yield from self.state.snapshot_chunks(step)

    @fenced
    def serve_step(self, plan):
        """This worker's part of a serving iteration (k3ray.grid.worker_serving), as the compiled graph binds it."""
        return self.serving.serve_step(plan)
