"""k3ray.io.checkpoint: atomic parts, manifest-last commits, verification, fallback and retention."""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3ray.io import checkpoint as ck
from k3ray.io.checkpoint import CheckpointError, PartInfo
from k3ray.io.checkpoint import write as checkpoint_write


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "dense": {"w": torch.randn(16, 8, generator=g), "b": torch.zeros(8, dtype=torch.bfloat16)},
        "experts": {"expert_ids": [0, 1, 2], "w1": torch.randn(3, 8, 4, generator=g),
                    "opt": {"w1": {"m": torch.randn(3, 8, 4, generator=g), "v": torch.rand(3, 8, 4, generator=g)},
                            "w2": None}},
        "step": seed, "lr": 3e-4, "name": "stage0", "cursor": [seed, 7],
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def save_step(root, step: int, keep: int = 10, names=("stage0_dense.pt", "stage0_ep1_experts.pt")) -> list:
    parts = [ck.write_part(root, step, n, state(step + i)) for i, n in enumerate(names)]
    ck.commit(root, step, parts, {"config": {"ep": 2}, "cursor": step}, keep=keep)
    return parts


def test_round_trip_nested_state(tmp_path):
    parts = save_step(tmp_path, 40)
    m = ck.verify(tmp_path, 40)
    assert m.step == 40 and m.path == tmp_path / "step_000000040" and m.meta["cursor"] == 40
    assert m.parts == {p.name: p for p in parts}
    assert json.loads(json.dumps(parts[0].to_json())) == {"name": parts[0].name, "bytes": parts[0].bytes,
                                                          "sha256": parts[0].sha256}
    assert_same(ck.load_part(tmp_path, 40, "stage0_dense.pt"), state(40))
    assert_same(ck.load_part(tmp_path, 40, "stage0_ep1_experts.pt"), state(41))
    assert not list((tmp_path / "step_000000040").glob("*.tmp"))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.recursive(
    st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=False), st.text(max_size=8),
              st.builds(lambda n, s: torch.randn(n, generator=torch.Generator().manual_seed(s)),
                        st.integers(0, 33), st.integers(0, 9))),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=5), kids, max_size=3)),
    max_leaves=12))
def test_round_trip_any_plain_state(value):
    with tempfile.TemporaryDirectory() as root:
        info = ck.write_part(root, 0, "p.pt", {"x": value})
        ck.commit(root, 0, [info], {}, keep=1)
        assert ck.latest_verified(root).step == 0
        assert_same(ck.load_part(root, 0, "p.pt"), {"x": value})


def test_uncommitted_part_is_ignored(tmp_path):
    ck.write_part(tmp_path, 10, "a.pt", state(0))
    assert ck.list_committed(tmp_path) == []
    assert ck.latest_verified(tmp_path) is None
    assert ck.latest_verified(tmp_path / "nope") is None and ck.list_committed(tmp_path / "nope") == []
    with pytest.raises(CheckpointError, match="manifest.json: missing"):
        ck.verify(tmp_path, 10)


def test_truncated_newest_falls_back_with_warning(tmp_path, caplog):
    save_step(tmp_path, 10)
    save_step(tmp_path, 20)
    part = tmp_path / "step_000000020" / "stage0_ep1_experts.pt"
    size = part.stat().st_size
    os.truncate(part, size - 100)
    with caplog.at_level(logging.WARNING, logger="k3ray.checkpoint"):
        m = ck.latest_verified(tmp_path)
    assert m.step == 10
    msg = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"step_000000020/stage0_ep1_experts.pt: size {size - 100} != manifest {size} (truncated?)" in msg
    assert "falling back to step 10" in msg
    assert part.stat().st_size == size - 100 and ck.list_committed(tmp_path) == [10, 20]  # left for inspection


def test_flipped_byte_same_size_is_detected(tmp_path):
    save_step(tmp_path, 30)
    part = tmp_path / "step_000000030" / "stage0_dense.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01
    part.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_000000030/stage0_dense.pt: sha256 .* \(corrupted\)"):
        ck.verify(tmp_path, 30)
    assert ck.latest_verified(tmp_path) is None


