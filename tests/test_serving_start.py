"""Serving's start: the bulk restore from the packed weights equals the per-tensor one (any stage, EP rank and expert
homes; any chunking), a one-worker grid, started while its weights are read, serves without process groups and
with the reference's tokens, its start in phases, and `k3ray serve` imports no torch before Ray starts, nor the engine
before it starts its workers."""
from __future__ import annotations

import subprocess
import sys

import pytest
import ray
import torch

from conftest import serving_engine
from k3ray.config import load_config
from k3ray.data import encode
from k3ray.formats.serving_weights import serving_weights
from k3ray.grid.packed_restore import copy_pieces, restore_weights, weight_pieces, weights_only
from k3ray.grid.snapshots import pack, unpack
from k3ray.parallel.engine import StageEngine
from k3ray.serve.drills import Stream
from k3ray.train.checkpointing import write_seeded_weights

SERVE = {"page_size": 4, "pages_per_rank": 64, "slots_per_rank": 6, "token_budget": 16, "max_waiting": 16,
         "max_tokens": 64}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    cfg = load_config("configs/tiny.yaml", {"model.dtype": "bfloat16"})
    root = tmp_path_factory.mktemp("seeded") / "w"
    write_seeded_weights(cfg, str(root))
    weights = serving_weights(str(root))
    return cfg, pack(weights.state)


def restored(cfg, packed, pp_rank: int, ep_rank: int, home: list[int], bulk: bool) -> dict[str, torch.Tensor]:
    e = StageEngine(cfg, pp_rank, ep_rank, home, max(home) + 1, "cpu", init_weights=False)
    e.init_process_groups(None, None)  # builds the stage, no process groups: a restore runs no collective
    if bulk:
        restore_weights(e, packed)
    else:
        state = unpack(packed)
        e.load_state(state, {layer: [state["experts"][layer]] for layer in state["experts"]})
    return {**dict(e.stage.named_parameters()), **dict(e.stage.named_buffers())}


@pytest.mark.parametrize("pp_rank, ep_rank, homes", [(0, 0, "one"), (1, 1, "blocks"), (0, 1, "strided")])
def test_the_bulk_restore_equals_the_per_tensor_one(packed, pp_rank, ep_rank, homes):
    cfg, weights = packed
    cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"pp": 2})})
    E = cfg.model.n_experts
    home = {"one": [0] * E, "blocks": [e * 2 // E for e in range(E)], "strided": [e % 2 for e in range(E)]}[homes]
    assert weights_only(weights.tree)
    want = restored(cfg, weights, pp_rank, ep_rank, home, bulk=False)
    got = restored(cfg, weights, pp_rank, ep_rank, home, bulk=True)
    assert want.keys() == got.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("chunk", [7, 4096, 1 << 20])
def test_chunked_copies_land_every_piece_whatever_the_chunk(packed, chunk):
    cfg, weights = packed
    stage = StageEngine(cfg, 0, 0, [0] * cfg.model.n_experts, 1, "cpu", init_weights=False)
    stage.init_process_groups(None, None)
    pieces, conversions = weight_pieces(stage.stage, weights.tree)
    assert not conversions and len(pieces) > 10 and {c for c, _, _ in pieces} == {0}
    data = torch.from_numpy(weights.data[0])
    want = [torch.zeros_like(d) for _, _, d in pieces]
    copy_pieces(data, [(o, w) for (_, o, _), w in zip(pieces, want)], chunked=False)
    got = [torch.zeros_like(d) for _, _, d in pieces]
    copy_pieces(data, [(o, g) for (_, o, _), g in zip(pieces, got)], chunk_bytes=chunk, chunked=True)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_one_worker_grid_serves_without_process_groups_and_as_the_reference(serving_checkpoint, visible_reference):
    prompts = ["def ", "import os\n", "x"]
    params = [{"max_tokens": 12 + i, "temperature": 0.0 if i % 2 else 0.8, "seed": 7 + i} for i in range(3)]
    with serving_engine(serving_checkpoint, 1, 1, SERVE) as engine:
        info = ray.get(engine.ready.remote())
        assert {"read_weights", "weights_held_at", "place_and_start_workers", "restore"} <= info["start_seconds"].keys()
        groups = ray.get(engine.__ray_call__.remote(lambda e: ray.get(e.grid.group.workers[0].__ray_call__.remote(
            lambda w: type(w.seat.engine.groups._world).__name__))))
        assert groups == "NoGroups"
        streams = [Stream(engine, encode(p), kw) for p, kw in zip(prompts, params)]
        for s in streams:
            s.start()
        for s in streams:
            s.join(timeout=300)
    for s, p, kw in zip(streams, prompts, params):
        assert s.tokens() == visible_reference(p, kw)


def test_a_serving_start_imports_torch_only_in_the_engine_and_its_workers(tmp_path):
    """`k3ray serve` checks its input and starts Ray before anything imports torch, and the engine actor's and the
    workers' modules (their classes reach their processes from them) import none at their top: the engine starts its
    workers before it imports torch, so their imports run beside its own."""
    write_seeded_weights(load_config("configs/tiny.yaml"), str(tmp_path / "w"))
    until_ray = ("import sys\n"
                 "from k3ray.control import ray_cluster\n"
                 "def init_ray(*args):\n"
                 "    raise SystemExit('torch imported' if 'torch' in sys.modules else 0)\n"
                 "ray_cluster.init_ray = init_ray\n"
                 "from k3ray.control.cli import main\n"
                 f"main(['serve', '--checkpoint', {str(tmp_path / 'w')!r}])\n")
    actors = ("import sys\n"
              "import k3ray.grid.worker, k3ray.serve.app, k3ray.serve.engine, k3ray.serve.metrics\n"
              "raise SystemExit('torch imported' if 'torch' in sys.modules else 0)\n")
    for code in (until_ray, actors):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
