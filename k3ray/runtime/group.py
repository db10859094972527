"""WorkerGroup: the [pp][ep] grid of Worker actors of one topology, as plain library code the controller drives.

It launches the grid inside a placement group, builds the process groups (rendezvous on world rank 0), runs a step
and tells a dead or hung worker from the survivors' collateral errors, takes in-memory snapshots (each worker keeps
its own and a copy of its neighbour's, world rank i -> i+1), and gathers them back after a loss.
"""
from __future__ import annotations

import time

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from k3ray.actors.worker import Worker
from k3ray.config import JobConfig


class TopologyError(RuntimeError):
    """The cluster cannot hold the requested topology."""


class WorkerLost(RuntimeError):
    """Workers died or hung during a step; `ranks` are their world ranks."""

    def __init__(self, ranks: set[int], why: str):
        super().__init__(f"lost world ranks {sorted(ranks)}: {why}")
        self.ranks, self.why = ranks, why


class WorkerGroup:
    def __init__(self, cfg: JobConfig, ep: int, home: list[int]):
        self.cfg, self.pp, self.ep, self.home = cfg, cfg.parallel.pp, ep, list(home)
        self.bundle = {"CPU": 1} if cfg.parallel.device == "cpu" else {"CPU": 1, "GPU": 1}
        self.pg = None
        self.workers: list = []  # world rank -> actor
        self.launch_seconds: dict[str, float] = {}  # place, start workers, process groups, restore

    @property
    def size(self) -> int:
        return self.pp * self.ep

    def fits(self, extra_cluster_free: bool = False) -> tuple[bool, str]:
        """Whether the cluster can hold this grid (in total, or in what is free right now)."""
        have = ray.available_resources() if extra_cluster_free else ray.cluster_resources()
        for res, amount in self.bundle.items():
            need = amount * self.size
            if have.get(res, 0) < need:
                return False, f"needs {need:g} {res} (one per worker) but the cluster has {have.get(res, 0):g}"
        return True, ""

    def launch(self, timeout_s: float, restore: dict[int, tuple] | None = None) -> str:
        """Place, create and connect the workers; restore[stage] = (dense_state_ref, expert_payloads_ref)."""
        ok, why = self.fits()
        if not ok:
            par = self.cfg.parallel
            raise TopologyError(f"parallel.pp={par.pp} x ep={self.ep}: {why}; lower pp/ep or add nodes")
        t0 = time.perf_counter()
        self.pg = placement_group([dict(self.bundle) for _ in range(self.size)], strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            self.close()
            raise TopologyError(f"could not place {self.size} workers ({self.bundle} each) within {timeout_s:g}s: "
                                f"resources are busy")
        cfg_dict = self.cfg.model_dump()
        self.workers = [Worker.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
            num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0),
        ).remote(cfg_dict, r // self.ep, r % self.ep, self.home, self.ep) for r in range(self.size)]
        ip, port = ray.get(self.workers[0].rendezvous_address.remote(), timeout=timeout_s)
        t1 = time.perf_counter()
        if ip == ray.util.get_node_ip_address() and len([n for n in ray.nodes() if n["Alive"]]) == 1:
            ip = "127.0.0.1"
        par = self.cfg.parallel
        backend = par.backend if par.backend != "auto" else ("nccl" if par.device == "cuda" else "gloo")
        ray.get([w.setup.remote(f"tcp://{ip}:{port}", backend) for w in self.workers], timeout=timeout_s)
        t2 = time.perf_counter()
        if restore is not None:
            ray.get([w.restore.remote(*restore[r // self.ep]) for r, w in enumerate(self.workers)], timeout=timeout_s)
        self.launch_seconds = {"place_and_start_workers": t1 - t0, "process_groups": t2 - t1,
                               "restore": time.perf_counter() - t2}
        return backend

    def call(self, method: str, *args, timeout_s: float = 120.0) -> list:
        return ray.get([getattr(w, method).remote(*args) for w in self.workers], timeout=timeout_s)

    def run_step(self, step: int, batch_index: int, timeout_s: float, grace_s: float = 5.0) -> list[dict]:
        """Reports of every worker, or WorkerLost naming the dead (ActorDiedError) or hung workers. A worker is hung
        when it gives no answer within timeout_s, or within grace_s after some peers have already failed (their
        collectives timed out waiting for it). Survivors' errors caused by a lost peer do not count as lost."""
        futures = [w.train_step.remote(step, batch_index) for w in self.workers]
        index = {f: i for i, f in enumerate(futures)}
        reports: dict[int, dict] = {}
        errors: dict[int, Exception] = {}
        pending, deadline = list(futures), time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            i = index[ready[0]]
            try:
                reports[i] = ray.get(ready[0])
            except (ActorDiedError, ActorUnavailableError) as err:
                raise WorkerLost({i}, type(err).__name__) from None
            except RayTaskError as err:
                errors[i] = err
                deadline = min(deadline, time.monotonic() + grace_s)
        if pending:
            raise WorkerLost({index[f] for f in pending}, f"no answer within {timeout_s:g}s (hung collective?)")
        if errors:
            raise next(iter(errors.values()))
        return [reports[i] for i in range(self.size)]

    def snapshot(self, step: int) -> None:
        """Every worker keeps the state to run `step` from, and its neighbour (world rank + 1) holds a copy."""
        refs = [w.take_snapshot.remote(step) for w in self.workers]
        ray.get([self.workers[(i + 1) % self.size].hold_peer_snapshot.remote(i, step, ref)
                 for i, ref in enumerate(refs)], timeout=300)

    def gather_snapshots(self, step: int, lost: set[int]) -> dict[int, dict]:
        """World rank -> its state at `step`, from survivors' own snapshots and the copies they hold of
        neighbours (read through each worker's second thread, even while its training thread is stuck)."""
        states: dict[int, dict] = {}
        for i, w in enumerate(self.workers):
            if i in lost:
                continue
            try:
                snaps = ray.get(w.get_snapshots.remote(), timeout=60)
            except (ActorDiedError, ActorUnavailableError, GetTimeoutError):
                continue
            if snaps["own"] is not None and snaps["own"][0] == step:
                states[i] = snaps["own"][1]
            if snaps["peer"] is not None and snaps["peer"][1] == step:
                states.setdefault(snaps["peer"][0], snaps["peer"][2])
        return states

    def close(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def restore_sources(states: dict[int, dict], pp: int, ep: int) -> dict[int, tuple]:
    """stage -> (dense state, {layer: [payloads of every old EP rank]}) from the states of an old pp x ep grid
    (keyed by world rank), each put once in the object store. Any EP size can restore from them."""
    out = {}
    for p in range(pp):
        ranks = [p * ep + e for e in range(ep)]
        dense = states[ranks[0]]
        payloads = {layer: [states[r]["experts"][layer] for r in ranks] for layer in dense["experts"]}
        out[p] = (ray.put(dense), ray.put(payloads))
    return out
