"""In-memory snapshots at GPU scale: a worker's whole state (tens of GB) laid out as a few byte chunks.

A worker's snapshot is staged at a step boundary (k3ray.grid.snapshot_stager: training stalls for a device copy at
most) and streamed into the node's object store beside the next step, one chunk (~1 GiB) after another, as the
values of a Ray streaming call that the controller makes: each chunk is written into the store once and owned by the
caller, so a snapshot outlives the worker that took it, any worker reads it back without a copy (numpy is zero-copy
in Ray), and the worker needs no host buffer of the whole state beside the store's copy.

Here: the layout (`layout`, `Packed`, `pack`, `unpack`), a worker's snapshot as the controller holds it
(`SnapshotPart`), whether the object stores hold the snapshots (`store_fit`), the job's start point (`StartPoint`),
and the controller's committed and pending snapshots (`Snapshots`).
"""
from __future__ import annotations

import logging
import os
import statistics
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from torch.utils._pytree import tree_map_only

from k3ray.grid.calls import WorkerSlow

ALIGN = 64  # bytes; every tensor starts aligned, so dtype views of a chunk are legal
CHUNK_BYTES = 1 << 30  # a snapshot streams in chunks of about this size (a tensor larger than it is a chunk alone)
PACK_THREADS = min(8, os.cpu_count() or 1)
SPILL_AT = 0.8  # Ray's object_spilling_threshold: past this share of a store, its objects spill to disk
log = logging.getLogger("k3ray.snapshots")


@dataclass(frozen=True)
class TensorSlot:
    offset: int  # bytes into its chunk
    dtype: str
    shape: tuple[int, ...]
    chunk: int = 0


@dataclass
class Packed:
    """A nested state (dicts, lists, tuples of tensors and plain values) with its tensors as slots of byte chunks."""
    tree: Any
    data: list[np.ndarray]  # uint8 [chunk bytes] each

    @property
    def nbytes(self) -> int:
        return sum(int(d.nbytes) for d in self.data)


@dataclass(frozen=True)
class Skeleton:
    """The first value of a streamed snapshot: the tree of TensorSlots and the size of every chunk that follows."""
    tree: Any
    sizes: list[int]


