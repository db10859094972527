"""WorkerGroup: the [pp][ep] grid of Worker actors of one topology; the only part of the controller that talks to
workers (the controller itself is Ray-free, and its tests drive it with a fake group of the same interface).

It launches the grid inside a placement group on alive nodes, builds the process groups (rendezvous on world rank 0),
runs steps and takes in-memory snapshots (into the object store, owned by the caller; a worker on another node maps a
copy of each). Every call to workers goes through one failure path (`_gather`): a dead or hung worker, whatever the
call, becomes WorkerLost naming every lost rank (all of a lost node's at once), told apart from the survivors'
collateral errors.
"""
from __future__ import annotations

import time

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from k3ray.controller.worker import Worker
from k3ray.config import JobConfig

# Ray starts actor processes at nice 15. In a GPU job the controller sits on every step's critical path and a
# worker's host thread feeds its GPU (launches, the per-layer count sync), so they run at normal priority: nice 15
# cost 2 % of the step on 2 H200s (benchmarks/RESULTS.md). Ray's own job supervisor does the same.
NORMAL_PRIORITY = {"env_vars": {"RAY_worker_niceness": "0"}}


def actor_runtime_env(cfg: JobConfig) -> dict | None:
    """The controller's and the workers' runtime env: normal priority for GPU jobs. CPU jobs keep Ray's default (and
    workers inherit the controller's env), so their compute leaves Ray's own processes the CPU on small hosts: at
    normal priority the CPU test suite ran 10 % slower on 2 cores."""
    return NORMAL_PRIORITY if cfg.parallel.device == "cuda" else None


def alive_resources(free: bool, avoid_nodes: frozenset[str] = frozenset()) -> dict[str, float]:
    """Resources of the nodes Ray reports alive (but avoid_nodes), in total or (free) what is unused of them: a lost
    node's resources stay in ray.cluster_resources() for a while, so placement must not count on them."""
    have: dict[str, float] = {}
    for node in ray.nodes():
        if node["Alive"] and node["NodeID"] not in avoid_nodes:
            for res, amount in node["Resources"].items():
                have[res] = have.get(res, 0) + amount
    if free:
        available = ray.available_resources()
        have = {res: min(amount, available.get(res, 0)) for res, amount in have.items()}
    return have


class TopologyError(RuntimeError):
    """The cluster cannot hold the requested topology."""


class WorkerLost(RuntimeError):
    """Workers died or hung (in any call to them); `ranks` are their world ranks, every one found lost; `hung`: found
    by a timeout (some gave no answer) rather than by Ray reporting them dead."""

    def __init__(self, ranks: set[int], why: str, hung: bool = False):
        super().__init__(f"lost world ranks {sorted(ranks)}: {why}")
        self.ranks, self.why, self.hung = ranks, why, hung


