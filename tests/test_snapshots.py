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
