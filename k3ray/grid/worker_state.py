"""A Worker's state transfer (k3ray.grid.worker owns one): in-memory snapshots (staged at a step boundary, packed
beside the next step), the neighbours' snapshot copies it keeps mapped, restores from snapshots or checkpoint parts
of any old grid, and durable checkpoint parts written in the background (k3ray.io.checkpoint)."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import ray

from k3ray.grid.packed_restore import restore_weights, weights_only
from k3ray.grid.snapshot_stager import SnapshotStager
from k3ray.grid.snapshots import Packed, SnapshotPart, as_state
from k3ray.grid.worker_seat import WorkerSeat
from k3ray.io.checkpoint import AsyncWriter, part_name

log = logging.getLogger("k3ray.worker")
# The store is warmed a piece at a time, and ray.put holds the GIL while it copies a piece in: the training thread
# (a snapshot's staging, a step's launches) waits for one piece at most (256 MB held it 129 ms on a 2-core host).
WARM_PIECE_BYTES = 16 << 20
SLOW_STAGE_S = 0.05  # a boundary's staging longer than this is logged with its parts


class WorkerState:
    def __init__(self, seat: WorkerSeat):
        self.seat = seat
        self.stager: SnapshotStager | None = None  # made where the store is warmed, else on the first snapshot
        self.making_stager = threading.Lock()  # the two threads that may make it
        self.peer_snapshots: dict[int, tuple[int, Packed]] = {}  # world rank -> (step, its snapshot)
        self.writer: AsyncWriter | None = None  # made on first use
        self.warming = threading.Lock()  # held while warm_store holds store space: a snapshot's chunks wait for it
        self.stop_warming = threading.Event()  # a snapshot was staged: warming ends after its current piece

    # -- snapshots -----------------------------------------------------------------------------------------------
    def stage_snapshot(self, step: int) -> tuple[int, float]:
        """Copy the state to run `step` from aside (the short part, at the step boundary); returns its size in bytes
        and the seconds this worker took (the part of training's stall spent here, not in the call's way). Dense
        state only from EP rank 0 of the stage: the other EP ranks hold identical copies, and restores read it from
        rank 0's. Parameters an fp32 master stands for are left out (a restore rounds the master)."""
        t0 = time.perf_counter()
        engine = self.seat.engine
        self.stop_warming.set()
        state = engine.state_tensors(dense=engine.ep_rank == 0, rounded_params=False)
        t_state = time.perf_counter()
        stager = self._stager()
        nbytes, still_reading = stager.stage(state, step, after_a_step=engine.steps_trained > 0,
                                             boundary=engine.boundary_event())
        if still_reading is not None:
            engine.state_reads.append(still_reading)
        seconds = time.perf_counter() - t0
        if seconds > SLOW_STAGE_S:
            parts = {"state": 1e3 * (t_state - t0), **stager.stage_ms}
            log.warning("snapshot of step %d: staging held training %.0f ms (%s ms)", step, 1e3 * seconds,
                        ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
        return nbytes, seconds

    def _stager(self) -> SnapshotStager:
        with self.making_stager:
            self.stager = self.stager or SnapshotStager(self.seat.engine.device)
            return self.stager

    def snapshot_chunks(self, step: int):
        """The staged state of `step`: its skeleton, then its chunks as host bytes (streamed beside the next step),
        once the store space a warm_store held is free again."""
        with self.warming:
            pass
        return self.stager.chunks(step)

    def warm_store(self, most_bytes: int) -> tuple[int, float]:
        """Write zeros of this worker's snapshot size (at most `most_bytes`) into its node's object store, a piece at
        a time, then free them all: the store's pages are then mapped in this process, and the first snapshot
        writes into them as fast as every later one (a first write into a store's page costs 6-10x a later one:
        benchmarks/store_pages.py). Only before this worker's first snapshot; stops early, freeing what it wrote,
        once a snapshot is staged. Returns the bytes written and the seconds it took."""
        if self.stop_warming.is_set():
            return 0, 0.0
        engine = self.seat.engine
        state_bytes = _snapshot_bytes(engine)
        if engine.steps_trained > 0:  # the staging buffer sized here, beside the steps, not at the first boundary
            # 1 % over the estimate: the router biases, alignment and the optimizer's counters it leaves out
            self._stager().reserve(state_bytes * 101 // 100)
        target = min(most_bytes, state_bytes)
        zeros = np.zeros(min(WARM_PIECE_BYTES, max(target, 1)), dtype=np.uint8)
        t0, held = time.perf_counter(), []
        with self.warming:
            while len(held) * zeros.nbytes < target and not self.stop_warming.is_set():
                held.append(ray.put(zeros))
            written = len(held) * zeros.nbytes
            del held  # freed: the store keeps the pages for its next objects
        seconds = time.perf_counter() - t0
        log.info("object store warmed: %.2f GiB in %.2f s", written / 2**30, seconds)
        return written, seconds

    def hold_peer_snapshot(self, rank: int, step: int, part: SnapshotPart) -> bool:
        """Keep a neighbour's snapshot mapped, so a copy of it lives on this node too (it survives the loss of the
        neighbour's node; on one node it is the same memory, no copy)."""
        self.peer_snapshots = {r: v for r, v in self.peer_snapshots.items() if v[0] == step}
        self.peer_snapshots[rank] = (step, part.packed())
        return True

    def drop_peer_snapshots(self) -> None:
        """Standing by: the neighbours' copies are no longer this worker's to keep. (Taking a new place keeps them:
        the restore that follows a regroup reads them, and they may be the only copies of a lost node's parts.)"""
        self.peer_snapshots = {}

    def restore(self, *states) -> bool:
        """Load the stage's state from the snapshots or checkpoint parts of every EP rank of an old grid of any EP
        size: dense state from the first (they are identical), the experts homed here from all of them."""
        if len(states) == 1 and isinstance(states[0], Packed) and weights_only(states[0].tree):
            restore_weights(self.seat.engine, states[0])  # serving's held weights: in bulk
            return True
        states = [as_state(s) for s in states]
        self.seat.engine.load_state(states[0], {layer: [s["experts"][layer] for s in states]
                                                for layer in states[0]["experts"]})
        return True

    # -- durable checkpoints --------------------------------------------------------------------------------------
    def save_checkpoint(self, root: str, step: int) -> bool:
        """Copy the state now (training may go on) and write it in the background as this rank's part. The dense
        state goes into EP rank 0's part only: every EP rank of a stage holds the same, and restores read rank 0's."""
        self.writer = self.writer or AsyncWriter()
        engine = self.seat.engine
        self.writer.submit(root, step, part_name(engine.pp_rank * engine.ep + engine.ep_rank),
                           engine.state_dict(dense=engine.ep_rank == 0))
        return True

    def checkpoint_parts(self) -> list[dict]:
        """Wait for this worker's pending part writes; their PartInfos as dicts."""
        return [] if self.writer is None else [p.to_json() for p in self.writer.wait()]

    def forget_writes(self) -> None:
        """The grid was left: the checkpoint parts being written are abandoned with their checkpoint."""
        if self.writer is not None:
            self.writer.forget()

    def state(self) -> dict:
        """The whole state on the host (k3ray.parallel.engine.StageEngine.state_dict)."""
        return self.seat.engine.state_dict()


def _snapshot_bytes(engine) -> int:
    """About the size of this worker's snapshot, from its parameters alone (the optimizer's state is the step's to
    write, on another thread): each parameter as its fp32 master (or itself) and two moments, dense ones only on
    EP rank 0 (stage_snapshot)."""
    params = engine.params if engine.ep_rank == 0 else engine.experts
    return sum(3 * p.numel() * max(4, p.element_size()) for p in params.values())
