"""In-memory snapshots at GPU scale: a worker's whole state (tens of GB) packed into one flat byte buffer.

A snapshot is taken in two parts so that training stalls only for the first, and at most for a device-to-device copy:
  1. `stage` (at the step boundary): the state's tensors are laid out in one byte buffer. A prefix of them is copied
     into a reused staging buffer on the device (~4 TB/s on an H200: ~10 ms per 20 GB); the rest is copied from the
     live tensors straight into a reused pinned host buffer on a side stream, while the next step's forward and
     backward run (they read the weights, write none of the state). What writes the state next (the optimizer, a
     restore, a reshard) waits for that transfer on the device (`StageEngine.state_reads`), not on the host. The
     staging buffer is sized once, at the second snapshot (after a step, when the memory the steps need is held by
     the allocator), to what the device has free beside them; the first snapshot is read live whole (the first step
     is long anyway: kernels compile).
  2. `packed` (on the worker's second thread, overlapping the next step): the staged prefix device-to-host on the
     side stream into the same pinned buffer, returned as a `Packed` whose bytes are one numpy array. Returned from a
     Ray actor method, it is written once into the node's object store, owned by the caller (the controller): it
     outlives the worker that took it, and any worker can read it back without a copy (numpy is zero-copy in Ray).
The controller keeps the committed snapshot and the pending one (`Snapshots`).
"""
from __future__ import annotations

import logging
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map_only

ALIGN = 64  # bytes; every tensor starts aligned, so dtype views of the byte buffer are legal
log = logging.getLogger("k3ray.snapshots")


