"""Live expert placement in serving: the engine on pp=1 x ep=4 (float64, the shared serving checkpoint) takes a
rebalance in the middle of 16 concurrent streams (read-only copies of the hot experts fetched in the background,
the table switched between two iterations) and every request still ends with exactly the tokens of the
single-process reference; policies change live through the engine, bad values are refused (raised) with the field
named."""
from __future__ import annotations

import threading
import time

import pytest
import ray

from conftest import serving_engine
from k3ray.serve.drills import Stream
from k3ray.data import encode
from k3ray.steering.protocol import Refused

PROMPTS = ["def ", "import sys\n", "class A:\n    def f(self", "x", "for k, v in d.items():\n", "return ",
           "if not path:\n    raise ValueError(", "@classmethod\n", "try:\n    pass\nexcept", "s = ", "while True:\n",
           "print(", "with open(p) as f:\n", "# ", "yield ", "lambda x: "]
SERVE = {"page_size": 4, "pages_per_rank": 64, "slots_per_rank": 4, "token_budget": 16, "max_waiting": 16,
         "max_tokens": 64}


def refusal(method, *args, of: type[Exception]) -> Exception:
    """What the engine actor raised for method(*args), out of Ray's wrapping: a refusal of type `of`."""
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(method.remote(*args))
    assert isinstance(raised.value.cause, of), raised.value
    return raised.value.cause


@pytest.fixture(scope="module")
def engine(serving_checkpoint):
    with serving_engine(serving_checkpoint, 1, 4, SERVE) as engine:
        yield engine


def test_a_rebalance_amid_16_streams_changes_no_token_and_fails_no_request(engine, visible_reference):
    assert ray.get(engine.set_policy.remote("replication", {"enabled": True, "every_n_steps": 1000,
                                                           "spare_slots_per_rank": 4}))["value"]["enabled"]
    params = [{"max_tokens": 20 + i, "temperature": 0.0 if i % 3 else 0.8, "seed": 40 + i} for i in range(16)]
    want = [visible_reference(p, kw) for p, kw in zip(PROMPTS, params)]
    streams = [Stream(engine, encode(p), kw) for p, kw in zip(PROMPTS, params)]
    for s in streams:
        s.start()
    deadline = time.time() + 120
    while sum(len(s.tokens()) >= 2 for s in streams) < 12 and time.time() < deadline:
        time.sleep(0.05)
    before = ray.get(engine.placement_view.remote())
    assert before["copies"] == [[], [], [], []] and not before["moves"]
    ray.get(engine.rebalance.remote())
    for s in streams:
        s.join(timeout=300)
    for i, (s, w) in enumerate(zip(streams, want)):
        assert not [item for _, item in s.items if "error" in item], f"request {i}"
        assert s.tokens() == w, f"request {i} ({PROMPTS[i]!r}, {params[i]})"
        assert s.items[-1][1]["finish"] in ("stop", "length")
    after = ray.get(engine.placement_view.remote())
    assert not ray.get(engine.incident_log.remote()), ray.get(engine.incident_log.remote())[0]["why"]
    move, = after["moves"]
    assert any(after["copies"]) and move["copies"] == after["copies"] and not move["failed"]
    assert move["bytes_moved"] > 0 and move["balancedness_after"] > move["balancedness_before"]
    for rank, experts in enumerate(after["copies"]):  # a copy is never of an expert the rank holds already
        assert all(after["home"][e] != rank for e in experts) and len(experts) <= 4
    # the switch came while requests streamed: iterations ran on the old table and on the new one
    assert 0 < move["switched_at_iteration"] < ray.get(engine.stats.remote())["iterations"] - 5
    print(f"\nplacement move: {move}")


def test_policies_change_live_and_bad_values_are_refused_with_the_field_named(engine):
    assert "replication.spare_slots_per_rank" in str(refusal(engine.set_policy, "replication",
                                                              {"spare_slots_per_rank": -1}, of=ValueError))
    assert "moonep.slots" in str(refusal(engine.set_policy, "moonep", {"slots": 2}, of=ValueError))
    assert "unknown policy 'nope'" in str(refusal(engine.set_policy, "nope", {"enabled": False}, of=KeyError))
    assert ray.get(engine.policies.remote("moonep"))["enabled"] is True
    change = ray.get(engine.set_policy.remote("moonep", {"enabled": False}, "test"))
    assert change["value"]["enabled"] is False
    assert ray.get(engine.policies.remote("moonep"))["enabled"] is False
    audit = ray.get(engine.policy_audit.remote())
    assert [(a["policy"], a["params"], a["source"]) for a in audit][-1] == ("moonep", {"enabled": False}, "test")


