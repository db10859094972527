"""Serving on the worker grid: a durable checkpoint trained on pp=1 x ep=2 is served on pp=2 x ep=2 (resharded on
load); 16 concurrent greedy requests of mixed lengths stream the same tokens as the single-process reference
generation from the same checkpoint (float64). Pipeline hand-offs, data-parallel request placement and the EP
exchange (MoonEP on) must not change a token."""
from __future__ import annotations

import asyncio

import pytest
import ray
import torch

from k3ray.config import load_config
from k3ray.control.driver import start_controller, stop_controller
from k3ray.controller.checkpointing import serving_weights
from k3ray.controller.serve_engine import ServingEngine, serving_config
from k3ray.data import EOS, encode
from k3ray.model.decoder import build_stage
from k3ray.model.sampling import SamplingParams, visible_ids
from k3ray.optim import AdamW
from k3ray.parallel import shards
from k3ray.parallel.reference import generate_reference

PROMPTS = ["def ", "import sys\n", "class A:\n    def f(self", "x", "for k, v in d.items():\n", "return ",
           "# -*- coding: utf-8 -*-\n\"\"\"Support for ", "if not path:\n    raise ValueError(", "@classmethod\n",
           "try:\n    pass\nexcept", "s = ", "    while i < n:\n        i += 1\n        if i % 7 == 0:\n",
           "print(", "with lock:\n", "from . import ", "assert "]


@pytest.fixture(scope="module")
def checkpoint(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve") / "ckpt"
    cfg = load_config("configs/tiny.yaml", {"train.eval_every": 0, "model.dtype": "float64", "parallel.ep": 2,
                                            "checkpoint.dir": str(root), "checkpoint.every_n_steps": 3})
    controller = start_controller(cfg)
    try:
        for s in range(4):
            ray.get(controller.train_step.remote(s), timeout=300)
    finally:
        stop_controller(controller)
    return str(root)


def reference_model(checkpoint: str):
    w = serving_weights(checkpoint)
    cfg = serving_config(w.config, 1, 1)
    model = build_stage(cfg.model, range(cfg.model.n_layers), init=False)
    shards.load_weights(model, AdamW(cfg.optimizer), w.state, {i: [w.state["experts"][i]] for i in model.layers},
                        set(range(cfg.model.n_experts)))
    return model


async def stream(engine, prompt: list[int], params: dict) -> tuple[list[int], str | None, list]:
    items = []
    async for ref in engine.generate.options(num_returns="streaming").remote(prompt, params):
        items.append(await ref)
    tokens = [t for it in items[1:] for t in it["tokens"]]
    return tokens, items[-1].get("finish"), items


def test_grid_serving_equals_reference(ray_cluster, checkpoint):
    torch.set_num_threads(1)
    model = reference_model(checkpoint)
    params = [{"max_tokens": 2 + (5 * i) % 17} for i in range(len(PROMPTS))]
    want = []
    for p, sp in zip(PROMPTS, params):
        out, reason = generate_reference(model, encode(p), SamplingParams(**sp))
        want.append((visible_ids(out, SamplingParams(**sp), EOS), reason))
    engine = ServingEngine.remote(checkpoint, 2, 2, {"page_size": 4, "pages_per_rank": 64, "slots_per_rank": 8,
                                                     "token_budget": 24})
    try:
        info = ray.get(engine.ready.remote(), timeout=300)
        assert (info["pp"], info["ep"]) == (2, 2)

        async def all_requests():
            return await asyncio.gather(*(stream(engine, encode(p), sp) for p, sp in zip(PROMPTS, params)))

        got = asyncio.run(all_requests())
        assert len(got) >= 16
        for i, ((tokens, finish, items), w) in enumerate(zip(got, want)):
            assert "accepted" in items[0]
            assert (tokens, finish) == w, f"request {i} ({PROMPTS[i]!r})"
        stats = ray.get(engine.stats.remote())
        assert stats["pages_used"] == 0 and stats["running"] == 0
        assert stats["iterations"] < sum(len(w[0]) for w in want)  # requests shared iterations
        load = ray.get(engine.expert_load.remote())
        assert all(sum(sum(v) for v in worker.values()) > 0 for worker in load)  # both DP ranks served requests
    finally:
        ray.get(engine.shutdown.remote())
        ray.kill(engine)
