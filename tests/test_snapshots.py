"""Snapshot packing (k3ray.grid.snapshots): a nested state survives pack -> object store -> unpack bit for bit."""
from __future__ import annotations

import pytest
import torch

from k3ray.grid.snapshots import ALIGN, Packed, SnapshotStager, as_state, layout, unpack


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


def test_layout_aligns_every_tensor():
    _, tensors, total = layout(_state(0))
    assert all(slot.offset % ALIGN == 0 for _, slot in tensors)
    assert total % ALIGN == 0 and total >= sum(t.numel() * t.element_size() for t, _ in tensors)


def test_stage_then_packed_round_trips_and_buffers_are_reused():
    stager = SnapshotStager(torch.device("cpu"))
    state = _state(1)
    stager.stage(state, 1)
    state["dense"]["a"].add_(1.0)  # training goes on after staging: the snapshot keeps the staged values
    _assert_same(_state(1), unpack(stager.packed(1)))
    buf = stager.host
    stager.stage(_state(2), 2)
    _assert_same(_state(2), unpack(stager.packed(2)))
    assert stager.host is buf  # same size: no new allocation


def test_a_stale_packed_call_for_another_step_is_refused_and_leaves_the_staged_state():
    stager = SnapshotStager(torch.device("cpu"))
    stager.stage(_state(5), 5)
    with pytest.raises(RuntimeError, match="snapshot of step 4 asked for, step 5 staged"):
        stager.packed(4)  # queued for the previous snapshot: must not consume this one
    _assert_same(_state(5), unpack(stager.packed(5)))


def test_packed_through_object_store_is_zero_copy_and_exact(ray_cluster):
    import ray

    stager = SnapshotStager(torch.device("cpu"))
    stager.stage(_state(3), 3)
    ref = ray.put(stager.packed(3))
    back = ray.get(ref)
    assert isinstance(back, Packed) and not back.data.flags.writeable  # mapped from the object store
    _assert_same(_state(3), as_state(back))
    plain = _state(4)
    assert as_state(plain) is plain


GiB = 2**30


def test_stores_that_hold_two_snapshots_of_their_parts_pass_and_a_small_one_is_named_in_one_line():
    from k3ray.grid.snapshots import store_shortfall
    assert store_shortfall([10 * GiB], ["a"], {"a": 20 * GiB}) is None
    line = store_shortfall([29 * GiB, 29 * GiB], ["a", "a"], {"a": 20 * GiB})
    assert "\n" not in line
    assert "116.0 GiB" in line and "58.0 GiB of parts, held 2 times" in line and "has 20.0 GiB" in line
    assert "K3RAY_OBJECT_STORE_GB" in line
    # on two nodes each also holds its neighbour's committed parts
    assert store_shortfall([10 * GiB, 10 * GiB], ["a", "b"], {"a": 25 * GiB, "b": 25 * GiB}) is not None
    assert store_shortfall([10 * GiB, 10 * GiB], ["a", "b"], {"a": 30 * GiB, "b": 30 * GiB}) is None


class SlowStoreGroup:
    """A worker group whose snapshots arrive only when told (`arrive`), and whose store is too small."""
    pp, ep = 1, 2

    def __init__(self):
        self.arrived: set[int] = set()
        self.begun: list[int] = []
        self.transfer = self  # the group's state-transfer part: this fake plays it itself

    def begin_snapshot(self, step):
        self.begun.append(step)
        return [f"ref{step}"] * 2, [step] * 2, "snapshots need more store"

    def snapshot_bytes(self, size_refs, timeout_s):
        if size_refs[0] in self.arrived or timeout_s != 0:
            return 8
        return None

    def hold_peer_snapshots(self, step, refs):
        pass


def test_a_snapshot_due_while_the_previous_one_still_arrives_is_skipped_not_waited_for():
    from k3ray.grid.snapshots import Snapshots
    skips = []
    snaps, group = Snapshots(on_skip=lambda step, arriving: skips.append((step, arriving))), SlowStoreGroup()
    assert snaps.take(group, 0, guard=None)
    assert not snaps.take(group, 10, guard=None)  # step 0's bytes have not arrived: no wait, no new staging
    assert group.begun == [0] and snaps.skipped == [10] and skips == [(10, 0)]
    assert snaps.committed is None and snaps.pending.step == 0
    group.arrived.add(0)
    assert snaps.take(group, 20, guard=None)  # arrived meanwhile: committed, and the next one starts
    assert snaps.committed.step == 0 and snaps.pending.step == 20 and group.begun == [0, 20]
    assert snaps.take(group, 30, guard=None, wait=True)  # a resize or recovery waits for this boundary's state
    assert snaps.committed.step == 30 and snaps.pending is None
    assert snaps.warnings == ["snapshots need more store"]  # said once, however often the group says it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device staging and the side-stream copy need CUDA")
def test_cuda_snapshots_stage_a_prefix_read_the_rest_live_and_a_write_after_the_fence_does_not_reach_them():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    state = {"a": torch.randn(1 << 20, device=dev, generator=g), "b": torch.randn(1 << 22, device=dev, generator=g)}
    stager = SnapshotStager(dev)
    for step in (0, 1):
        if step == 1:  # room on the device for "a" alone: "b" is read live
            stager.staging = torch.empty(state["a"].numel() * 4, dtype=torch.uint8, device=dev)
        want = {k: v.cpu() for k, v in state.items()}
        nbytes, reading = stager.stage(state, step)
        assert nbytes >= 5 * (1 << 22) and reading is not None
        torch.cuda.current_stream().wait_event(reading)  # what the optimizer does before it writes
        for t in state.values():
            t.mul_(2.0)
        _assert_same(want, unpack(stager.packed(step)))
    assert stager.staged is None
