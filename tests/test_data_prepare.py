"""`k3ray data prepare` as Ray tasks (text files, JSONL, Parquet; deterministic; resumable), and training on the shards:
pp=2 x ep=2 equals the single-process reference in float64, and a worker killed mid-run changes no loss."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_job
from k3ray.config import ConfigError, load_config
from k3ray.control.prepare import input_files, plan_units, prepare, prepare_unit
from k3ray.io import checkpoint as ckpt
from k3ray.io import shards
from k3ray.parallel.reference import ReferenceTrainer
from k3ray.tokenizer import load_tokenizer
from test_data import corpus_texts, train_bpe

STEPS = 6


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A BPE tokenizer, and an input folder: text files, a JSONL file and a Parquet file of k3ray's own sources."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("prepare")
    tok = train_bpe(root / "tok")
    texts = corpus_texts()
    folder = root / "in"
    (folder / "text").mkdir(parents=True)
    for i, text in enumerate(texts[:12]):
        (folder / "text" / f"{i:03d}.py").write_text(text)
    with open(folder / "docs.jsonl", "w") as f:
        for text in texts[12:40]:
            f.write(json.dumps({"text": text, "id": len(text)}) + "\n")
    pq.write_table(pa.table({"text": texts[40:60]}), folder / "docs.parquet", row_group_size=5)
    return tok, folder


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_prepare_is_deterministic_resumable_and_complete(ray_cluster, inputs, tmp_path):
    tok, folder = inputs
    first = prepare([str(folder)], str(tok), str(tmp_path / "a"), shard_mb=0.05, workers=2, progress=False)
    texts = corpus_texts()
    assert first["documents"] == 60 and first["shards"] >= 4 and first["reused_shards"] == 0
    tokenizer = load_tokenizer(str(tok))
    assert first["tokens"] == sum(len(tokenizer.encode(t)) + 1 for t in texts[:60])
    made = folder_bytes(tmp_path / "a")
    assert set(made) == {"manifest.json"} | {f"shard_{i:05d}.{s}" for i in range(first["shards"]) for s in ("bin", "idx")}
    # the same input again, with one worker: the same bytes
    again = prepare([str(folder)], str(tok), str(tmp_path / "b"), shard_mb=0.05, workers=1, progress=False)
    assert again["tokens"] == first["tokens"] and folder_bytes(tmp_path / "b") == made
    # an interrupted run left shards 0 and 2 finished: a second run reuses them and writes the same bytes
    units = plan_units(input_files([str(folder)]), int(0.05 * 2**20))
    (tmp_path / "c").mkdir()
    for i in (0, 2):
        prepare_unit(units[i], i, str(tok), tokenizer.fingerprint, "text", str(tmp_path / "c"))
    resumed = prepare([str(folder)], str(tok), str(tmp_path / "c"), shard_mb=0.05, workers=2, progress=False)
    assert resumed["reused_shards"] == 2 and folder_bytes(tmp_path / "c") == made
    shards.verify(tmp_path / "c", checksums=True)


def test_prepare_rejects_empty_input_and_bad_records(ray_cluster, inputs, tmp_path):
    tok, _ = inputs
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="no text"):
        prepare([str(tmp_path / "empty.txt")], str(tok), str(tmp_path / "o1"), progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl \(line at byte 15\): not a JSON object with a 'text' field"):
        prepare([str(tmp_path / "bad.jsonl")], str(tok), str(tmp_path / "o2"), progress=False)
    with pytest.raises(ConfigError, match="nothing: no such file or folder"):
        prepare([str(tmp_path / "nothing")], str(tok), str(tmp_path / "o3"), progress=False)


@pytest.fixture(scope="module")
def shard_job(ray_cluster, inputs, tmp_path_factory):
    """The tiny model on the prepared shards (vocabulary 400 in a 512-row embedding), float64, pp=2 x ep=2, with
    document masking (every stage finds the documents of its micro-batches from their tokens); the single-process
    reference's losses and the distributed run's."""
    tok, folder = inputs
    out = tmp_path_factory.mktemp("shards")
    prepare([str(folder)], str(tok), str(out), shard_mb=0.05, workers=2, progress=False)

    def cfg(**overrides):
        return load_config("configs/tiny.yaml", {
            "parallel.pp": 2, "parallel.ep": 2, "train.eval_every": 0, "train.steps": STEPS, "model.dtype": "float64",
            "model.vocab_size": 512, "data.source": str(out), "data.tokenizer": str(tok),
            "data.document_masking": True,
            "data.micro_batch_size": 2, "parallel.collective_timeout_s": 10, "fault_tolerance.grow_back": False,
            "fault_tolerance.snapshot_every": 2, "checkpoint.every_n_steps": 3,
            "policies.guards.warmup_steps": 100, "checkpoint.at_end": False,
            "checkpoint.dir": str(tmp_path_factory.mktemp("ckpt")), **overrides})

    reference = ReferenceTrainer(cfg())
    want = [reference.train_step(s, s).loss for s in range(STEPS)]
    unfailed = cfg()
    return cfg, want, run_job(unfailed, STEPS, timeout_s=120), unfailed.checkpoint.dir


def test_pp2_ep2_on_shards_equals_the_single_process_reference(shard_job):
    _, want, run, checkpoints = shard_job
    got = [r["loss"] for r in run.reports]
    assert got == pytest.approx(want, rel=1e-8, abs=0)
    assert run.reports[0]["tokens"] == 2 * 2 * 2 * 128
    newest = ckpt.latest_verified(checkpoints)  # a checkpoint records what the steps before it trained on
    assert newest.step > 0 and newest.meta["tokens_consumed"] == newest.step * 2 * 2 * 2 * 128
    assert newest.meta["samples_read"] == newest.step * 2 * 2 * 2


def test_worker_killed_on_shards_resumes_with_the_unfailed_losses(shard_job):
    """Worker 3 (stage 1, EP rank 1) killed at step 3: the grid is rebuilt on the survivors, steps from the step-2
    snapshot are replayed, and EP rank 0 reads the lost rank's micro-batches too (the same global batch), so the
    losses are the unfailed run's."""
    cfg, _, unfailed, _ = shard_job
    run = run_job(cfg(**{"fault_tolerance.faults": [{"kind": "kill_worker", "step": 3, "worker": 3}]}), STEPS,
                  timeout_s=120)
    kinds = [i["kind"] for i in run.incidents]  # the kill also meets the step-3 checkpoint: abandoned, written again
    assert kinds.count("worker_lost") == 1 and set(kinds) <= {"worker_lost", "checkpoint_abandoned"}
    assert [r["loss"] for r in run.reports] == pytest.approx(unfailed.losses, rel=1e-12, abs=0)