def layout(state: Any, chunk_bytes: int = 0) -> tuple[Any, list[tuple[torch.Tensor, TensorSlot]], list[int]]:
    """(tree with TensorSlots in place of tensors, [(tensor, slot)], the chunks' sizes in bytes). Tensors are laid
    out in tree order; a new chunk starts where the next tensor would take the current one past chunk_bytes (0: one
    chunk)."""
    tensors: list[tuple[torch.Tensor, TensorSlot]] = []
    sizes = [0]

    def place(x: torch.Tensor) -> TensorSlot:
        n = -(-x.numel() * x.element_size() // ALIGN) * ALIGN
        if chunk_bytes and sizes[-1] and sizes[-1] + n > chunk_bytes:
            sizes.append(0)
        slot = TensorSlot(sizes[-1], str(x.dtype).removeprefix("torch."), tuple(x.shape), len(sizes) - 1)
        tensors.append((x.detach(), slot))
        sizes[-1] += n
        return slot

    return tree_map_only(torch.Tensor, place, state), tensors, sizes


def view(chunk: torch.Tensor, slot: TensorSlot, base: int = 0) -> torch.Tensor:
    """The tensor of `slot` in `chunk` (uint8), whose byte `base` is the chunk's first."""
    dtype = getattr(torch, slot.dtype)
    n = int(np.prod(slot.shape, dtype=np.int64)) * dtype.itemsize
    return chunk[base + slot.offset:base + slot.offset + n].view(dtype).view(slot.shape)


def pack(state: Any, threads: int = PACK_THREADS) -> Packed:
    """A nested state of host tensors as one byte chunk: Ray writes it into the object store in one copy and any
    worker reads it back without one (a dict of tensors is pickled tensor by tensor instead, both ways). The tensors
    are copied by `threads` threads (a copy releases the GIL: the new chunk's page faults and, for memory-mapped
    tensors, the file's pages come in parallel)."""
    tree, tensors, sizes = layout(state)
    data = np.empty(sizes[0], dtype=np.uint8)
    buf = torch.from_numpy(data)
    with ThreadPoolExecutor(max(1, min(threads, len(tensors)))) as pool:
        list(pool.map(lambda item: view(buf, item[1]).copy_(item[0]), tensors))
    return Packed(tree, [data])


def unpack(packed: Packed) -> Any:
    """The nested state back, its tensors zero-copy CPU views of `packed.data` (read-only when it came from Ray's
    object store: copy before writing)."""
    with warnings.catch_warnings():  # torch warns that the object store's arrays are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        chunks = [torch.from_numpy(d) for d in packed.data]
    return tree_map_only(TensorSlot, lambda slot: view(chunks[slot.chunk], slot), packed.tree)


class SnapshotPart:
    """One worker's snapshot as the controller holds it: the streaming call that delivers it (until it has
    arrived), then references to its skeleton and its chunks in the object store. Passed to workers (restores, the
    neighbours' copies) once arrived; `packed` there maps it."""

    def __init__(self, stream, nbytes: int):
        self.stream = stream  # ray.ObjectRefGenerator of Worker.snapshot
        self.nbytes = nbytes
        self.refs: list | None = None

    @property
    def done(self) -> ray.ObjectRef:
        """Ready when every chunk has arrived (raises, when fetched, if the worker died first); once collected, its
        last chunk (ready)."""
        return self.stream.completed() if self.refs is None else self.refs[-1]

    def collect(self) -> None:
        """Take the references of an arrived snapshot off its stream (an error the worker raised, raised here)."""
        if self.refs is None:
            refs = list(self.stream)
            skeleton = ray.get(refs[0])
            if len(refs) != 1 + len(skeleton.sizes):
                ray.get(refs[-1])  # the worker's error, if the stream carries one
                raise RuntimeError(f"a snapshot stream ended after {len(refs) - 1} of {len(skeleton.sizes)} chunks")
            self.refs, self.stream = refs, None

    def packed(self) -> Packed:
        values = ray.get(self.refs)
        return Packed(values[0].tree, values[1:])

    def __getstate__(self) -> dict:
        if self.refs is None:
            raise RuntimeError("a snapshot is passed on only once it has arrived")
        return {"refs": self.refs, "nbytes": self.nbytes}

    def __setstate__(self, state: dict) -> None:
        self.stream, self.refs, self.nbytes = None, state["refs"], state["nbytes"]


def as_state(x: Any) -> Any:
    """A state from any form a restore source takes: a snapshot (SnapshotPart, Packed) or nested tensors
    (checkpoint parts)."""
    if isinstance(x, SnapshotPart):
        x = x.packed()
    return unpack(x) if isinstance(x, Packed) else x


@dataclass(frozen=True)
class StoreFit:
    """What the nodes' object stores allow: `one_at_a_time` when some node's store cannot hold two snapshots of its
    parts (the committed one and the next, arriving) below the spill threshold; `spills` when it cannot hold even
    one; `line` says what the job does about it, once."""
    line: str
    one_at_a_time: bool
    spills: bool


def store_fit(part_bytes: list[int], nodes: list[str], store_bytes: dict[str, float]) -> StoreFit | None:
    """None when every node's object store holds two snapshots of its workers' parts (`part_bytes`, `nodes`: by
    world rank) and, on several nodes, a neighbour's committed parts (`hold_peer_snapshots`) below Ray's spill
    threshold. Otherwise snapshots are held one at a time (each replaces the last when it starts, without the
    neighbours' copies: a node's store then holds one snapshot of its own parts, no more), and past the threshold
    they spill to local disk: they arrive later, the auto cadence takes them further apart, and none is read back
    unless a recovery needs it."""
    own: dict[str, int] = {}
    for node, nbytes in zip(nodes, part_bytes):
        own[node] = own.get(node, 0) + nbytes
    peers = 1 if len(own) > 1 else 0
    room = {node: SPILL_AT * store_bytes.get(node, 0.0) for node in own}
    if all((2 + peers) * nbytes <= room[node] for node, nbytes in own.items()):
        return None
    short = max(own, key=lambda node: own[node] - room[node])
    spills = own[short] > room[short]
    gib = 2.0**30
    what = "they spill to local disk and arrive later (the auto cadence takes them further apart)" if spills else \
        "they fit one at a time"
    return StoreFit(f"snapshots of {own[short] / gib:.1f} GiB of parts on a node, whose object store holds "
                    f"{room[short] / gib:.1f} GiB before it spills: {what}; each replaces the last when it starts, so "
                    f"a worker lost while one arrives goes back to the newest durable checkpoint or the job's start "
                    f"point (exact, with more steps to run again). Two at a time need "
                    f"{(2 + peers) * own[short] / SPILL_AT / gib:.0f} GiB of store per node (K3RAY_OBJECT_STORE_GB "
                    f"for a local cluster, `ray start --object-store-memory` on a cluster, /dev/shm as large)",
                    True, spills)


def restore_sources(states: dict[int, Any], pp: int, ep: int) -> dict[int, list]:
    """stage -> [the state of every EP rank of that stage in an old pp x ep grid], from states keyed by old world rank
    (snapshot references or checkpoint parts). Any EP size can restore from them (WorkerState.restore)."""
    return {p: [states[p * ep + e] for e in range(ep)] for p in range(pp)}


@dataclass
class Snapshot:
    """The state of every worker of one grid at the boundary before `step`, in the object store (refs by world rank,
    owned by the controller, so they outlive the workers), with what the controller needs to go back to it."""
    step: int
    guard: Any  # the guards' running statistics at that boundary
    pp: int
    ep: int
    refs: list  # world rank -> its SnapshotPart
    started: float
    stall_seconds: float  # training held up: staging on every worker
    nbytes: int = 0  # all workers together, once committed
    polls: int = 0  # the commits after a step that found it still arriving

    def sources(self) -> dict[int, list]:
        return restore_sources(dict(enumerate(self.refs)), self.pp, self.ep)


@dataclass(frozen=True)
class StartPoint:
    """Where the job started, at the boundary before `step`: what a recovery goes back to until the first snapshot
    has arrived, as it goes back to a snapshot. A job's starting state needs no snapshot: it is built again as the
    launch built it, from the seed (weights a deterministic function of the config and the seed, whatever the grid)
    or from the checkpoint parts it resumed from. So the job's first boundary takes none and the first step pays
    nothing for it."""
    step: int
    guard: Any  # the guards' running statistics at that boundary
    restore: dict[int, list] | None  # stage -> the resumed checkpoint's parts (restore_sources); None: the seed
    refs: tuple = ()  # nothing in the object store for the neighbours to hold
    nbytes: int = 0

    def sources(self) -> dict[int, list] | None:
        """What a grid restores from (None: its workers initialise their weights from the seed)."""
        return self.restore


class Snapshots:
    """The controller's in-memory snapshots: the committed one that recovery falls back on, and at most one pending
    (started at a step boundary, bytes still arriving while the next step runs).

    Interface: `start_at` once the first grid is up (the job's start point is what recovery falls back on until the
    first snapshot commits), `durable` when a durable checkpoint commits (a newer point to fall back on), `holds` and
    `take` at a boundary, `commit` after the step (or at once), `drop_pending` when a worker is lost, `committed` to
    restore from (a Snapshot, or the StartPoint: the job's start or its newest durable checkpoint, `base`, whenever no
    snapshot is held: before the first, and while one arrives in a store that holds one at a time); `stall_seconds` /
    `total_seconds` per committed snapshot, `read_wait_seconds` per snapshot (`optimizer_waited`) and `skipped` (the
    steps whose snapshot was due while the previous one was still arriving) for the benchmarks; `warnings` for the
    user."""

    def __init__(self, on_commit=None, on_skip=None, timeout_s: float = 600.0):
        """timeout_s: the longest wait for a snapshot's bytes (`commit(wait=True)` without a timeout of its own)."""
        self.timeout_s = timeout_s
        self.committed: Snapshot | StartPoint | None = None
        self.base: StartPoint | None = None  # the newest state held outside the object store (start, checkpoint)
        self.pending: Snapshot | None = None
        self.stall_seconds: list[float] = []  # training stalled per snapshot
        self.total_seconds: list[float] = []  # start to committed
        self.arrival_steps: list[int] = []  # steps that ended before it was found arrived (1: within the first)
        self.read_wait_seconds: list[float] = []  # the optimizer held up by the part read live, per snapshot
        self.skipped: list[int] = []
        self.abandoned: list[int] = []  # snapshots given up: their workers alive but their bytes too slow to arrive
        self.lost: list[int] = []  # committed snapshots that could not be read back (a part lost with its node)
        self.taken: list[int] = []  # the boundaries snapshots were started at
        self.worker_stage_seconds: list[float] = []  # per snapshot taken: the slowest worker's own staging time
        self.warnings: list[str] = []
        self.on_commit = on_commit  # called with each committed Snapshot (metrics)
        self.on_skip = on_skip  # called with (step skipped, step of the snapshot still arriving)
        self.one_at_a_time = False  # the object store holds one snapshot (StoreFit)
        self.warming: list = []  # the workers' warm_store calls (bytes, seconds each), once per job

    def summary(self) -> dict:
        """What the snapshots cost so far: how many were committed, training's stall for them (and the slowest
        worker's own share of it) and the optimizer's wait for their part read live (median and largest, ms), the
        steps whose snapshot was skipped, and how much of the object store the workers warmed before the first (GiB,
        the slowest worker's seconds)."""
        stalls, waits = self.stall_seconds, self.read_wait_seconds
        return {"committed": len(stalls), "stall_ms_median": 1e3 * statistics.median(stalls) if stalls else None,
                "stall_ms_max": 1e3 * max(stalls) if stalls else None,
                "worker_stage_ms_median": (1e3 * statistics.median(self.worker_stage_seconds)
                                           if self.worker_stage_seconds else None),
                "read_wait_ms_median": 1e3 * statistics.median(waits) if waits else None,
                "read_wait_ms_max": 1e3 * max(waits) if waits else None, "skipped": list(self.skipped),
                "abandoned": list(self.abandoned), "lost": list(self.lost), "one_at_a_time": self.one_at_a_time,
                "store_warmed": self.warmed()}

    def warm_stores(self, group, step: int) -> None:
        """At the boundary after the job's first step (the state and the memory the steps use are then all there):
        start the workers writing and freeing their snapshot's size in the object store, so that the first snapshot
        writes into pages the workers have mapped (`GridStateTransfer.warm_stores`). Once a job."""
        if isinstance(self.committed, StartPoint) and step == self.committed.step + 1 and not self.warming:
            self.warming = group.transfer.warm_stores()

    def warmed(self) -> tuple[float, float] | None:
        """GiB written by the warm_store calls that have ended, and the longest one's seconds (None: none ended)."""
        ready, _ = ray.wait(self.warming, num_returns=len(self.warming), timeout=0) if self.warming else ([], [])
        done = []
        for ref in ready:
            try:
                done.append(ray.get(ref))
            except ray.exceptions.RayError:
                continue  # its worker was lost meanwhile
        return (sum(b for b, _ in done) / 2**30, max(s for _, s in done)) if done else None

    def optimizer_waited(self, step: int, seconds: float) -> None:
        """The step run from the boundary of `step` waited `seconds` before its optimizer could write the state: for
        the part of the state the device had no room to stage, read from the live tensors as the snapshot of that
        boundary streams out. Kept per snapshot (a step whose boundary took none waits for nothing)."""
        if any(isinstance(s, Snapshot) and s.step == step for s in (self.pending, self.committed)):
            self.read_wait_seconds.append(seconds)

    def start_at(self, step: int, guard: Any, restore: dict[int, list] | None) -> None:
        """The job's first grid is up at the boundary before `step`, built from `restore` (the resumed checkpoint's
        parts by stage; None: from the seed): that is the state to fall back on until the first snapshot commits."""
        self.committed = self.base = StartPoint(step, guard, restore)
        self.pending = None

    def durable(self, point: StartPoint) -> None:
        """A durable checkpoint of the boundary before `point.step` committed: the state to fall back on when no
        newer snapshot is held."""
        self.base = point
        if isinstance(self.committed, StartPoint) or self.committed.step < point.step:
            self.committed = point

    def arriving(self) -> bool:
        """Whether a snapshot taken is still arriving (not committed yet)."""
        return self.pending is not None

    def holds(self, step: int) -> bool:
        """Whether the state at the boundary of `step` is held already (a snapshot of it, or the job's start
        point): a snapshot due there is not taken again."""
        return step in {s.step for s in (self.committed, self.pending) if s is not None}

    def take(self, group, step: int, guard: Any, wait: bool = False, defer: bool = False) -> bool:
        """Start a snapshot of the state to run `step` from; it becomes the one to fall back on once every worker's
        bytes have arrived (`commit`, after the step, or at once with wait=True). A snapshot is never waited for
        at a boundary: when the previous one is still arriving (its buffers are in use), this one is skipped
        (False) unless `wait` (a resize or recovery needs this boundary's state), or with `defer` not taken and not
        counted as skipped (an auto cadence takes it at the next boundary)."""
        self.commit(group, wait=wait)
        if self.pending is not None and defer:
            return False
        if self.pending is not None:
            self.skipped.append(step)
            log.warning("snapshot of step %d skipped: the one of step %d is still arriving", step, self.pending.step)
            if self.on_skip is not None:
                self.on_skip(step, self.pending.step)
            return False
        t0 = time.perf_counter()
        staged, fit = group.transfer.stage_snapshot(step)
        if fit is not None:
            self.one_at_a_time = fit.one_at_a_time
            if fit.line not in self.warnings:
                self.warnings.append(fit.line)
        if self.one_at_a_time:  # its store space is this one's: until it arrives, the base is what recovery has
            self.committed = self.base
        refs = group.transfer.stream_snapshot(step, staged)
        self.taken.append(step)
        self.worker_stage_seconds.append(max((seconds for _, seconds in staged), default=0.0))
        self.pending = Snapshot(step, guard, group.pp, group.ep, refs, t0, time.perf_counter() - t0)
        if wait:
            self.commit(group, wait=True)
        return True

    def commit(self, group, wait: bool, timeout_s: float | None = None, hold: bool = True) -> None:
        """Make the pending snapshot the committed one once all of it has arrived (WorkerLost if a worker died
        first; a wait that runs out while its workers answer pings abandons it: the committed one stays). On
        several nodes the neighbours then map copies (not waited for); hold=False leaves them out (a recovery: the
        new grid takes them)."""
        snap = self.pending
        if snap is None:
            return
        try:
            nbytes = group.transfer.snapshot_bytes(snap.refs, (self.timeout_s if timeout_s is None
                                                                    else timeout_s) if wait else 0)
        except WorkerSlow as slow:
            log.warning("snapshot of step %d abandoned: %s", snap.step, slow)
            self.abandoned.append(snap.step)
            self.pending = None
            return
        if nbytes is None:
            snap.polls += 1
            return
        snap.nbytes = nbytes
        self.committed, self.pending = snap, None
        if hold and not self.one_at_a_time:
            group.transfer.hold_peer_snapshots(snap.step, snap.refs)
        self.stall_seconds.append(snap.stall_seconds)
        self.total_seconds.append(time.perf_counter() - snap.started)
        self.arrival_steps.append(snap.polls + 1)
        if self.on_commit is not None:
            self.on_commit(snap)

    def fall_back(self) -> StartPoint:
        """The committed snapshot could not be read back (a part of it lost with its node before a neighbour's copy
        was made): dropped; the base (the job's start or its newest durable checkpoint) is what to restore."""
        log.warning("snapshot of step %d lost with a node: going back to step %d", self.committed.step, self.base.step)
        self.lost.append(self.committed.step)
        self.committed = self.base
        return self.base

    def drop_pending(self) -> None:
        self.pending = None