@dataclass(frozen=True)
class TensorSlot:
    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Packed:
    """A nested state (dicts, lists, tuples of tensors and plain values) with its tensors as slots of `data`."""
    tree: Any
    data: np.ndarray  # uint8 [nbytes]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def layout(state: Any) -> tuple[Any, list[tuple[torch.Tensor, TensorSlot]], int]:
    """(tree with TensorSlots in place of tensors, [(tensor, slot)], total bytes)."""
    tensors: list[tuple[torch.Tensor, TensorSlot]] = []
    offset = 0

    def place(x: torch.Tensor) -> TensorSlot:
        nonlocal offset
        slot = TensorSlot(offset, str(x.dtype).removeprefix("torch."), tuple(x.shape))
        tensors.append((x.detach(), slot))
        offset += -(-x.numel() * x.element_size() // ALIGN) * ALIGN
        return slot

    return tree_map_only(torch.Tensor, place, state), tensors, offset


def _view(buf: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    dtype = getattr(torch, slot.dtype)
    n = int(np.prod(slot.shape, dtype=np.int64)) * dtype.itemsize
    return buf[slot.offset:slot.offset + n].view(dtype).view(slot.shape)


def pack(state: Any) -> Packed:
    """A nested state of host tensors as one byte buffer: Ray writes it into the object store in one copy and any
    worker reads it back without one (a dict of tensors is pickled tensor by tensor instead, both ways)."""
    tree, tensors, nbytes = layout(state)
    data = np.empty(nbytes, dtype=np.uint8)
    buf = torch.from_numpy(data)
    for x, slot in tensors:
        _view(buf, slot).copy_(x)
    return Packed(tree, data)


def unpack(packed: Packed) -> Any:
    """The nested state back, its tensors zero-copy CPU views of `packed.data` (read-only when it came from Ray's
    object store: copy before writing)."""
    with warnings.catch_warnings():  # torch warns that the object store's arrays are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        buf = torch.from_numpy(packed.data)
    return tree_map_only(TensorSlot, lambda slot: _view(buf, slot), packed.tree)


def as_state(x: Any) -> Any:
    """A state from either form a restore source takes: Packed (snapshots) or nested tensors (checkpoint parts)."""
    return unpack(x) if isinstance(x, Packed) else x


class SnapshotStager:
    """One worker's reusable snapshot buffers: a pinned host buffer for the whole state (pageable on CPU) and, on
    CUDA, a staging buffer on the device for as much of it as fits beside training. The host buffer grows when a
    state outgrows it (more experts homed here after a reshard); the staging buffer is never grown past its first
    size: what does not fit is read live."""

    def __init__(self, device: torch.device, device_headroom_bytes: int = 4 << 30):
        self.device = device
        self.headroom = device_headroom_bytes
        self.host: torch.Tensor | None = None
        self.staging: torch.Tensor | None = None
        self.snapshots = 0  # staged so far: the first is read live whole (no step has shown its memory yet)
        # (step, tree, nbytes, staged prefix bytes, event after the staging copy): the state to run `step` from
        self.staged: tuple[int, Any, int, int, torch.cuda.Event | None] | None = None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _host(self, nbytes: int) -> torch.Tensor:
        if self.host is None or self.host.numel() < nbytes:
            self.host = None  # free the old one first
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return self.host

    def _staging_bytes(self, nbytes: int) -> int:
        """Bytes of the state this snapshot stages on the device (0: all read live)."""
        if self.device.type != "cuda" or self.snapshots == 0:
            return 0
        if self.staging is None:
            # Only memory nobody holds counts: blocks cached by the allocator are the next step's activations, so
            # staging in them would push that step out of memory on a full device.
            free, _ = torch.cuda.mem_get_info(self.device)
            size = min(nbytes, int(free) - self.headroom) // ALIGN * ALIGN
            if size <= 0:
                return 0
            self.staging = torch.empty(size, dtype=torch.uint8, device=self.device)
        return min(nbytes, self.staging.numel())

    @torch.no_grad()
    def stage(self, state: Any, step: int) -> tuple[int, torch.cuda.Event | None]:
        """Lay `state` (live tensors: the state to run `step` from) out and start copying it aside. Returns its size
        in bytes and, on CUDA, the event after which the live tensors are no longer read (None: copied already):
        whatever writes them next must wait for it (on the device)."""
        tree, tensors, nbytes = layout(state)
        host = self._host(nbytes)
        budget = self._staging_bytes(nbytes)
        self.snapshots += 1
        if self.stream is None:
            for t, slot in tensors:
                _view(host, slot).copy_(t)
            self.staged = (step, tree, nbytes, 0, None)
            return nbytes, None
        cut = 0  # tensors ending within the staging budget are staged on the device at their own offsets
        for t, slot in tensors:
            end = slot.offset + t.numel() * t.element_size()
            if end > budget:
                break
            _view(self.staging, slot).copy_(t)
            cut = end
        staged = torch.cuda.Event()
        staged.record()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # reads the state at this boundary
        with torch.cuda.stream(self.stream):
            for t, slot in tensors:
                if slot.offset >= cut:
                    _view(host, slot).copy_(t, non_blocking=True)
            read = torch.cuda.Event()
            read.record()
        self.staged = (step, tree, nbytes, cut, staged)
        return nbytes, read

    @torch.no_grad()
    def packed(self, step: int) -> Packed:
        """The state staged for `step` as host bytes (waits for the device-to-host copies, which overlap training).
        A call for another step (a stale one, queued before a newer staging) is refused and leaves the staged state
        for the call it belongs to."""
        if self.staged is None or self.staged[0] != step:
            have = "nothing" if self.staged is None else f"step {self.staged[0]}"
            raise RuntimeError(f"snapshot of step {step} asked for, {have} staged")
        _, tree, nbytes, cut, staged = self.staged
        self.staged = None
        host = self._host(nbytes)
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(staged)
                if cut:
                    host[:cut].copy_(self.staging[:cut], non_blocking=True)
            self.stream.synchronize()
        return Packed(tree, host[:nbytes].numpy())


def store_shortfall(part_bytes: list[int], nodes: list[str], store_bytes: dict[str, float]) -> str | None:
    """One line when some node's object store cannot hold its snapshots, else None. A node holds its workers' parts
    (`part_bytes`, `nodes`: by world rank) twice while a snapshot arrives (the committed one and the next), and on
    several nodes a neighbour's committed parts too (`hold_peer_snapshots`). Past that the store spills to disk:
    snapshots arrive late (and are skipped) and fill the disk."""
    own: dict[str, int] = {}
    for node, nbytes in zip(nodes, part_bytes):
        own[node] = own.get(node, 0) + nbytes
    peers = 1 if len(own) > 1 else 0
    need = {node: (2 + peers) * nbytes for node, nbytes in own.items()}
    short = max(need, key=lambda node: need[node] - store_bytes.get(node, 0.0))
    have = store_bytes.get(short, 0.0)
    if need[short] <= have:
        return None
    gib = 2.0**30
    return (f"snapshots need {need[short] / gib:.1f} GiB of object store on a node ({own[short] / gib:.1f} GiB of "
            f"parts, held {2 + peers} times) and it has {have / gib:.1f} GiB: they spill to disk and arrive late "
            f"(late ones are skipped); give every node's store {need[short] / gib:.0f} GiB (K3RAY_OBJECT_STORE_GB "
            f"for a local cluster, `ray start --object-store-memory` on a cluster, /dev/shm at least as large)")


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
    refs: list
    size_refs: list  # world rank -> ref to the snapshot's size in bytes
    started: float
    stall_seconds: float  # training held up: staging on every worker
    nbytes: int = 0  # all workers together, once committed

    def sources(self) -> dict[int, list]:
        return restore_sources(dict(enumerate(self.refs)), self.pp, self.ep)


class Snapshots:
    """The controller's in-memory snapshots: the committed one that recovery falls back on, and at most one pending
    (started at a step boundary, bytes still arriving while the next step runs).

    Interface: `due` and `take` at a boundary, `commit` after the step (or at once), `drop_pending` when a worker is
    lost, `committed` to restore from; `stall_seconds` / `total_seconds` per committed snapshot and `skipped` (the
    steps whose snapshot was due while the previous one was still arriving) for the benchmarks; `warnings` for the
    user."""

    def __init__(self, on_commit=None, on_skip=None, timeout_s: float = 600.0):
        """timeout_s: the longest wait for a snapshot's bytes (`commit(wait=True)` without a timeout of its own)."""
        self.timeout_s = timeout_s
        self.committed: Snapshot | None = None
        self.pending: Snapshot | None = None
        self.stall_seconds: list[float] = []  # training stalled per snapshot
        self.total_seconds: list[float] = []  # start to committed
        self.skipped: list[int] = []
        self.warnings: list[str] = []
        self.on_commit = on_commit  # called with each committed Snapshot (metrics)
        self.on_skip = on_skip  # called with (step skipped, step of the snapshot still arriving)

    def summary(self) -> dict:
        """What the snapshots cost so far: how many were committed, training's stall for them (median and largest,
        ms) and the steps whose snapshot was skipped."""
        stalls = self.stall_seconds
        return {"committed": len(stalls), "stall_ms_median": 1e3 * statistics.median(stalls) if stalls else None,
                "stall_ms_max": 1e3 * max(stalls) if stalls else None, "skipped": list(self.skipped)}

    def due(self, step: int, every: int) -> bool:
        """Whether the boundary of `step` takes a snapshot: every `every` steps, unless one of it exists already."""
        taken = {s.step for s in (self.committed, self.pending) if s is not None}
        return step % every == 0 and step not in taken

    def take(self, group, step: int, guard: Any, wait: bool = False) -> bool:
        """Start a snapshot of the state to run `step` from; it becomes the one to fall back on once every worker's
        bytes have arrived (`commit`, after the step, or at once with wait=True). A snapshot is never waited for
        at a boundary: when the previous one is still arriving (its buffers are in use), this one is skipped
        (False) unless `wait` (a resize or recovery needs this boundary's state)."""
        self.commit(group, wait=wait)
        if self.pending is not None:
            self.skipped.append(step)
            log.warning("snapshot of step %d skipped: the one of step %d is still arriving", step, self.pending.step)
            if self.on_skip is not None:
                self.on_skip(step, self.pending.step)
            return False
        t0 = time.perf_counter()
        refs, size_refs, shortfall = group.transfer.begin_snapshot(step)
        self.pending = Snapshot(step, guard, group.pp, group.ep, refs, size_refs, t0, time.perf_counter() - t0)
        if shortfall is not None and shortfall not in self.warnings:
            self.warnings.append(shortfall)
        if wait:
            self.commit(group, wait=True)
        return True

    def commit(self, group, wait: bool, timeout_s: float | None = None, hold: bool = True) -> None:
        """Make the pending snapshot the committed one once all of it has arrived (WorkerLost if a worker died
        first). hold=False leaves out the neighbours' copies (a recovery: the new grid takes them)."""
        snap = self.pending
        if snap is None:
            return
        nbytes = group.transfer.snapshot_bytes(snap.size_refs, (self.timeout_s if timeout_s is None else timeout_s)
                                               if wait else 0)
        if nbytes is None:
            return
        snap.nbytes = nbytes
        if hold:
            group.transfer.hold_peer_snapshots(snap.step, snap.refs)
        self.committed, self.pending = snap, None
        self.stall_seconds.append(snap.stall_seconds)
        self.total_seconds.append(time.perf_counter() - snap.started)
        if self.on_commit is not None:
            self.on_commit(snap)

    def drop_pending(self) -> None:
        self.pending = None
