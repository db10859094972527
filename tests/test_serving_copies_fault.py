"""A worker lost while a serving placement move's copies are on their way (pp=1 x ep=2, float64, the shared serving
checkpoint): the loss takes the normal failure path, the half-done move is discarded (the rebuilt grid serves without
copies, no move recorded), no request fails and every request ends with the single-process reference's tokens."""
from __future__ import annotations

import time

import pytest
import ray

from conftest import serving_engine
from k3ray.serve.drills import Stream
from k3ray.data import encode

PROMPTS = ["def ", "import sys\n", "x", "for k, v in d.items():\n", "return ", "@classmethod\n"]
SERVE = {"page_size": 4, "pages_per_rank": 64, "slots_per_rank": 6, "token_budget": 16, "max_waiting": 16,
         "max_tokens": 64}


@pytest.fixture
def engine(serving_checkpoint):
    with serving_engine(serving_checkpoint, 1, 2, SERVE) as engine:
        yield engine


def test_a_worker_killed_while_copies_are_fetched_discards_the_move_and_fails_no_request(engine, visible_reference):
    assert ray.get(engine.set_policy.remote("replication", {"enabled": True, "every_n_steps": 1000,
                                                           "spare_slots_per_rank": 2}))["value"]["enabled"]
    assert ray.get(engine.drill.remote("slow_copies", [0, 1], seconds=30.0))  # the move stays under way
    params = [{"max_tokens": 24 + 2 * i, "temperature": 0.0 if i % 2 else 0.8, "seed": 90 + i}
              for i in range(len(PROMPTS))]
    want = [visible_reference(p, kw) for p, kw in zip(PROMPTS, params)]
    streams = [Stream(engine, encode(p), kw) for p, kw in zip(PROMPTS, params)]
    for s in streams:
        s.start()
    deadline = time.time() + 120
    while sum(len(s.tokens()) >= 2 for s in streams) < 4 and time.time() < deadline:
        time.sleep(0.05)
    ray.get(engine.rebalance.remote())
    while ray.get(engine.placement_view.remote())["moving"] is None and time.time() < deadline:
        time.sleep(0.05)
    moving = ray.get(engine.placement_view.remote())["moving"]
    assert moving is not None and any(moving["fetch"]), "no move got under way"
    t_kill = time.perf_counter()
    ray.get(engine.drill.remote("kill_worker", [1]))
    for s in streams:
        s.join(timeout=300)
    assert any(s.items[-1][0] > t_kill for s in streams), "the kill did not land among streaming requests"
    for i, (s, w) in enumerate(zip(streams, want)):
        assert not [item for _, item in s.items if "error" in item], f"request {i}"
        assert s.tokens() == w, f"request {i} ({PROMPTS[i]!r}, {params[i]})"
        assert s.items[-1][1]["finish"] in ("stop", "length")
    assert [i["kind"] for i in ray.get(engine.incident_log.remote())] == ["worker_lost"]
    after = ray.get(engine.placement_view.remote())
    assert after["moving"] is None and not after["moves"]  # the half-done move was discarded, never switched to
    assert not any(after["copies"]) and len(after["copies"]) == ray.get(engine.stats.remote())["ep"]
