"""WorkerGroup: the [pp][ep] grid of Worker actors of one topology; the only part of the controller that talks to
workers (the controller itself is Ray-free, and its tests drive it with a fake group of the same interface).

It launches the grid inside a placement group on alive nodes, builds the process groups (rendezvous on world rank 0),
grows and rebuilds it, and runs steps and any other call on its workers by name (`call`, `call_each`: the Worker's
`call`). Every call to workers goes through one failure path (k3ray.grid.calls): a dead or hung worker, whatever the
call, becomes WorkerLost naming every lost rank.

Its parts: `alive_nodes` (what the alive nodes hold, in workers: k3ray.grid.alive_nodes), `transfer` (in-memory
snapshots and restores: k3ray.grid.state_transfer), `spares`, the hot spares (`fault_tolerance.spares`: standby
workers started with the grid, each holding its own resources, which take lost ranks' places without a process
start in `regroup`; k3ray.grid.spares) and `resources`, what it holds of the cluster (placement groups, slots,
workers and spares started in them; new spares are started after a loss by `resources.start_spares`:
k3ray.grid.held_resources), with the standbys (`fault_tolerance.standbys`: a process beside each worker on its
device, holding no resources, started once the grid has joined, which takes its own worker's place in `regroup` when
that worker's process dies: k3ray.grid.standbys).
"""
from __future__ import annotations

import itertools
import logging
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from k3ray.config import JobConfig
from k3ray.grid import calls
from k3ray.grid.alive_nodes import AliveNodes
from k3ray.grid.calls import TopologyError
from k3ray.grid.held_resources import HeldResources, node_of
from k3ray.grid.spares import SparePool
from k3ray.grid.state_transfer import GridStateTransfer

log = logging.getLogger("k3ray.controller")

# Grid generations, one sequence per controller process: every grid (launched, or rebuilt around spares) takes the
# next number, and every call to its workers names it (k3ray.grid.worker: a worker refuses older ones).
_generations = itertools.count(1)


