"""A worker's snapshot buffers: the state copied aside at a step boundary, then streamed out chunk by chunk.

A snapshot is taken in two parts so that training stalls only for the first, and at most for a device-to-device copy:
  1. `stage` (at the step boundary): the state's tensors are laid out in byte chunks (k3ray.grid.snapshots.layout).
     The leading chunks that fit are copied into a reused staging buffer on the device (~4 TB/s on an H200: ~10 ms
     per 20 GB); the rest are copied from the live tensors into reused pinned host chunks on a side stream, while
     the next step's forward and backward run (they read the weights, write none of the state). What writes the
     state next (the optimizer, a restore, a reshard) waits for that transfer on the device
     (`StageEngine.state_reads`), not on the host. The staging buffer is sized once, at the second snapshot (after
     a step, when the memory the steps need is held by the allocator), to what the device has free beside them; the
     first snapshot is read live whole (the first step is long anyway: kernels compile).
  2. `chunks` (on the worker's second thread, overlapping the next step): the skeleton, then every chunk as host
     bytes: a staged chunk goes device-to-host through one of two pinned ring slots (the next one's copy runs while
     the store takes this one), a live one is yielded from its pinned chunk. The caller (Ray's streaming call) copies
     each value into the object store before asking for the next, so a slot is free again when it is reused.
Host memory: the pinned chunks of what the device cannot stage, plus two ring slots; never the whole state twice.
On CPU the state is copied into pageable host chunks at the boundary.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from k3ray.grid.snapshots import ALIGN, CHUNK_BYTES, Skeleton, layout, view


class SnapshotStager:
    """One worker's reusable snapshot buffers (grown when a state outgrows them, e.g. more experts homed here after a
    reshard), and the state staged for one step until its chunks are taken."""

    def __init__(self, device: torch.device, device_headroom_bytes: int = 4 << 30, chunk_bytes: int = CHUNK_BYTES):
        self.device = device
        self.headroom = device_headroom_bytes
        self.chunk_bytes = chunk_bytes
        self.host: list[torch.Tensor] = []  # chunks not staged on the device (pinned on CUDA), by chunk index
        self.ring: list[torch.Tensor] = []  # two pinned slots for the staged chunks' way to the host
        self.staging: torch.Tensor | None = None
        self.snapshots = 0  # staged so far: the first is read live whole (no step has shown its memory yet)
        # (step, skeleton, chunks staged on the device, event after the staging copy, event after the live reads)
        self.staged: tuple[int, Skeleton, int, torch.cuda.Event | None, torch.cuda.Event | None] | None = None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.streaming = threading.Lock()  # held while chunks are read out: staging waits for the buffers

    def _host_chunk(self, k: int, nbytes: int) -> torch.Tensor:
        while len(self.host) <= k:
            self.host.append(torch.empty(0, dtype=torch.uint8))
        if self.host[k].numel() < nbytes:
            self.host[k] = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.host[k] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.stream is not None)
        return self.host[k][:nbytes]

    def _staged_chunks(self, sizes: list[int]) -> int:
        """How many leading chunks this snapshot stages on the device (0: all read live)."""
        if self.stream is None or self.snapshots == 0:
            return 0
        if self.staging is None:
            # Only memory nobody holds counts: blocks cached by the allocator are the next step's activations, so
            # staging in them would push that step out of memory on a full device.
            free, _ = torch.cuda.mem_get_info(self.device)
            size = min(sum(sizes), int(free) - self.headroom) // ALIGN * ALIGN
            if size <= 0:
                return 0
            self.staging = torch.empty(size, dtype=torch.uint8, device=self.device)
        fits = np.cumsum(sizes) <= self.staging.numel()
        return int(fits.argmin()) if not fits.all() else len(sizes)

    @torch.no_grad()
    def stage(self, state: Any, step: int) -> tuple[int, torch.cuda.Event | threading.Event | None]:
        """Lay `state` (live tensors: the state to run `step` from) out and start copying it aside. Returns its size
        in bytes and what whatever writes the live tensors next must wait for: None (copied already), a CUDA event
        (wait on the device), or, for the first snapshot on CUDA (its chunks stream to the store straight from the
        live tensors), a host event set once the last of them is read."""
        tree, tensors, sizes = layout(state, self.chunk_bytes)
        with self.streaming:  # a previous snapshot's chunks still being read out (a recovery dropped it) finish first
            if self.staged is not None and isinstance(self.staged[4], threading.Event):
                self.staged[4].set()  # never streamed out (its call was refused): nothing reads those tensors
            first, skeleton = self.snapshots == 0, Skeleton(tree, sizes)
            on_device = self._staged_chunks(sizes)
            self.snapshots += 1
            if self.stream is None:
                host = [self._host_chunk(k, n) for k, n in enumerate(sizes)]
                for t, slot in tensors:
                    view(host[slot.chunk], slot).copy_(t)
                self.staged = (step, skeleton, 0, None, None, [])
                return sum(sizes), None
            for k in range(min(on_device, len(self.host))):
                self.host[k] = torch.empty(0, dtype=torch.uint8)  # staged on the device now: no host copy needed
            starts = _starts(sizes)
            for t, slot in tensors:
                if slot.chunk < on_device:
                    view(self.staging, slot, starts[slot.chunk]).copy_(t)
            staged = torch.cuda.Event()
            staged.record()
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # reads the state at this boundary
            live = [(t, slot) for t, slot in tensors if slot.chunk >= on_device]
            if first:  # no pinned copy of the whole state: its chunks go through the ring as they are streamed
                read = threading.Event()
                self.staged = (step, skeleton, on_device, staged, read, live)
                return sum(sizes), read
            host = {k: self._host_chunk(k, sizes[k]) for k in range(on_device, len(sizes))}
            with torch.cuda.stream(self.stream):
                for t, slot in live:
                    view(host[slot.chunk], slot).copy_(t, non_blocking=True)
                read = torch.cuda.Event()
                read.record()
            self.staged = (step, skeleton, on_device, staged, read, [])
            return sum(sizes), read

    def _take(self, step: int) -> tuple:
        if self.staged is None or self.staged[0] != step:
            have = "nothing" if self.staged is None else f"step {self.staged[0]}"
            raise RuntimeError(f"snapshot of step {step} asked for, {have} staged")
        staged, self.staged = self.staged[1:], None
        return staged

    @torch.no_grad()
    def chunks(self, step: int) -> Iterator[Skeleton | np.ndarray]:
        """The state staged for `step`: its skeleton, then each chunk as host bytes (valid until the next value is
        asked for). A call for another step (a stale one, queued before a newer staging) is refused at once and
        leaves the staged state for the call it belongs to."""
        return self._stream_out(*self._take(step))

    def _stream_out(self, skeleton: Skeleton, on_device: int, staged, read, live) -> Iterator[Skeleton | np.ndarray]:
        sizes, starts = skeleton.sizes, _starts(skeleton.sizes)
        by_chunk: dict[int, list] = {}
        for t, slot in live:
            by_chunk.setdefault(slot.chunk, []).append((t, slot))
        through_ring = list(range(on_device)) + (sorted(by_chunk) if isinstance(read, threading.Event) else [])
        try:
            with self.streaming:
                yield skeleton
                if through_ring:
                    self._ring(max(sizes[k] for k in through_ring))
                    self.stream.wait_event(staged)
                    copied = [self._to_ring(0, through_ring[0], starts, sizes, by_chunk)]
                    for i, k in enumerate(through_ring):
                        if i + 1 < len(through_ring):  # the next chunk's copy runs while the store takes this one
                            copied.append(self._to_ring(i + 1, through_ring[i + 1], starts, sizes, by_chunk))
                        copied[i].synchronize()
                        if i + 1 == len(through_ring) and isinstance(read, threading.Event):
                            read.set()  # every live tensor read: the optimizer may write them
                        yield self.ring[i % 2][:sizes[k]].numpy()
                if not isinstance(read, threading.Event):  # the rest was copied into pinned chunks at the boundary
                    if read is not None:
                        read.synchronize()
                    for k in range(on_device, len(sizes)):
                        yield self.host[k][:sizes[k]].numpy()
        finally:
            if isinstance(read, threading.Event):
                read.set()  # also when the stream fails or is dropped: the step must not wait forever

    def _ring(self, nbytes: int) -> None:
        if not self.ring or self.ring[0].numel() < nbytes:
            self.ring = []
            self.ring = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def _to_ring(self, i: int, k: int, starts: list[int], sizes: list[int], by_chunk: dict) -> torch.cuda.Event:
        """Start copying chunk k (staged on the device, else from the live tensors) into ring slot i % 2."""
        slot_bytes = self.ring[i % 2]
        with torch.cuda.stream(self.stream):
            if k in by_chunk:
                for t, slot in by_chunk[k]:
                    view(slot_bytes, slot).copy_(t, non_blocking=True)
            else:
                slot_bytes[:sizes[k]].copy_(self.staging[starts[k]:starts[k] + sizes[k]], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return done


def _starts(sizes: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist()
