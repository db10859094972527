"""A worker grid's state transfer (a worker group owns one: k3ray.grid.worker_group): in-memory snapshots taken
into the object store (owned by the caller; a worker on another node maps a copy of each), and restores of every
worker from snapshots or checkpoint parts of any old grid. Every call goes through the group's one failure path."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import ray

from k3ray.grid import calls

if TYPE_CHECKING:  # k3ray.grid.snapshots imports torch: imported where used, so a worker group starts its workers
    from k3ray.grid.snapshots import SnapshotPart, StoreFit  # before its caller imports torch (the serving engine)


class GridStateTransfer:
    def __init__(self, group):
        self.group = group  # the WorkerGroup whose current workers these calls go to
        # the snapshot size the object stores were last checked against (a snapshot grows: the optimizer's state
        # exists only after the first step)
        self.store_checked_bytes = 0

    def restore(self, sources: dict[int, list], timeout_s: float = 300.0) -> None:
        """Every worker loads its stage's state from `sources` (stage -> old states, snapshot refs or checkpoint
        parts; a part is put into the object store once, not once per reader)."""
        from k3ray.grid.snapshots import SnapshotPart

        g = self.group
        refs = {p: [s if isinstance(s, (ray.ObjectRef, SnapshotPart)) else ray.put(s) for s in states]
                for p, states in sources.items()}
        g.call_each("restore", {r: tuple(refs[r // g.ep]) for r in range(g.size)}, timeout_s)

    def stage_snapshot(self, step: int) -> tuple[list[tuple[int, float]], StoreFit | None]:
        """Stage every worker's state to run `step` from (training stalls only for this): per world rank, its size in
        bytes and the worker's own seconds; and, on this grid's first snapshot and whenever they grow, what the
        nodes' object stores allow (None: enough)."""
        from k3ray.grid.snapshots import store_fit

        g = self.group
        staged = g.call("stage_snapshot", step, timeout_s=300)
        part_bytes = [nbytes for nbytes, _ in staged]
        fit = None
        if sum(part_bytes) > self.store_checked_bytes:
            self.store_checked_bytes = sum(part_bytes)
            stores = {n["NodeID"]: n["Resources"].get("object_store_memory", 0.0) for n in ray.nodes() if n["Alive"]}
            fit = store_fit(part_bytes, g.nodes, stores)
        return staged, fit

    def stream_snapshot(self, step: int, staged: list[tuple[int, float]]) -> list[SnapshotPart]:
        """Ask for the staged bytes, which stream into the object store while the next step runs (owned by the
        caller): per world rank, the part that will hold them."""
        from k3ray.grid.snapshots import SnapshotPart

        g = self.group
        return [SnapshotPart(w.snapshot.remote(g.generation, step), nbytes)
                for w, (nbytes, _) in zip(g.workers, staged)]

    def warm_stores(self) -> list[ray.ObjectRef]:
        """Start every worker writing its snapshot's size into its node's object store and freeing it (Worker
        `warm_store`), beside the steps before the first snapshot: each within its share of what the store holds
        before it spills. The calls' refs, not waited for (each returns the bytes written and the seconds)."""
        from k3ray.grid.snapshots import SPILL_AT

        g = self.group
        stores = {n["NodeID"]: n["Resources"].get("object_store_memory", 0.0) for n in ray.nodes() if n["Alive"]}
        workers_on = Counter(g.nodes)
        return [calls.send(w, g.generation, "warm_store", int(SPILL_AT * stores.get(node, 0.0) / workers_on[node]))
                for w, node in zip(g.workers, g.nodes)]

    def snapshot_bytes(self, parts: list[SnapshotPart], timeout_s: float | None) -> int | None:
        """The total size once every part of a snapshot has arrived: timeout_s=0 waits not at all (None while some
        have not arrived); else WorkerLost if a worker died before delivering its part, WorkerSlow if some gave none
        within timeout_s but answer pings (alive: their bytes are slow to arrive, spilled to disk say)."""
        done = [p.done for p in parts]
        if timeout_s == 0:
            ready, _ = ray.wait(done, num_returns=len(done), timeout=0, fetch_local=False)
            if len(ready) < len(done):
                return None
        calls.gather(list(enumerate(done)), timeout_s, "snapshot", self.group.dead_ranks, slow_is_lost=False)
        for p in parts:
            p.collect()
        return sum(p.nbytes for p in parts)

    def hold_peer_snapshots(self, step: int, refs: list) -> None:
        """Each snapshot part (by old world rank: the refs may be an older grid's) is mapped by a worker on another
        node than the one holding it, the next such rank after its own (placement-aware neighbour), so a copy
        survives the loss of that node. A part with no worker on another node is held by none: on its own node a
        worker's mapping is the same memory, no copy. The calls are sent, not waited for (a copy crosses the
        network beside the next steps; a worker lost meanwhile is met by the next step)."""
        g = self.group
        if len(set(g.nodes)) < 2:
            return
        where = ray.experimental.get_object_locations([part.refs[-1] for part in refs])
        for i, part in enumerate(refs):
            holding = set(where.get(part.refs[-1], {}).get("node_ids") or [])
            order = [(i + k) % g.size for k in range(1, g.size + 1)]
            holder = next((r for r in order if g.nodes[r] not in holding), None)
            if holder is not None:
                calls.send(g.workers[holder], g.generation, "hold_peer_snapshot", i, step, part)