def test_scaling_the_grid_down_and_up_amid_streams_changes_no_token(engine, visible_reference):
    """ep 4 -> 2, then 2 -> 4, while requests keep arriving (one every 0.3 s, more while the resizes last): each new
    grid is launched beside the serving one (tokens keep coming meanwhile) and adopted between two iterations, the
    requests in flight prefilled again on it; every request ends with the reference's tokens. Sizes the grid cannot
    take are refused, the grid untouched."""
    assert str(refusal(engine.scale, 0, of=ValueError)).startswith("ep: must be a whole number >= 1")
    assert refusal(engine.scale, 3, of=Refused).message == "ep=3 does not divide model.n_experts=16"
    too_big = refusal(engine.scale, 16, of=Refused)
    assert too_big.status == 409 and "a 1 x 16 grid needs 16" in too_big.message
    assert ray.get(engine.stats.remote())["ep"] == 4
    params = [{"max_tokens": 24 + i, "temperature": 0.0 if i % 2 else 0.8, "seed": 60 + i} for i in range(16)]
    # those arriving while a resize lasts are long, so some are in flight when the new grid is adopted
    late = [{"max_tokens": 96, "temperature": 0.0 if i % 2 else 0.8, "seed": 80 + i} for i in range(8)]
    want = [visible_reference(p, kw) for p, kw in zip(PROMPTS, params)]
    want_late = [visible_reference(p, kw) for p, kw in zip(PROMPTS, late)]
    streams: list[Stream] = []
    scaled = threading.Event()

    def arrivals():  # 16, then on while a resize is under way (requests in flight when it adopts), 24 at most
        while len(streams) < 16 or not scaled.is_set() and len(streams) < 24:
            n = len(streams)
            prompt, kw = (PROMPTS[n], params[n]) if n < 16 else (PROMPTS[n % 8], late[n % 8])
            streams.append(Stream(engine, encode(prompt), kw))
            streams[-1].start()
            time.sleep(0.3)

    arriving = threading.Thread(target=arrivals, daemon=True)
    arriving.start()
    while len(streams) < 2:
        time.sleep(0.05)
    t_call = time.perf_counter()
    down = ray.get(engine.scale.remote(2), timeout=300)
    until = time.time() + 30  # Ray's free counts lag the old grid's exit; without room the grid is relaunched
    while ray.available_resources().get("CPU", 0) < 4 + 2 and time.time() < until:
        time.sleep(0.2)
    up = ray.get(engine.scale.remote(4), timeout=300)
    scaled.set()
    arriving.join()
    for s in streams:
        s.join(timeout=300)
    for n, s in enumerate(streams):
        late_one = n >= 16
        prompt, kw = (PROMPTS[n % 8], late[n % 8]) if late_one else (PROMPTS[n], params[n])
        tokens = want_late[n % 8] if late_one else want[n]
        assert not [item for _, item in s.items if "error" in item], f"request {n}"
        assert s.tokens() == tokens, f"request {n} ({prompt!r}, {kw})"
    assert (down["ep"], up["ep"]) == ([4, 2], [2, 4]) and down["action"] == up["action"] == "resize beside"
    assert down["requeued"] + up["requeued"] >= 1
    launched = t_call + down["seconds"]["launched_beside"]  # the new grid was launched while the old one served
    assert sum(len(s.tokens(before=launched)) - len(s.tokens(before=t_call)) for s in streams) > 0
    assert [i["kind"] for i in ray.get(engine.incident_log.remote())] == ["scaled", "scaled"]
    print(f"\nscale down {down['seconds']['total']:.2f}s ({down['requeued']} prefilled again), up "
          f"{up['seconds']['total']:.2f}s ({up['requeued']})")