def test_deleted_part_is_detected(tmp_path):
    save_step(tmp_path, 5)
    save_step(tmp_path, 6)
    (tmp_path / "step_000000006" / "stage0_dense.pt").unlink()
    with pytest.raises(CheckpointError, match=r"step_000000006/stage0_dense.pt: missing"):
        ck.verify(tmp_path, 6)
    assert ck.latest_verified(tmp_path).step == 5


@pytest.mark.parametrize("garbage", [b"{not json", b"[1, 2]", b'{"step": 7}', b""])
def test_garbage_manifest_is_detected(tmp_path, garbage):
    save_step(tmp_path, 3)
    save_step(tmp_path, 7)
    (tmp_path / "step_000000007" / "manifest.json").write_bytes(garbage)
    with pytest.raises(CheckpointError, match="step_000000007/manifest.json"):
        ck.verify(tmp_path, 7)
    assert ck.latest_verified(tmp_path).step == 3


def test_manifest_for_other_step_is_detected(tmp_path):
    save_step(tmp_path, 1)
    save_step(tmp_path, 2)
    src = tmp_path / "step_000000001" / "manifest.json"
    (tmp_path / "step_000000002" / "manifest.json").write_bytes(src.read_bytes())
    with pytest.raises(CheckpointError, match="records step 1, dir says 2"):
        ck.verify(tmp_path, 2)


def test_retention_keeps_exactly_keep(tmp_path):
    for step in range(0, 60, 10):
        save_step(tmp_path, step, keep=3)
        assert ck.list_committed(tmp_path) == list(range(0, step + 10, 10))[-3:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000030", "step_000000040", "step_000000050"]


def test_retention_removes_stale_incomplete_but_not_newer(tmp_path):
    save_step(tmp_path, 10, keep=2)
    ck.write_part(tmp_path, 15, "a.pt", state(0))  # crashed before commit
    ck.write_part(tmp_path, 30, "a.pt", state(0))  # another worker's part of a step still in flight
    save_step(tmp_path, 20, keep=2)
    assert not (tmp_path / "step_000000015").exists()
    assert (tmp_path / "step_000000030" / "a.pt").exists()
    assert ck.list_committed(tmp_path) == [10, 20]


def test_commit_never_deletes_the_step_it_commits(tmp_path):
    for step in (50, 60):
        save_step(tmp_path, step, keep=5)
    save_step(tmp_path, 40, keep=1)  # e.g. a rerun after a rollback
    assert ck.list_committed(tmp_path) == [40, 60]


def test_crash_between_parts_and_commit_resumes_previous(tmp_path):
    save_step(tmp_path, 100)
    for name in ("stage0_dense.pt", "stage0_ep1_experts.pt"):
        ck.write_part(tmp_path, 101, name, state(1))
    (tmp_path / "step_000000101" / "stage1_dense.pt.tmp").write_bytes(b"half a file")  # killed mid-write
    assert ck.list_committed(tmp_path) == [100]
    m = ck.latest_verified(tmp_path)
    assert m.step == 100
    assert_same(ck.load_part(tmp_path, m.step, "stage0_dense.pt"), state(100))


def test_async_writer_runs_in_background(tmp_path, monkeypatch):
    release = threading.Event()
    seen = []
    real = ck.write_part

    def slow_write(*args):
        seen.append(threading.current_thread().name)
        release.wait(10)
        return real(*args)

    monkeypatch.setattr(checkpoint_write, "write_part", slow_write)
    with ck.AsyncWriter() as w:
        futs = [w.submit(tmp_path, 8, f"p{i}.pt", state(i)) for i in range(3)]
        assert not any(f.done() for f in futs)  # the caller got control back before anything was written
        release.set()
        infos = w.wait()
    assert all(name.startswith("k3ray-ckpt") for name in seen)
    assert [f.result() for f in futs] == infos and all(isinstance(i, PartInfo) for i in infos)
    ck.commit(tmp_path, 8, infos, {}, keep=1)
    assert ck.verify(tmp_path, 8).parts == {i.name: i for i in infos}
    assert_same(ck.load_part(tmp_path, 8, "p2.pt"), state(2))


def test_async_writer_reports_errors_through_futures(tmp_path):
    (tmp_path / "step_000000001").write_text("a file where the step dir should be")
    with ck.AsyncWriter() as w:
        fut = w.submit(tmp_path, 1, "a.pt", {"x": torch.ones(2)})
        with pytest.raises(CheckpointError, match="write failed"):
            w.wait()
    assert isinstance(fut.exception(), CheckpointError)


@pytest.mark.parametrize("name", ["", "a/b.pt", "../x", "ä.pt", "manifest.json", "..", "a b"])
def test_invalid_part_name(tmp_path, name):
    with pytest.raises(CheckpointError, match="invalid part name"):
        ck.write_part(tmp_path, 1, name, {})
    with pytest.raises(CheckpointError, match="invalid part name"):
        ck.AsyncWriter().submit(tmp_path, 1, name, {})
    assert not any(tmp_path.iterdir())


def test_commit_rejects_bad_input(tmp_path):
    info = ck.write_part(tmp_path, 2, "a.pt", state(0))
    with pytest.raises(CheckpointError, match="keep=0"):
        ck.commit(tmp_path, 2, [info], {}, keep=0)
    with pytest.raises(CheckpointError, match="meta is not plain JSON"):
        ck.commit(tmp_path, 2, [info], {"t": torch.ones(1)}, keep=1)
    with pytest.raises(CheckpointError, match="b.pt: part missing"):
        ck.commit(tmp_path, 2, [info, PartInfo("b.pt", 1, "0" * 64)], {}, keep=1)
    assert ck.list_committed(tmp_path) == []


def test_load_part_errors_name_the_file(tmp_path):
    save_step(tmp_path, 4)
    with pytest.raises(CheckpointError, match="step_000000004/nope.pt: missing"):
        ck.load_part(tmp_path, 4, "nope.pt")
    part = tmp_path / "step_000000004" / "stage0_dense.pt"
    part.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="stage0_dense.pt: cannot load"):
        ck.load_part(tmp_path, 4, "stage0_dense.pt")


