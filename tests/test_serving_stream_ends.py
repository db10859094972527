"""A stream's last items, without Ray: the engine (`Engine`) on a fake grid that loses its worker at each iteration in
turn, read by clients that take an iteration's time to take each item (as Ray's streaming report does on a loaded
machine: the engine's event loop runs the next iteration while the stream waits at its `yield`). Every stream ends
with a finish item and carries exactly the reference's tokens and text: a request that ends while its stream waits
to hand over the item before loses nothing. Sequential and overlapped iterations, stream_interval 1 and 3, requests
ending at, before and after the lost iteration. float64, as test_serving_recovery."""
from __future__ import annotations

import asyncio

import pytest
import torch

from k3ray.config import load_config
from fakes.serving import FakeGrid, sizes
from k3ray.data import EOS, encode
from k3ray.model.decoder import build_stage
from k3ray.model.sampling import SamplingParams, visible_ids
from k3ray.parallel.reference import generate_reference
from k3ray.serve.engine import Engine

PROMPTS = ["def ", "import os\n", "class A:\n    def f(self", "x = "]
SERVE = {"page_size": 4, "pages_per_rank": 64, "slots_per_rank": 6, "token_budget": 16, "max_tokens": 32,
         "recovery_attempts": 2, "recovery_backoff_s": 0.0, "unavailable_wait_s": 20.0}
MAX_TOKENS = [3, 4, 5, 6]  # the requests end on neighbouring iterations
LOSSES = [None, *range(1, 11)]  # no loss, then the worker lost at each iteration in turn (the work takes 8-11)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64"}).model
    return build_stage(cfg, range(cfg.n_layers), seed=3)


def params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0 if i % 2 else 0.7, seed=11 + i)


async def slow_client(engine: Engine, i: int) -> list[dict]:
    """One request's stream items, each taken only once the engine has run another iteration (or has no work)."""
    items = []
    async for item in engine.generate(encode(PROMPTS[i]), params(i)):
        items.append(item)
        seen = engine.counts.iterations
        while engine.counts.iterations == seen and engine.sched.has_work:
            await asyncio.sleep(0.001)
    return items


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("interval", [1, 3])
def test_a_stream_that_waits_to_hand_over_an_item_still_ends_with_every_token(model, overlap, interval):
    want = [visible_ids(generate_reference(model, encode(p), params(i))[0], params(i), EOS)
            for i, p in enumerate(PROMPTS)]
    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64", "parallel.pp": 1, "parallel.ep": 1,
                                            **{f"serve.{k}": v for k, v in SERVE.items()},
                                            "serve.overlap": overlap, "serve.stream_interval": interval})
    for lost_at in LOSSES:
        grid = FakeGrid(model, sizes(cfg), lose_at=() if lost_at is None else {lost_at})

        async def main():
            engine = Engine(cfg, 0, grid)
            return await asyncio.wait_for(asyncio.gather(*(slow_client(engine, i) for i in range(len(PROMPTS)))),
                                          60)

        streams = asyncio.run(main())
        assert grid.calls == ([] if lost_at is None or lost_at > grid.iterations else ["recover"]), lost_at
        for i, items in enumerate(streams):
            tokens = [t for item in items for t in item.get("tokens", ())]
            where = f"request {i} (max_tokens {MAX_TOKENS[i]}), worker lost at iteration {lost_at}"
            assert tokens == want[i], where
            assert "".join(item.get("text", "") for item in items) == bytes(tokens).decode("utf-8", "replace"), where
            assert items[-1]["finish"] in ("stop", "length"), where