class WorkerGroup:
    def __init__(self, cfg: JobConfig, ep: int, home: list[int], avoid_nodes: frozenset[str] = frozenset()):
        """avoid_nodes: nodes found silent, which Ray may still report alive: neither counted nor placed on."""
        self.cfg, self.pp, self.ep, self.home = cfg, cfg.parallel.pp, ep, list(home)
        self.avoid_nodes = frozenset(avoid_nodes)
        self.bundle = {"CPU": 1} if cfg.parallel.device == "cpu" else {"CPU": 1, "GPU": 1}
        self.pg = None
        self.workers: list = []  # world rank -> actor
        self.nodes: list[str] = []  # world rank -> Ray node id
        self.launch_seconds: dict[str, float] = {}  # place, start workers, process groups, restore

    @property
    def size(self) -> int:
        return self.pp * self.ep

    def fits(self, extra_cluster_free: bool = False) -> tuple[bool, str]:
        """Whether the cluster's alive nodes can hold this grid (in total, or in what is free right now)."""
        have = alive_resources(extra_cluster_free, self.avoid_nodes)
        for res, amount in self.bundle.items():
            need = amount * self.size
            if have.get(res, 0) < need:
                return False, f"needs {need:g} {res} (one per worker) but the cluster has {have.get(res, 0):g}"
        return True, ""

    def capacity(self) -> int:
        """How many workers the alive nodes can hold in total (a shrunk grid is planned to fit it)."""
        have = alive_resources(False, self.avoid_nodes)
        return int(min(have.get(res, 0) // amount for res, amount in self.bundle.items()))

    def launch(self, timeout_s: float, restore: dict[int, list] | None = None) -> str:
        """Place, create and connect the workers; restore[stage] = that stage's old states (`restore_sources`)."""
        ok, why = self.fits()
        if not ok:
            par = self.cfg.parallel
            raise TopologyError(f"parallel.pp={par.pp} x ep={self.ep}: {why}; lower pp/ep or add nodes")
        t0 = time.perf_counter()
        # Ray labels every node with its id; a label selector keeps the bundles off the silent nodes
        avoid = [{"ray.io/node-id": f"!in({','.join(sorted(self.avoid_nodes))})"}] * self.size if self.avoid_nodes \
            else None
        self.pg = placement_group([dict(self.bundle) for _ in range(self.size)], strategy="PACK",
                                  bundle_label_selector=avoid)
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            self.close()
            raise TopologyError(f"could not place {self.size} workers ({self.bundle} each) within {timeout_s:g}s: "
                                f"resources are busy")
        self.nodes = [ray.util.placement_group_table(self.pg)["bundles_to_node_id"][r] for r in range(self.size)]
        cfg_dict = self.cfg.model_dump()
        self.workers = [Worker.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
            num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0), runtime_env=actor_runtime_env(self.cfg),
        ).remote(cfg_dict, r // self.ep, r % self.ep, self.home, self.ep, restore is None) for r in range(self.size)]
        ip, port = self.call_each("rendezvous_address", {0: ()}, timeout_s)[0]
        t1 = time.perf_counter()
        if ip == ray.util.get_node_ip_address() and len([n for n in ray.nodes() if n["Alive"]]) == 1:
            ip = "127.0.0.1"
        par = self.cfg.parallel
        backend = par.backend if par.backend != "auto" else ("nccl" if par.device == "cuda" else "gloo")
        self.call("setup", f"tcp://{ip}:{port}", backend, timeout_s=timeout_s)
        t2 = time.perf_counter()
        if restore is not None:
            self.restore(restore, timeout_s)
        self.launch_seconds = {"place_and_start_workers": t1 - t0, "process_groups": t2 - t1,
                               "restore": time.perf_counter() - t2}
        return backend

    def call(self, method: str, *args, timeout_s: float | None = 120.0) -> list:
        """Every worker's `method(*args)`, in world-rank order."""
        return self._gather([(r, getattr(w, method).remote(*args)) for r, w in enumerate(self.workers)], timeout_s,
                            method)

    def call_each(self, method: str, args: dict[int, tuple], timeout_s: float | None = 120.0) -> dict[int, object]:
        """`method(*args[r])` on world rank r, for the ranks in `args`."""
        ranks = list(args)
        out = self._gather([(r, getattr(self.workers[r], method).remote(*args[r])) for r in ranks], timeout_s, method)
        return dict(zip(ranks, out))

    def restore(self, sources: dict[int, list], timeout_s: float = 300.0) -> None:
        """Every worker loads its stage's state from `sources` (stage -> old states, snapshot refs or checkpoint
        parts; a part is put into the object store once, not once per reader)."""
        refs = {p: [s if isinstance(s, ray.ObjectRef) else ray.put(s) for s in states] for p, states in sources.items()}
        self._gather([(r, w.restore.remote(*refs[r // self.ep])) for r, w in enumerate(self.workers)], timeout_s,
                     "restore")

    def run_on(self, ranks: list[int], fn, *args) -> list:
        """`fn(worker, *args)` inside the given workers' processes (fault drills)."""
        return self._gather([(r, self.workers[r].__ray_call__.remote(fn, *args)) for r in ranks], 120.0, "drill")

    def _gather(self, calls: list[tuple[int, ray.ObjectRef]], timeout_s: float | None, what: str,
                grace_s: float = 5.0) -> list:
        """The one failure path of every call to workers: the results of (world rank, call) in order, or WorkerLost
        naming every dead or hung worker. A dead worker (RayActorError) is lost at once, together with every other
        worker a ping finds dead or whose node Ray reports lost (a lost node takes all of its ranks). A worker is
        hung when it gives no answer within timeout_s, or within grace_s after some peers have already failed
        (their collectives timed out waiting for it). Survivors' errors caused by a lost peer (RayTaskError) do not
        count as lost."""
        index = {ref: i for i, (_, ref) in enumerate(calls)}
        results: dict[int, object] = {}
        errors: dict[int, Exception] = {}
        pending = [ref for _, ref in calls]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                break
            i = index[ready[0]]
            try:
                results[i] = ray.get(ready[0])
            except RayActorError as err:
                answered = {calls[j][0] for j in results}
                raise WorkerLost({calls[i][0]} | self.dead_ranks(exclude=answered),
                                 f"{type(err).__name__} in {what}") from None
            except RayTaskError as err:
                errors[i] = err
                deadline = time.monotonic() + grace_s if deadline is None else min(deadline,
                                                                                   time.monotonic() + grace_s)
        if pending:
            answered = {calls[j][0] for j in results}
            hung = {calls[index[f]][0] for f in pending} | self.dead_ranks(exclude=answered)
            raise WorkerLost(hung, f"no answer to {what} within {timeout_s if not errors else grace_s:g}s "
                                   f"(hung collective or silent node?)", hung=True)
        if errors:
            raise next(iter(errors.values()))
        return [results[i] for i in range(len(calls))]

    def dead_ranks(self, exclude: set[int] = frozenset(), timeout_s: float = 2.0) -> set[int]:
        """World ranks whose node Ray reports lost, or whose actor it reports dead or unreachable: each worker
        answers a ping on its second thread even mid-step, so a ping that fails names a lost worker; one that is
        merely slow does not."""
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        dead = {r for r, node in enumerate(self.nodes) if node not in alive and r not in exclude}
        pings = {w.__ray_ready__.remote(): r for r, w in enumerate(self.workers) if r not in exclude | dead}
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except RayError:
                dead.add(pings[ref])
        return dead

    def kill(self, rank: int) -> None:
        ray.kill(self.workers[rank], no_restart=True)

    def run_step(self, step: int, batch_index: int, timeout_s: float) -> list[dict]:
        """Reports of every worker, in world-rank order (WorkerLost: see `_gather`)."""
        return self._gather([(r, w.train_step.remote(step, batch_index)) for r, w in enumerate(self.workers)],
                            timeout_s, f"step {step}")

    def serve_step(self, plans: dict, timeout_s: float) -> dict:
        """One serving iteration: worker (p, e) runs data-parallel rank e's plan (k3ray.parallel.serving.RankPlan);
        each rank's stages' answers in pipeline order (WorkerLost: see `_gather`)."""
        out = self._gather([(r, w.serve_step.remote(plans[r % self.ep])) for r, w in enumerate(self.workers)],
                           timeout_s, "serve_step")
        return {e: out[e::self.ep] for e in range(self.ep)}

    def begin_snapshot(self, step: int) -> tuple[list, list]:
        """Stage every worker's state to run `step` from (training stalls only for this), then ask for the bytes,
        which arrive while the next step runs: per world rank, a reference to them (owned by the caller) and one
        to their size (small: it tells when they have arrived, or that the worker died first)."""
        self.call("stage_snapshot", step, timeout_s=300)
        pairs = [w.snapshot.remote(step) for w in self.workers]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def snapshot_bytes(self, size_refs: list, timeout_s: float | None) -> int | None:
        """The total size once every part of a snapshot has arrived (None while some have not, after waiting up to
        timeout_s; 0 waits not at all). WorkerLost if a worker died before delivering its part."""
        ready, _ = ray.wait(size_refs, num_returns=len(size_refs), timeout=timeout_s, fetch_local=True)
        if len(ready) < len(size_refs):
            return None
        return sum(self._gather(list(enumerate(size_refs)), 0, "snapshot"))

    def hold_peer_snapshots(self, step: int, refs: list) -> None:
        """Each snapshot part (by old world rank: the refs may be an older grid's) is mapped by a worker on another
        node than the one holding it, the next such rank after its own (placement-aware neighbour), so a copy
        survives the loss of that node; on one node, simply the next rank."""
        where = ray.experimental.get_object_locations(refs)
        calls = []
        for i, ref in enumerate(refs):
            holding = set(where.get(ref, {}).get("node_ids") or [])
            order = [(i + k) % self.size for k in range(1, self.size + 1)]
            holder = next((r for r in order if self.nodes and self.nodes[r] not in holding), order[0])
            calls.append((holder, self.workers[holder].hold_peer_snapshot.remote(i, step, ref)))
        self._gather(calls, 300, "hold_peer_snapshots")

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