def test_readers_modify_nothing(tmp_path):
    save_step(tmp_path, 1)
    save_step(tmp_path, 2)
    ck.write_part(tmp_path, 3, "a.pt", state(0))
    os.truncate(tmp_path / "step_000000002" / "stage0_dense.pt", 10)

    def snapshot():
        return sorted((str(p.relative_to(tmp_path)), p.stat().st_size, p.stat().st_mtime_ns)
                      for p in tmp_path.rglob("*"))

    before = snapshot()
    ck.list_committed(tmp_path)
    assert ck.latest_verified(tmp_path).step == 1
    with pytest.raises(CheckpointError):
        ck.verify(tmp_path, 2)
    ck.load_part(tmp_path, 1, "stage0_dense.pt")
    assert snapshot() == before


def test_a_committed_step_is_never_written_over(tmp_path):
    info = ck.write_part(tmp_path, 4, "rank00000.pt", {"x": torch.ones(2)})
    ck.commit(tmp_path, 4, [info], {"job": "a"}, keep=3)
    with pytest.raises(ck.CheckpointError, match="already a committed checkpoint"):
        ck.write_part(tmp_path, 4, "rank00000.pt", {"x": torch.zeros(2)})
    assert torch.equal(ck.load_part(tmp_path, 4, "rank00000.pt")["x"], torch.ones(2))
    assert ck.verify(tmp_path, 4).step == 4


class _Held:
    """Pickles only once released: holds an AsyncWriter's write in the middle (a forced interleaving)."""

    def __init__(self, started: threading.Event, release: threading.Event):
        self.started, self.release = started, release

    def __reduce__(self):
        self.started.set()
        assert self.release.wait(10)
        return (int, (0,))


def test_an_abandoned_write_never_lands_over_the_part_its_replacement_wrote(tmp_path):
    started, release = threading.Event(), threading.Event()
    writer = ck.AsyncWriter()
    writer.submit(tmp_path, 4, "rank00001.pt", {"old_grid": _Held(started, release)})
    assert started.wait(10)
    writer.forget()  # its checkpoint was abandoned (the worker left its grid)
    ck.write_part(tmp_path, 4, "rank00001.pt", {"x": torch.full((2,), 7.0)})  # the renumbered rank's new part
    release.set()
    writer.close()
    assert torch.equal(ck.load_part(tmp_path, 4, "rank00001.pt")["x"], torch.full((2,), 7.0))
    assert sorted(p.name for p in ck.step_dir(tmp_path, 4).iterdir()) == ["rank00001.pt"]  # no temporary left