class WorkerGroup:
    def __init__(self, cfg: JobConfig, ep: int, home: list[int], avoid_nodes: frozenset[str] = frozenset(),
                 serving: bool = False):
        """avoid_nodes: nodes found silent, which Ray may still report alive: neither counted nor placed on.
        serving: a serving grid, whose workers read no training data, and which builds no process groups when it
        has one worker (it runs no collective, where training's reductions name them even alone)."""
        self.cfg, self.pp, self.ep, self.home = cfg, cfg.parallel.pp, ep, list(home)
        self.serving = serving
        bundle = {"CPU": 1} if cfg.parallel.device == "cpu" else {"CPU": 1, "GPU": 1}
        self.alive_nodes = AliveNodes(bundle, avoid_nodes)  # what the alive nodes hold, in workers
        self.workers: list = []  # world rank -> actor
        self.slots: list[tuple] = []  # world rank -> (placement group, bundle index) it holds
        self.nodes: list[str] = []  # world rank -> Ray node id
        self.transfer = GridStateTransfer(self)  # snapshots and restores of this group's workers
        self.spares = SparePool(cfg.fault_tolerance.spares)  # hot spares: standby workers, own resources
        self.resources = HeldResources(cfg, bundle, self.alive_nodes, self.spares, serving)  # placement groups, slots
        self.launch_seconds: dict[str, float] = {}  # start workers (or swap in spares), process groups, restore
        # the slowest started worker's own start in phases, in the last launch (part of place_and_start_workers)
        self.worker_start_seconds: dict[str, float] = {}
        self.on_phase = None  # called with each of launch_seconds' phases as it ends (a serving recovery's progress)
        self.generation = 0  # this grid's generation (0: not joined yet); every call to its workers names it
        self.start_time = (0.0, 0.0)  # when `start` began placing the workers: perf_counter and epoch seconds
        ft = cfg.fault_tolerance
        self.standbys_on = ft.standbys if ft.standbys != "auto" else cfg.parallel.device == "cuda"
        self.devices: list[str | None] = []  # world rank -> the devices its worker uses (once the grid joined)

    @property
    def size(self) -> int:
        return self.pp * self.ep

    def grow(self, ep: int, home: list[int], restore: dict[int, list], timeout_s: float) -> None:
        """Grow this grid to `ep` EP ranks per stage in place: the added places are filled by ready spares first
        (among them survivors a shrink left standing by), then by workers started in slots lost workers left, then
        by workers placed anew, so a placement that fails (TopologyError) leaves the grid as it was; then every
        worker takes its place in the grown grid (the old ones keep their (p, e)), the process groups are rebuilt
        and the state restored (a loss meanwhile: WorkerLost naming ranks of the grown grid)."""
        t0 = time.perf_counter()
        added = self.pp * (ep - self.ep)
        res = self.resources
        from_spares = min(added, res.spares_ready())
        from_slots = min(added - from_spares, len(self.spares.free_slots))
        placed = added - from_spares - from_slots
        slots = res.place(placed, timeout_s) if placed else []
        if slots is None:
            raise TopologyError(f"could not place {placed} more workers within {timeout_s:g}s")
        slots = self.spares.take_free_slots(from_slots) + slots
        started = [(res.start_worker(slot), slot, node_of(slot)) for slot in slots]
        new = iter([(s.actor, s.slot, s.node) for s in self.spares.take(from_spares)] + started)
        old_ep, old = self.ep, list(zip(self.workers, self.slots, self.nodes))
        grid = [old[p * old_ep + e] if e < old_ep else next(new) for p in range(self.pp) for e in range(ep)]
        self.workers, self.slots, self.nodes = map(list, zip(*grid))
        self.ep, self.home = ep, list(home)
        self._join(timeout_s, restore, t0, "place_and_start_workers")

    def start(self, timeout_s: float) -> None:
        """Place the grid's workers and start their processes, and the spares beside them where the alive nodes have
        room, without waiting for them (`launch` joins them): a caller that starts them first does its own imports
        while theirs run (the serving engine)."""
        ok, why = self.alive_nodes.fits(self.size)
        if not ok:
            par = self.cfg.parallel
            raise TopologyError(f"parallel.pp={par.pp} x ep={self.ep}: {why}; lower pp/ep or add nodes")
        self.start_time = (time.perf_counter(), time.time())
        res = self.resources
        slots = res.place(self.size, timeout_s)
        if slots is None:
            self.close()
            raise TopologyError(f"could not place {self.size} workers ({res.bundle} each) within {timeout_s:g}s: "
                                f"resources are busy")
        self.slots = slots
        self.nodes = [node_of(slot) for slot in self.slots]
        self.workers = [res.start_worker(slot) for slot in self.slots]
        if res.start_spares() < self.cfg.fault_tolerance.spares:
            log.warning("%d of %d hot spares: the alive nodes have no room for more (tried again at step "
                        "boundaries)", len(self.spares), self.cfg.fault_tolerance.spares)

    def launch(self, timeout_s: float, restore: dict[int, list] | None = None, wait_for_spares: bool = True) -> str:
        """Place, create (unless `start` did) and connect the workers; restore[stage] = that stage's old states
        (`restore_sources`). The spares start beside them, where the alive nodes have room (waited for unless
        wait_for_spares=False)."""
        if not self.workers:
            self.start(timeout_s)
        t0, t0_wall = self.start_time
        backend = self._join(timeout_s, restore, t0, "place_and_start_workers")
        stamps = self.call_each("started_at", {r: () for r in range(self.size)}, timeout_s).values()
        self.worker_start_seconds = slowest_start(stamps, t0_wall)
        if wait_for_spares:
            ray.wait([s.up for s in self.spares], num_returns=len(self.spares), timeout=timeout_s)
        return backend

    def _join(self, timeout_s: float, restore: dict[int, list] | None, t0: float, first_phase: str) -> str:
        """Every worker takes its place (p, e) of this grid, the process groups are built (rendezvous on world rank
        0) and the state restored; the phases' seconds go to launch_seconds (the first one counted from t0)."""
        self.generation = next(_generations)  # calls queued for the grid before this one are refused from now on
        phase_ended = self.on_phase or (lambda phase: None)
        devices = self.call_each("assume", {r: (r // self.ep, r % self.ep, self.home, self.ep, restore is None)
                                            for r in range(self.size)}, timeout_s)
        self.devices = [devices[r] for r in range(self.size)]
        par = self.cfg.parallel
        backend = par.backend if par.backend != "auto" else ("nccl" if par.device == "cuda" else "gloo")
        if self.size == 1 and self.serving:
            t1 = time.perf_counter()
            phase_ended(first_phase)
            self.call("setup", None, None, timeout_s=timeout_s)
        else:
            ip, port = self.call_each("rendezvous_address", {0: ()}, timeout_s)[0]
            t1 = time.perf_counter()
            phase_ended(first_phase)
            if ip == ray.util.get_node_ip_address() and len([n for n in ray.nodes() if n["Alive"]]) == 1:
                ip = "127.0.0.1"
            self.call("setup", f"tcp://{ip}:{port}", backend, timeout_s=timeout_s)
        t2 = time.perf_counter()
        phase_ended("process_groups")
        if restore is not None:
            self.transfer.restore(restore, timeout_s)
        self.launch_seconds = {first_phase: t1 - t0, "process_groups": t2 - t1, "restore": time.perf_counter() - t2}
        phase_ended("restore")
        return backend

    def start_standbys(self) -> int:
        """A standby (not waited for) beside every worker of the joined grid whose slot has none, on the devices
        that worker uses; called once the grid serves or trains, so that their imports do not slow its start.
        Returns how many were started."""
        standbys = self.resources.standbys
        missing = [r for r in range(len(self.devices)) if self.slots[r] not in standbys] if self.standbys_on else []
        if not missing:
            return 0
        if self.cfg.parallel.device == "cuda" and any(self.devices[r] is None for r in missing):
            log.warning("no standbys: a worker's CUDA_VISIBLE_DEVICES is not set (Ray sets it for its GPU)")
            self.standbys_on = False
            return 0
        return standbys.start({self.slots[r]: self.devices[r] for r in missing}, self.resources.start_standby)

    def standing_by(self, ranks: set[int]) -> frozenset[int]:
        """The ranks among `ranks` whose slot's standby is up on a healthy node (they can take their own places)."""
        if not len(self.resources.standbys):
            return frozenset()
        up = self.resources.standbys.ready(self.alive_nodes.healthy())
        return frozenset(r for r in ranks if self.slots[r] in up)

    def regroup(self, lost: set[int], ep: int, home: list[int], keep: list[int], spare_for: set[int],
                restore: dict[int, list], timeout_s: float) -> None:
        """Rebuild this grid in place, no process started: the lost workers are killed (their slots kept for new
        workers), each world rank in spare_for is taken by its own standby where that is up, else by a ready hot
        spare, and the new grid of `ep` EP ranks per stage is made of the old EP columns `keep` (in its EP-rank
        order, experts homed by `home`); survivors of columns left out stand by as spares. Then every worker takes
        its place, the process groups are rebuilt and the state restored (a loss meanwhile: WorkerLost naming ranks
        of the new grid)."""
        t0 = time.perf_counter()
        by_standby = self.standing_by(spare_for)
        by_spare = sorted(set(spare_for) - by_standby)
        if self.spares.up_count() < len(by_spare):  # never fill a lost rank's place with the lost worker itself
            raise TopologyError(f"{len(by_spare)} lost ranks to fill but {self.spares.up_count()} spares ready")
        healthy = self.alive_nodes.healthy()
        for r in lost:
            if r in by_standby:  # its standby makes a CUDA context on this device: the lost process must be gone
                self.kill(r)
            else:
                ray.kill(self.workers[r], no_restart=True)
                self.spares.free(self.slots[r], self.nodes[r], healthy)
        taken = {r: self.resources.standbys.take(self.slots[r]) for r in by_standby}
        taken.update(zip(by_spare, self.spares.take(len(by_spare))))
        old_ep, old = self.ep, list(zip(self.workers, self.slots, self.nodes))
        members = [p * old_ep + c for p in range(self.pp) for c in keep]
        grid = [(taken[o].actor, taken[o].slot, taken[o].node) if o in taken else old[o] for o in members]
        self.workers, self.slots, self.nodes = map(list, zip(*grid))
        self.ep, self.home = ep, list(home)
        standing_by = [(actor, slot, node) for o, (actor, slot, node) in enumerate(old)
                       if o not in lost and o not in members]
        try:
            self._join(timeout_s, restore, t0, "swap_in_spares" if spare_for else "regroup_survivors")
        finally:  # a worker lost while they take their places: the survivors left out are spares for the next try
            self.spares.stand_by(standing_by, lambda actor: calls.send(actor, self.generation, "stand_by"),
                                 healthy, timeout_s)

    def call(self, method: str, *args, timeout_s: float | None = 120.0) -> list:
        """Every worker's `method(*args)`, in world-rank order."""
        return calls.gather([(r, calls.send(w, self.generation, method, *args)) for r, w in enumerate(self.workers)],
                            timeout_s, method, self.dead_ranks)

    def call_each(self, method: str, args: dict[int, tuple], timeout_s: float | None = 120.0) -> dict[int, object]:
        """`method(*args[r])` on world rank r, for the ranks in `args`."""
        ranks = list(args)
        out = calls.gather([(r, calls.send(self.workers[r], self.generation, method, *args[r])) for r in ranks],
                           timeout_s, method, self.dead_ranks)
        return dict(zip(ranks, out))

    def run_on(self, ranks: list[int], fn, *args) -> list:
        """`fn(worker, *args)` inside the given workers' processes (fault drills)."""
        return calls.gather([(r, self.workers[r].__ray_call__.remote(fn, *args)) for r in ranks], 120.0, "drill",
                            self.dead_ranks)

    def dead_ranks(self, exclude: set[int] = frozenset(), timeout_s: float = 2.0) -> set[int]:
        """World ranks found lost (`calls.dead_ranks`) but those in `exclude`."""
        return calls.dead_ranks(self.workers, self.nodes, exclude, timeout_s)

    def kill(self, rank: int, wait_s: float = 30.0) -> None:
        """Kill the worker of `rank` and return once it is dead: ray.kill only asks Ray to, and a call sent before
        the kill lands would still run (a drill "at the boundary" must meet the next call, not the one after)."""
        worker = self.workers[rank]
        ray.kill(worker, no_restart=True)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                ray.get(worker.__ray_ready__.remote(), timeout=1.0)
            except RayActorError:
                return
            except GetTimeoutError:
                continue  # busy with a call the kill will end
            time.sleep(0.02)

    def run_step(self, step: int, batch_index: int, timeout_s: float, next_batch: int | None = None) -> list[dict]:
        """Reports of every worker, in world-rank order (WorkerLost: see `calls.gather`); `next_batch`: the next
        step's batch, for the workers to run ahead."""
        return calls.gather([(r, calls.send(w, self.generation, "train_step", step, batch_index, next_batch))
                             for r, w in enumerate(self.workers)], timeout_s, f"step {step}", self.dead_ranks)

    def close(self) -> None:
        for w in self.workers + self.spares.clear() + self.resources.standbys.clear():
            ray.kill(w, no_restart=True)
        self.workers = []
        self.resources.release()


def slowest_start(stamps, since: float) -> dict[str, float]:
    """The start in phases (s) of the worker that was ready last, from every started worker's `started_at` stamps
    (epoch s), its grid's launch begun at `since`: placed and its process up (Ray's worker start, the Worker class
    loaded), imports, CUDA context, parts."""
    last = max(stamps, key=lambda s: s["ready"])
    return {"worker_process": max(0.0, last["constructor"] - since),
            "worker_imports": last["imports"] - last["constructor"],
            "worker_cuda": last["cuda_context"] - last["imports"],
            "worker_parts": last["ready"] - last["cuda_context"]}
