"""Snapshot packing (k3ray.grid.snapshots): a nested state survives pack -> object store -> unpack bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from k3ray.grid.snapshot_stager import SnapshotStager
from k3ray.grid.snapshots import ALIGN, Packed, Skeleton, StoreFit, as_state, layout, unpack


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "stage": 1, "layers": [2, 3], "lr_scale": 0.5, "opt_steps": 7,
        "dense": {"a": torch.randn(3, 5, generator=g, dtype=torch.float64),
                  "b": torch.randn(7, generator=g).to(torch.bfloat16), "empty": torch.zeros(0, 4)},
        "experts": {2: {"expert_ids": [0, 3], "w1": torch.randn(2, 4, 6, generator=g),
                        "opt": {"w1": {"m": torch.rand(2, 4, 6, generator=g), "master": torch.randn(2, 4, 6, generator=g)},
                                "w2": None}}},
        "router_bias": {2: torch.randn(4, generator=g)}, "scalar": torch.tensor(3.5),
    }


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _streamed(stager: SnapshotStager, step: int) -> Packed:
    """What the store receives from a worker's snapshot call: the skeleton, then the chunks (copied, as the store
    does, before the next is read)."""
    values = iter(stager.chunks(step))
    skeleton = next(values)
    assert isinstance(skeleton, Skeleton)
    return Packed(skeleton.tree, [chunk.copy() for chunk in values])


def test_layout_aligns_every_tensor():
    _, tensors, sizes = layout(_state(0))
    assert all(slot.offset % ALIGN == 0 and slot.chunk == 0 for _, slot in tensors)
    assert sizes[0] % ALIGN == 0 and sizes[0] >= sum(t.numel() * t.element_size() for t, _ in tensors)


def test_layout_in_chunks_keeps_each_tensor_whole_and_a_large_tensor_alone():
    state = {"a": torch.zeros(40), "b": torch.zeros(40), "big": torch.zeros(1000), "c": torch.zeros(8)}
    tree, tensors, sizes = layout(state, chunk_bytes=384)
    chunk_of = {name: tree[name].chunk for name in state}
    assert chunk_of == {"a": 0, "b": 0, "big": 1, "c": 2}  # 192 + 192 bytes (aligned) fill the first chunk
    assert sizes == [384, 4032, 64]
    assert unpack(Packed(tree, [np.zeros(n, dtype=np.uint8) for n in sizes]))["big"].shape == (1000,)


def test_stage_then_packed_round_trips_and_buffers_are_reused():
    stager = SnapshotStager(torch.device("cpu"), chunk_bytes=256)
    state = _state(1)
    stager.stage(state, 1)
    state["dense"]["a"].add_(1.0)  # training goes on after staging: the snapshot keeps the staged values
    packed = _streamed(stager, 1)
    assert len(packed.data) > 2  # in chunks
    _assert_same(_state(1), unpack(packed))
    bufs = [b.data_ptr() for b in stager.host]
    stager.stage(_state(2), 2)
    _assert_same(_state(2), unpack(_streamed(stager, 2)))
    assert [b.data_ptr() for b in stager.host] == bufs  # same sizes: no new allocation


def test_a_stale_packed_call_for_another_step_is_refused_and_leaves_the_staged_state():
    stager = SnapshotStager(torch.device("cpu"))
    stager.stage(_state(5), 5)
    with pytest.raises(RuntimeError, match="snapshot of step 4 asked for, step 5 staged"):
        stager.chunks(4)  # queued for the previous snapshot: must not consume this one
    _assert_same(_state(5), unpack(_streamed(stager, 5)))


def test_packed_through_object_store_is_zero_copy_and_exact(ray_cluster):
    import ray

    stager = SnapshotStager(torch.device("cpu"))
    stager.stage(_state(3), 3)
    ref = ray.put(_streamed(stager, 3))
    back = ray.get(ref)
    assert isinstance(back, Packed) and not back.data[0].flags.writeable  # mapped from the object store
    _assert_same(_state(3), as_state(back))
    plain = _state(4)
    assert as_state(plain) is plain


def test_a_snapshot_streamed_by_a_worker_call_arrives_in_chunks_and_restores_exactly(ray_cluster):
    """The Ray path: a streaming actor call (as Worker.snapshot) delivers the skeleton and the chunks, owned by
    the caller; the part passes to another actor, which maps it."""
    import ray

    from k3ray.grid.snapshots import SnapshotPart

    @ray.remote
    class Holder:
        def __init__(self):
            self.stager = SnapshotStager(torch.device("cpu"), chunk_bytes=256)

        def stage(self, state, step):
            return self.stager.stage(state, step)[0]

        @ray.method(num_returns="streaming")
        def snapshot(self, step):
            yield from self.stager.chunks(step)

        def read(self, part):
            return as_state(part)

    holder = Holder.remote()
    nbytes = ray.get(holder.stage.remote(_state(6), 6))
    part = SnapshotPart(holder.snapshot.remote(6), nbytes)
    ray.get(part.done)
    part.collect()
    assert len(part.refs) > 3 and part.nbytes == nbytes
    # collected (its stream taken off): still a valid input of a commit, whose wait finds it arrived at once
    assert part.done == part.refs[-1] and ray.wait([part.done], timeout=0)[0]
    part.collect()  # collecting again changes nothing
    _assert_same(_state(6), ray.get(holder.read.remote(part)))
    _assert_same(_state(6), as_state(part))
    stale = SnapshotPart(holder.snapshot.remote(5), nbytes)  # nothing staged for step 5: the stream carries the error
    ray.get(stale.done)
    with pytest.raises(Exception, match="snapshot of step 5 asked for, nothing staged"):
        stale.collect()


GiB = 2**30


def test_stores_that_hold_two_snapshots_of_their_parts_pass_and_a_small_one_is_named_in_one_line():
    from k3ray.grid.snapshots import store_fit
    assert store_fit([10 * GiB], ["a"], {"a": 25 * GiB}) is None
    fit = store_fit([10 * GiB], ["a"], {"a": 24 * GiB})  # Ray spills past 80 % of a store: two do not fit below it
    assert fit.one_at_a_time and not fit.spills
    # smaller than one snapshot of the parts: one at a time, spilling to disk, and the line says what to give it
    fit = store_fit([29 * GiB, 29 * GiB], ["a", "a"], {"a": 20 * GiB})
    assert "\n" not in fit.line and fit.one_at_a_time and fit.spills
    assert "58.0 GiB of parts" in fit.line and "holds 16.0 GiB before it spills" in fit.line
    assert "spill to local disk" in fit.line and "145 GiB" in fit.line and "K3RAY_OBJECT_STORE_GB" in fit.line
    fit = store_fit([54 * GiB], ["a"], {"a": 68 * GiB})
    assert fit.one_at_a_time and not fit.spills and "fit one at a time" in fit.line
    assert "newest durable checkpoint or the job's start point" in fit.line
    # on two nodes each also holds its neighbour's committed parts
    assert store_fit([10 * GiB, 10 * GiB], ["a", "b"], {"a": 30 * GiB, "b": 30 * GiB}).one_at_a_time
    assert store_fit([10 * GiB, 10 * GiB], ["a", "b"], {"a": 38 * GiB, "b": 38 * GiB}) is None


class SlowStoreGroup:
    """A worker group whose snapshots arrive only when told (`arrive`), and whose store is too small."""
    pp, ep = 1, 2

    def __init__(self, one_at_a_time: bool = False):
        self.one_at_a_time = one_at_a_time
        self.held: list[int] = []
        self.arrived: set[int] = set()
        self.begun: list[int] = []
        self.transfer = self  # the group's state-transfer part: this fake plays it itself

    def stage_snapshot(self, step):
        self.begun.append(step)
        return [(4, 0.0)] * 2, StoreFit("snapshots need more store", self.one_at_a_time, False)

    def stream_snapshot(self, step, staged):
        return [step] * 2

    def snapshot_bytes(self, parts, timeout_s):
        if parts[0] in self.arrived or timeout_s != 0:
            return 8
        return None

    def hold_peer_snapshots(self, step, refs):
        self.held.append(step)


def test_a_snapshot_due_while_the_previous_one_still_arrives_is_skipped_not_waited_for():
    from k3ray.grid.snapshots import Snapshots
    skips = []
    snaps, group = Snapshots(on_skip=lambda step, arriving: skips.append((step, arriving))), SlowStoreGroup()
    snaps.start_at(0, guard=None, restore=None)
    assert snaps.take(group, 1, guard=None)
    assert not snaps.take(group, 10, guard=None)  # step 1's bytes have not arrived: no wait, no new staging
    assert group.begun == [1] and snaps.skipped == [10] and skips == [(10, 1)]
    assert snaps.committed.step == 0 and snaps.pending.step == 1
    group.arrived.add(1)
    assert snaps.take(group, 20, guard=None)  # arrived meanwhile: committed, and the next one starts
    assert snaps.committed.step == 1 and snaps.pending.step == 20 and group.begun == [1, 20]
    assert snaps.take(group, 30, guard=None, wait=True)  # a resize or recovery waits for this boundary's state
    assert snaps.committed.step == 30 and snaps.pending is None
    assert snaps.warnings == ["snapshots need more store"]  # said once, however often the group says it
    assert group.held == [1, 20, 30]  # the neighbours map each committed one


def test_a_store_that_holds_one_snapshot_falls_back_on_the_start_or_the_newest_checkpoint_while_one_arrives():
    from k3ray.grid.snapshots import Snapshots, StartPoint
    snaps, group = Snapshots(), SlowStoreGroup(one_at_a_time=True)
    snaps.start_at(0, guard=None, restore=None)
    assert snaps.take(group, 4, guard=None, wait=True)
    assert snaps.one_at_a_time and snaps.committed.step == 4 and group.held == []  # no neighbours' copies
    group.arrived.add(10)
    assert snaps.take(group, 10, guard=None)
    assert snaps.committed is snaps.base and snaps.committed.step == 0  # step 4's store space is step 10's
    snaps.durable(StartPoint(6, guard=None, restore={0: ["part"]}))  # a durable checkpoint of step 6 committed
    assert snaps.committed.step == 6 and snaps.committed.sources() == {0: ["part"]}
    assert snaps.take(group, 20, guard=None)  # step 10's arrived: committed, then dropped for step 20's
    assert snaps.committed.step == 6 and snaps.pending.step == 20
    assert len(snaps.stall_seconds) == len(snaps.total_seconds) == 2  # steps 4 and 10 were committed
    snaps.commit(group, wait=True)
    snaps.durable(StartPoint(12, guard=None, restore={0: ["older"]}))  # older than the snapshot held: kept as base
    assert snaps.committed.step == 20 and snaps.base.step == 12


def test_a_snapshot_whose_workers_answer_pings_but_not_in_time_is_abandoned_not_a_lost_worker():
    from k3ray.grid.calls import WorkerSlow
    from k3ray.grid.snapshots import Snapshots

    class SpilledGroup(SlowStoreGroup):
        def snapshot_bytes(self, parts, timeout_s):
            if timeout_s:
                raise WorkerSlow({1}, "no answer to snapshot within 30s, but they answer pings")
            return None

    snaps, group = Snapshots(), SpilledGroup()
    snaps.start_at(0, guard=None, restore=None)
    assert snaps.take(group, 4, guard=None)
    snaps.commit(group, wait=True, timeout_s=30)
    assert snaps.pending is None and snaps.committed.step == 0 and snaps.abandoned == [4]
    assert snaps.summary()["abandoned"] == [4]


def test_the_optimizers_wait_for_live_reads_is_kept_per_snapshot_and_summarised():
    from k3ray.grid.snapshots import Snapshots
    snaps, group = Snapshots(), SlowStoreGroup()
    snaps.start_at(0, guard=None, restore=None)
    snaps.optimizer_waited(0, 9.0)  # step 0 runs from the start point: no snapshot read, nothing counted
    assert snaps.take(group, 10, guard=None)
    snaps.optimizer_waited(10, 0.25)  # step 10's optimizer waited for the part of its snapshot read live
    snaps.optimizer_waited(11, 0.0)  # no snapshot at 11's boundary
    group.arrived.add(10)
    assert snaps.take(group, 20, guard=None)
    snaps.optimizer_waited(20, 0.05)
    assert snaps.read_wait_seconds == [0.25, 0.05]
    summary = snaps.summary()
    assert summary["read_wait_ms_max"] == pytest.approx(250.0)
    assert summary["read_wait_ms_median"] == pytest.approx(150.0)


def _bf16_engine(seed: int, generation: int):
    from k3ray.config import load_config
    from k3ray.control.local_nodes import free_port
    from k3ray.parallel.engine import StageEngine
    cfg = load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 1, "model.dtype": "bfloat16",
                                            "train.seed": seed, "train.eval_batches": 1, "model.n_layers": 2,
                                            "data.micro_batch_size": 1, "data.seq_len": 16,
                                            "parallel.micro_batches": 1})
    engine = StageEngine(cfg, 0, 0, [0] * cfg.model.n_experts, 1)
    engine.init_process_groups(f"tcp://127.0.0.1:{free_port()}", "gloo", generation)
    return engine


def test_a_bf16_snapshot_leaves_out_the_parameters_its_masters_round_to_and_restores_them_bit_for_bit():
    """bf16 training: every parameter is its fp32 master's rounding, so a snapshot carries the master only (12 of
    the 14 bytes a parameter holds) and a restore rounds it again, exactly."""
    from k3ray.parallel.shards import select_experts
    trained = _bf16_engine(0, 1)
    try:
        trained.train_step(0, 0)
        stager = SnapshotStager(torch.device("cpu"))
        nbytes, _ = stager.stage(trained.state_tensors(rounded_params=False), 1)
        whole = sum(layout(trained.state_tensors(), 1 << 20)[2])
        expected, loss = trained.state_dict(), trained.train_step(1, 1)["loss"]
    finally:
        trained.leave_process_groups()
    state = as_state(_streamed(stager, 1))
    assert not state["dense"] and all(p["w1"] is None and p["w2"] is None for p in state["experts"].values())
    assert nbytes < 0.9 * whole
    fresh = _bf16_engine(1, 2)  # another seed: every weight it ends with comes from the snapshot
    try:
        # each layer's experts from two old shards, odd ids first: a restore onto another expert split
        halves = {layer: [select_experts(p, {e for e in p["expert_ids"] if e % 2 == k}) for k in (1, 0)]
                  for layer, p in state["experts"].items()}
        fresh.load_state(state, halves)
        _assert_same(expected, fresh.state_dict())
        assert fresh.train_step(1, 1)["loss"] == loss
    finally:
        fresh.leave_process_groups()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device staging and the side-stream copy need CUDA")
def test_cuda_snapshots_stage_what_fits_read_the_rest_live_and_a_write_after_the_fence_does_not_reach_them():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    state = {"a": torch.randn(1 << 20, device=dev, generator=g), "b": torch.randn(1 << 22, device=dev, generator=g)}
    stager = SnapshotStager(dev, chunk_bytes=4 << 20)  # "a" and "b" in chunks of their own
    waits = []
    for step in range(4):
        if step == 1:  # room on the device for "b" alone: "a" is read live, as it streams
            stager.staging, stager.sized = torch.empty(state["b"].numel() * 4, dtype=torch.uint8, device=dev), True
        if step == 3:  # room for both: all staged
            stager.staging = torch.empty(sum(t.numel() * 4 for t in state.values()), dtype=torch.uint8, device=dev)
        want = {k: v.cpu() for k, v in state.items()}
        nbytes, reading = stager.stage(state, step, after_a_step=step > 0)
        assert nbytes >= 5 * (1 << 22) and reading is not None
        with ThreadPoolExecutor(1) as pool:  # the worker's second thread streams while the step goes on
            streamed = pool.submit(_streamed, stager, step)
            if isinstance(reading, threading.Event):  # read live as it streams: the optimizer waits on the host
                assert reading.wait(60)
                waits.append("host")
            else:
                torch.cuda.current_stream().wait_event(reading)  # what the optimizer does before it writes
                waits.append("device")
            for t in state.values():
                t.mul_(2.0)
            _assert_same(want, unpack(streamed.result()))
    assert stager.staged is None
    # the one before any step and those with "a" live hold the optimizer until it is read; then nothing is live
    assert waits == ["host", "host", "host", "device"]
    # sized beside the steps (the store's warming, after a step): the boundary stages into it and sizes nothing
    ahead = SnapshotStager(dev, chunk_bytes=4 << 20)
    ahead.reserve(sum(t.numel() * 4 for t in state.values()) + 4096)
    buffer = ahead.staging
    assert ahead.sized and buffer is not None
    _, reading = ahead.stage(state, 4, after_a_step=True)
    assert ahead.staging is buffer and isinstance(reading, torch.cuda.Event)
    want = {k: v.cpu() for k, v in state.items()}
    torch.cuda.current_stream().wait_event(reading)
    _assert_same(want, unpack(_streamed(ahead, 4)))


def test_an_auto_cadence_defers_a_snapshot_due_while_the_previous_one_arrives_and_counts_no_skip():
    from k3ray.grid.snapshots import Snapshots
    snaps, group = Snapshots(), SlowStoreGroup()
    assert snaps.take(group, 5, guard=None)
    assert not snaps.take(group, 6, guard=None, defer=True)  # step 5's still arriving: the next boundary takes it
    assert snaps.skipped == [] and snaps.pending.step == 5
    group.arrived.add(5)
    assert snaps.take(group, 7, guard=None, defer=True) and snaps.committed.step == 5 and snaps.pending.step == 7
