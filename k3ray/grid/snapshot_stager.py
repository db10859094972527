"""A worker's snapshot buffers: the state copied aside at a step boundary, then streamed out chunk by chunk.

A snapshot is taken in two parts so that training stalls only for the first, and at most for a device-to-device copy:
  1. `stage` (at the step boundary): the state's tensors are laid out in byte chunks (k3ray.grid.snapshots.layout).
     The trailing chunks that fit are copied into a reused staging buffer on the device (~4 TB/s on an H200: ~10 ms
     per 20 GB). The leading ones are read from the live tensors while the next step's forward and backward run
     (they read the weights, write none of the state), in one of two ways:
       - into reused pinned host chunks on a side stream; what writes the state next (the optimizer, a restore, a
         reshard) waits for that copy on the device (`StageEngine.state_reads`);
       - or, where those chunks do not exist yet, through the two ring slots as they are streamed out; the next
         write then waits on the host until the last of them is read (a threading.Event).
     The staging buffer is sized once, at the second snapshot (after a step, when the memory the steps need is held
     by the allocator), to what the device has free beside them; the first snapshot is read live whole. Pinned
     chunks are made after a snapshot that streamed its live part, beside the next steps, where the host has room
     for them beside the object store (`pinned_room`): from then on that part costs the step nothing.
  2. `chunks` (on the worker's second thread, overlapping the next step): the skeleton, then every chunk in order
     as host bytes: a pinned chunk as it is, the others device-to-host through one of two pinned ring slots (the
     next one's copy runs while the store takes this one). The caller (Ray's streaming call) copies each value into
     the object store before asking for the next, so a slot is free again when it is reused.
Host memory: two ring slots, and the pinned chunks of what the device cannot stage where there is room; never the
whole state twice. On CPU the state is copied into pageable host chunks at the boundary.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import ray
import torch

from k3ray.grid.snapshots import ALIGN, CHUNK_BYTES, Skeleton, layout, view


class SnapshotStager:
    """One worker's reusable snapshot buffers (grown when a state outgrows them, e.g. more experts homed here after a
    reshard), and the state staged for one step until its chunks are taken."""

    def __init__(self, device: torch.device, device_headroom_bytes: int = 4 << 30, chunk_bytes: int = CHUNK_BYTES,
                 pinned_room: Callable[[], int] | None = None):
        """pinned_room: the bytes of pinned host chunks this worker may hold (asked before making them; None:
        unlimited)."""
        self.device = device
        self.headroom = device_headroom_bytes
        self.chunk_bytes = chunk_bytes
        self.pinned_room = pinned_room
        self.host: list[torch.Tensor] = []  # chunks read live into host memory (pinned on CUDA), by chunk index
        self.ring: list[torch.Tensor] = []  # two pinned slots for the chunks streamed through the ring
        self.staging: torch.Tensor | None = None
        self.snapshots = 0  # staged so far: the first is read live whole (no step has shown its memory yet)
        self.staged: _Staged | None = None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.streaming = threading.Lock()  # held while chunks are read out: staging waits for the buffers

    def _host_chunk(self, k: int, nbytes: int) -> torch.Tensor:
        while len(self.host) <= k:
            self.host.append(torch.empty(0, dtype=torch.uint8))
        if self.host[k].numel() < nbytes:
            self.host[k] = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.host[k] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.stream is not None)
        return self.host[k][:nbytes]

    def _has_host_chunks(self, sizes: list[int]) -> bool:
        return len(self.host) >= len(sizes) and all(self.host[k].numel() >= n for k, n in enumerate(sizes))

    def _first_staged(self, sizes: list[int]) -> int:
        """The first chunk this snapshot stages on the device (len(sizes): none, all read live)."""
        if self.stream is None or self.snapshots == 0:
            return len(sizes)
        if self.staging is None:
            # Only memory nobody holds counts: blocks cached by the allocator are the next step's activations, so
            # staging in them would push that step out of memory on a full device.
            free, _ = torch.cuda.mem_get_info(self.device)
            size = min(sum(sizes), int(free) - self.headroom) // ALIGN * ALIGN
            if size <= 0:
                return len(sizes)
            self.staging = torch.empty(size, dtype=torch.uint8, device=self.device)
        tail = np.cumsum(sizes[::-1])[::-1]  # bytes from chunk k to the end
        fits = np.nonzero(tail <= self.staging.numel())[0]
        return int(fits[0]) if len(fits) else len(sizes)

    @torch.no_grad()
    def stage(self, state: Any, step: int) -> tuple[int, torch.cuda.Event | threading.Event | None]:
        """Lay `state` (live tensors: the state to run `step` from) out and start copying it aside. Returns its size
        in bytes and what whatever writes the live tensors next must wait for: None (copied already), a CUDA event
        (wait on the device), or a host event set once the last live tensor has been streamed out."""
        tree, tensors, sizes = layout(state, self.chunk_bytes)
        with self.streaming:  # a previous snapshot's chunks still being read out (a recovery dropped it) finish first
            if self.staged is not None and isinstance(self.staged.read, threading.Event):
                self.staged.read.set()  # never streamed out (its call was refused): nothing reads those tensors
            skeleton = Skeleton(tree, sizes)
            cut = self._first_staged(sizes)
            self.snapshots += 1
            if self.stream is None:
                host = [self._host_chunk(k, n) for k, n in enumerate(sizes)]
                for t, slot in tensors:
                    view(host[slot.chunk], slot).copy_(t)
                self.staged = _Staged(step, skeleton, len(sizes), None, None, {})
                return sum(sizes), None
            del self.host[cut:]  # staged on the device now: no host copy needed
            base = sum(sizes[:cut])
            starts = _starts(sizes)
            for t, slot in tensors:
                if slot.chunk >= cut:
                    view(self.staging, slot, starts[slot.chunk] - base).copy_(t)
            staged = torch.cuda.Event()
            staged.record()
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # reads the state at this boundary
            live = [(t, slot) for t, slot in tensors if slot.chunk < cut]
            if not self._has_host_chunks(sizes[:cut]):  # streamed from the live tensors through the ring
                by_chunk: dict[int, list] = {}
                for t, slot in live:
                    by_chunk.setdefault(slot.chunk, []).append((t, slot))
                read = threading.Event()
                self.staged = _Staged(step, skeleton, cut, staged, read, by_chunk)
                return sum(sizes), read
            with torch.cuda.stream(self.stream):
                for t, slot in live:
                    view(self.host[slot.chunk], slot).copy_(t, non_blocking=True)
                read = torch.cuda.Event()
                read.record()
            self.staged = _Staged(step, skeleton, cut, staged, read, {})
            return sum(sizes), read

    @torch.no_grad()
    def chunks(self, step: int) -> Iterator[Skeleton | np.ndarray]:
        """The state staged for `step`: its skeleton, then each chunk in order as host bytes (valid until the next
        value is asked for). A call for another step (a stale one, queued before a newer staging) is refused at once
        and leaves the staged state for the call it belongs to."""
        if self.staged is None or self.staged.step != step:
            have = "nothing" if self.staged is None else f"step {self.staged.step}"
            raise RuntimeError(f"snapshot of step {step} asked for, {have} staged")
        staged, self.staged = self.staged, None
        return self._stream_out(staged)

    def _stream_out(self, s: _Staged) -> Iterator[Skeleton | np.ndarray]:
        sizes, starts = s.skeleton.sizes, _starts(s.skeleton.sizes)
        ring = sorted(s.live) + list(range(s.cut, len(sizes)))  # chunks through the ring, in order
        try:
            with self.streaming:
                yield s.skeleton
                if isinstance(s.read, torch.cuda.Event):  # the leading chunks were copied into pinned chunks
                    s.read.synchronize()
                    for k in range(s.cut):
                        yield self.host[k][:sizes[k]].numpy()
                elif s.read is None:  # CPU: copied at the boundary
                    for k in range(len(sizes)):
                        yield self.host[k][:sizes[k]].numpy()
                if ring:
                    self._ring(max(sizes[k] for k in ring))
                    self.stream.wait_event(s.staged)
                    copied = [self._to_ring(0, ring[0], starts[ring[0]] - sum(sizes[:s.cut]), sizes, s.live)]
                    for i, k in enumerate(ring):
                        if i + 1 < len(ring):  # the next chunk's copy runs while the store takes this one
                            nxt = ring[i + 1]
                            copied.append(self._to_ring(i + 1, nxt, starts[nxt] - sum(sizes[:s.cut]), sizes, s.live))
                        copied[i].synchronize()
                        if isinstance(s.read, threading.Event) and k + 1 == s.cut:
                            s.read.set()  # every live tensor read: the optimizer may write them
                        yield self.ring[i % 2][:sizes[k]].numpy()
                if s.live and self.staging is not None:
                    self._make_host_chunks(sizes[:s.cut])
        finally:
            if isinstance(s.read, threading.Event):
                s.read.set()  # also when the stream fails or is dropped: the step must not wait forever

    def _make_host_chunks(self, sizes: list[int]) -> None:
        """Pinned chunks for the live part, beside the next steps, where the host has room: the next snapshot then
        reads it on the device's side stream instead of holding the optimizer up."""
        if self.pinned_room is not None and sum(sizes) > self.pinned_room():
            return
        for k, n in enumerate(sizes):
            self._host_chunk(k, n)

    def _ring(self, nbytes: int) -> None:
        if not self.ring or self.ring[0].numel() < nbytes:
            self.ring = []
            self.ring = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def _to_ring(self, i: int, k: int, staged_at: int, sizes: list[int], live: dict) -> torch.cuda.Event:
        """Start copying chunk k (from the live tensors, else from the staging buffer at byte staged_at) into ring
        slot i % 2."""
        slot_bytes = self.ring[i % 2]
        with torch.cuda.stream(self.stream):
            if k in live:
                for t, slot in live[k]:
                    view(slot_bytes, slot).copy_(t, non_blocking=True)
            else:
                slot_bytes[:sizes[k]].copy_(self.staging[staged_at:staged_at + sizes[k]], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return done


def pinned_room_beside_store() -> int:
    """The bytes of pinned snapshot chunks one worker may hold: its node's memory less the object store's (where the
    snapshots themselves live) and 16 GiB for the processes, shared by the node's GPUs."""
    node = ray.get_runtime_context().get_node_id()
    resources = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == node), {})
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    room = total - resources.get("object_store_memory", 0.0) - (16 << 30)
    return int(max(0.0, room) / max(1.0, resources.get("GPU", 1.0)))


class _Staged:
    """A snapshot staged for `step`, until its chunks are streamed out: chunks cut.. are on the device (ready after
    the `staged` event); the leading ones are in pinned chunks (after the CUDA event `read`) or still live
    (`live`: chunk -> [(tensor, slot)], read through the ring; `read` a threading.Event set once they are)."""

    def __init__(self, step: int, skeleton: Skeleton, cut: int, staged, read, live: dict):
        self.step, self.skeleton, self.cut, self.staged, self.read, self.live = step, skeleton, cut, staged, read, live


def _starts(sizes: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist()
