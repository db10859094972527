"""A worker's snapshot buffers: the state copied aside at a step boundary, then streamed out chunk by chunk.

A snapshot is taken in two parts so that training stalls only for the first, which issues copies and waits for none:
  1. `stage` (at the step boundary): the state's tensors are laid out in byte chunks (k3ray.grid.snapshots.layout).
     The trailing chunks that fit are copied into a reused staging buffer on the device, on a side stream while the
     next step's forward and backward run (they read the weights, write none of the state). The leading ones, which
     do not fit, are read from the live tensors as they are streamed out. What writes the state next (the
     optimizer, a restore, a reshard) waits for those reads (`StageEngine.state_reads`): on the device for the
     staging copy when every chunk was staged, else on the host until the last live chunk has been read (a
     threading.Event). The staging buffer is sized once, after the engine has trained a step (the memory the
     steps need is then held by the allocator), to what the device has free beside them: beside the steps where
     the store is warmed before the first snapshot (`reserve`), else at that snapshot; a snapshot before any step
     (a resize at the job's first boundary) is read live whole.
  2. `chunks` (on the worker's second thread, overlapping the next step): the skeleton, then every chunk in order
     as host bytes, device-to-host through one of two pinned ring slots (the next one's copy runs while the store
     takes this one); the live chunks come first, so the optimizer is held up as little as possible. The caller
     (Ray's streaming call) copies each value into the object store before asking for the next, so a slot is free
     again when it is reused.
Host memory: the two ring slots; never a host copy of the whole state beside the store's (pinning one costs tens of
GB and seconds of stalled device work, measured on an H200). On CPU the state is copied into host chunks at the
boundary.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from k3ray.grid.snapshots import ALIGN, CHUNK_BYTES, Skeleton, layout, view

log = logging.getLogger("k3ray.snapshots")


class SnapshotStager:
    """One worker's reusable snapshot buffers (grown when a state outgrows them, e.g. more experts homed here after a
    reshard), and the state staged for one step until its chunks are taken."""

    def __init__(self, device: torch.device, device_headroom_bytes: int = 4 << 30, chunk_bytes: int = CHUNK_BYTES):
        self.device = device
        self.headroom = device_headroom_bytes
        self.chunk_bytes = chunk_bytes
        self.host: list[torch.Tensor] = []  # CPU: the chunks copied at the boundary
        self.ring: list[torch.Tensor] = []  # CUDA: two pinned slots for the chunks' way to the host
        self.staging: torch.Tensor | None = None
        self.staged: _Staged | None = None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.streaming = threading.Lock()  # held while chunks are read out: staging waits for the buffers
        self.sizing = threading.Lock()  # the staging buffer is sized once, at the boundary or beside the steps
        self.sized = False
        self.stage_ms: dict[str, float] = {}  # the last stage's parts (where a slow boundary went)

    def _host_chunk(self, k: int, nbytes: int) -> torch.Tensor:
        while len(self.host) <= k:
            self.host.append(torch.empty(0, dtype=torch.uint8))
        if self.host[k].numel() < nbytes:
            self.host[k] = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self.host[k] = torch.empty(nbytes, dtype=torch.uint8)
        return self.host[k][:nbytes]

    def reserve(self, state_bytes: int) -> None:
        """Size the staging buffer for snapshots of `state_bytes` now, once a step has shown the memory the steps
        use: called beside the steps (the worker's second thread), so that no boundary waits for it: measuring the
        free memory and allocating the buffer may wait for the device's queued work (sized at the boundary, the
        staging held training ~35 ms after an optimizer, H100; sized beside the steps, the sizing took 0.2 ms)."""
        if self.stream is not None:
            self._size(state_bytes)

    def _size(self, state_bytes: int) -> None:
        with self.sizing:
            if self.sized:
                return
            self.sized = True
            # Only memory nobody holds counts: blocks cached by the allocator are the next step's activations, so
            # staging in them would push that step out of memory on a full device.
            free, _ = torch.cuda.mem_get_info(self.device)
            size = min(state_bytes, int(free) - self.headroom) // ALIGN * ALIGN
            if size <= 0:
                log.warning("snapshots: no room to stage on the device, %.1f GiB read from the live state",
                            state_bytes / 2**30)
                return
            self.staging = torch.empty(size, dtype=torch.uint8, device=self.device)
            if size < state_bytes:  # the optimizer after each snapshot waits for the rest (StageEngine.state_reads)
                log.warning("snapshots: %.1f GiB staged on the device, %.1f GiB read from the live state (no room)",
                            size / 2**30, (state_bytes - size) / 2**30)

    def _first_staged(self, sizes: list[int], after_a_step: bool) -> int:
        """The first chunk this snapshot stages on the device (len(sizes): none, all read live)."""
        if not self.sized and not after_a_step:
            return len(sizes)  # no step has shown its memory yet: what is free now is the next step's
        self._size(sum(sizes))  # sized here only where no reserve() came first
        if self.staging is None:
            return len(sizes)
        tail = np.cumsum(sizes[::-1])[::-1]  # bytes from chunk k to the end
        fits = np.nonzero(tail <= self.staging.numel())[0]
        return int(fits[0]) if len(fits) else len(sizes)

    @torch.no_grad()
    def stage(self, state: Any, step: int, after_a_step: bool = True,
              boundary: torch.cuda.Event | None = None) -> tuple[int, torch.cuda.Event | threading.Event | None]:
        """Lay `state` (live tensors: the state to run `step` from) out and start copying it aside. Returns its size
        in bytes and what whatever writes the live tensors next must wait for: None (copied already), a CUDA event
        (wait on the device), or a host event set once the last live tensor has been streamed out. after_a_step:
        whether the engine has trained a step on this device (the staging buffer is sized only then). boundary:
        where on the device the state is complete, when the next step's work already follows it (the copies run
        beside that work); None: all the work queued so far."""
        t0 = time.perf_counter()
        tree, tensors, sizes = layout(state, self.chunk_bytes)
        t_layout = time.perf_counter()
        with self.streaming:  # a previous snapshot's chunks still being read out (a recovery dropped it) finish first
            t_lock = time.perf_counter()
            if self.staged is not None and isinstance(self.staged.read, threading.Event):
                self.staged.read.set()  # never streamed out (its call was refused): nothing reads those tensors
            skeleton = Skeleton(tree, sizes)
            cut = len(sizes) if self.stream is None else self._first_staged(sizes, after_a_step)
            t_sized = time.perf_counter()
            self.stage_ms = {"layout": 1e3 * (t_layout - t0), "lock": 1e3 * (t_lock - t_layout),
                             "sizing": 1e3 * (t_sized - t_lock)}
            if self.stream is None:
                host = [self._host_chunk(k, n) for k, n in enumerate(sizes)]
                torch._foreach_copy_([view(host[slot.chunk], slot) for _, slot in tensors], [t for t, _ in tensors])
                self.staged = _Staged(step, skeleton, len(sizes), None, {})
                return sum(sizes), None
            base, starts = sum(sizes[:cut]), _starts(sizes)
            live: dict[int, list] = {}
            to, of = [], []  # the staging buffer's views and the live tensors copied into them
            for t, slot in tensors:
                if slot.chunk >= cut:
                    to.append(view(self.staging, slot, starts[slot.chunk] - base))
                    of.append(t)
                else:
                    live.setdefault(slot.chunk, []).append((t, slot))
            t_views = time.perf_counter()
            if boundary is None:  # reads the state at this boundary
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            else:
                self.stream.wait_event(boundary)
            t_wait = time.perf_counter()
            with torch.cuda.stream(self.stream):
                if to:  # one call for hundreds of tensors: the boundary waits for their launches, not their copies
                    torch._foreach_copy_(to, of, non_blocking=True)
                t_copies = time.perf_counter()
                staged = torch.cuda.Event()
                staged.record()
            self.stage_ms.update(views=1e3 * (t_views - t_sized), wait=1e3 * (t_wait - t_views),
                                 copies=1e3 * (t_copies - t_wait), record=1e3 * (time.perf_counter() - t_copies))
            read = threading.Event() if live else staged
            self.staged = _Staged(step, skeleton, cut, read, live)
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
        sizes = s.skeleton.sizes
        try:
            with self.streaming:
                yield s.skeleton
                if self.stream is None:  # CPU: copied at the boundary
                    for k, n in enumerate(sizes):
                        yield self.host[k][:n].numpy()
                    return
                self._ring(max(sizes))
                base = sum(sizes[:s.cut])  # the staging buffer's first byte is chunk cut's
                staged_at = [start - base for start in _starts(sizes)]
                copied = [self._to_ring(0, staged_at[0], sizes[0], s.live)]
                for k in range(len(sizes)):
                    if k + 1 < len(sizes):  # the next chunk's copy runs while the store takes this one
                        copied.append(self._to_ring(k + 1, staged_at[k + 1], sizes[k + 1], s.live))
                    copied[k].synchronize()
                    if k + 1 == s.cut and isinstance(s.read, threading.Event):
                        s.read.set()  # every live tensor read: the optimizer may write them
                    yield self.ring[k % 2][:sizes[k]].numpy()
        finally:
            if isinstance(s.read, threading.Event):
                s.read.set()  # also when the stream fails or is dropped: the step must not wait forever

    def _ring(self, nbytes: int) -> None:
        if not self.ring or self.ring[0].numel() < nbytes:
            self.ring = []
            self.ring = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def _to_ring(self, k: int, staged_at: int, nbytes: int, live: dict) -> torch.cuda.Event:
        """Start copying chunk k (from the live tensors, else from the staging buffer at byte staged_at) into ring
        slot k % 2 (after everything issued on the side stream before it: the staging copy included)."""
        slot_bytes = self.ring[k % 2]
        with torch.cuda.stream(self.stream):
            if k in live:
                for t, slot in live[k]:
                    view(slot_bytes, slot).copy_(t, non_blocking=True)
            else:
                slot_bytes[:nbytes].copy_(self.staging[staged_at:staged_at + nbytes], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return done


class _Staged:
    """A snapshot staged for `step`, until its chunks are streamed out: chunks cut.. are on the device (on CPU, all
    in host chunks); the leading ones are still live (`live`: chunk -> [(tensor, slot)]). `read`: what the next
    write of the state waits for."""

    def __init__(self, step: int, skeleton: Skeleton, cut: int, read, live: dict):
        self.step, self.skeleton, self.cut, self.read, self.live = step, skeleton, cut, read, live


def _starts(sizes: list[int]) -> list[int]:
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist()
