"""Serving never stays broken, without Ray: the engine (`serve_engine.Engine`) on a fake grid (fakes/serving.py) that
runs the tiny model in this process (`LocalExecutor`) and loses workers, fails recoveries and relaunches on command.

- a recovery that fails is tried again, then the grid is relaunched; meanwhile `health` says why nothing serves and
  new requests wait; afterwards every request ends with the reference's tokens;
- past serve.unavailable_wait_s with no grid, streams in flight end with an error and new requests are refused
  (503 at the front door), and a later relaunch serves again;
- a recovery that progresses (each phase ended) keeps the streams in flight waiting past serve.unavailable_wait_s,
  and they end with the reference's tokens; one that then fails ends them at once with one readable line;
- an observer that raises does not stop the engine; `expert_load` and `drill` leave the event loop running;
- the serving grid's recovery interrupted by a loss in the grid being built plans on the alive nodes' totals, not on
  Ray's lagging free counts (the 3-round SIGKILL drill with a hot spare still starting)."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
import ray
import torch

from fakes.serving import PROMPTS, SERVE, FakeGrid, collect, reference, sizes, tokens
from k3ray.config import load_config
from k3ray.faults import slow_recovery
from k3ray.grid.calls import TopologyError, WorkerLost
from k3ray.model.decoder import build_stage
from k3ray.serve import grid as serve_grid
from k3ray.serve.engine import Engine


@pytest.fixture(scope="module")
def cfg():
    return load_config("configs/tiny.yaml", {"model.dtype": "float64", "parallel.pp": 1, "parallel.ep": 1,
                                             **{f"serve.{k}": v for k, v in SERVE.items()}})


@pytest.fixture(scope="module")
def model(cfg):
    torch.set_num_threads(1)
    return build_stage(cfg.model, range(cfg.model.n_layers), seed=3)


def test_failed_recoveries_retry_then_relaunch_and_health_says_why(cfg, model):
    grid = FakeGrid(model, sizes(cfg), lose_at={4}, recover_fails=2, relaunch_fails=1)
    grid.gate = threading.Event()
    engine = Engine(cfg, 0, grid)

    async def main():
        streams = [asyncio.create_task(collect(engine, i)) for i in range(len(PROMPTS))]
        while "relaunch" not in grid.calls:  # two recoveries failed; the first relaunch waits at the gate
            await asyncio.sleep(0.01)
        down = engine.health()
        late = asyncio.create_task(collect(engine, 0))  # arrives while no grid serves: waits for one
        await asyncio.sleep(0.2)
        assert not late.done()
        grid.gate.set()
        done = await asyncio.gather(*streams, late)
        return down, done

    down, done = asyncio.run(main())
    assert down["status"] == "unavailable" and "recovery 2 failed: TopologyError" in down["reason"]
    assert down["retry_after"] == 3
    assert engine.health()["status"] == "ok"
    for i, items in enumerate(done[:-1]):
        assert not [x for x in items if "error" in x] and tokens(items) == reference(model, i), f"request {i}"
    assert tokens(done[-1]) == reference(model, 0)
    assert grid.calls == ["recover", "recover", "relaunch", "relaunch"]
    (lost,) = engine.incident_log()
    assert lost["kind"] == "worker_lost" and lost["action"] == "relaunch" and lost["attempts"] == 4
    assert len(lost["failed_attempts"]) == 3 and lost["requeued"] >= 1


def test_no_grid_past_the_deadline_ends_streams_with_an_error_and_refuses_new_requests(cfg, model):
    short = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"unavailable_wait_s": 0.3,
                                                                         "recovery_backoff_s": 0.05})})
    grid = FakeGrid(model, sizes(cfg), lose_at={3}, recover_fails=10**6, relaunch_fails=10**6)
    engine = Engine(short, 0, grid)

    async def main():
        in_flight = await collect(engine, 1)
        refused = await collect(engine, 2)
        assert engine.health()["status"] == "unavailable"
        grid.relaunch_fails = 0  # room again: the next relaunch serves
        while engine.health()["status"] != "ok":
            await asyncio.sleep(0.02)
        return in_flight, refused, await collect(engine, 3)

    in_flight, refused, after = asyncio.run(main())
    assert "accepted" in in_flight[0] and in_flight[-1]["error"] == "internal"
    assert "no serving grid for 0.3s" in in_flight[-1]["message"]
    assert refused == [{"error": "unavailable", "message": refused[0]["message"], "retry_after": 3}]
    assert refused[0]["message"].startswith("no serving grid: relaunch")
    assert tokens(after) == reference(model, 3)


def test_streams_wait_for_a_recovery_that_progresses_past_the_unavailable_wait(cfg, model):
    """Each phase of the recovery ends 0.25 s later (the slow_recovery fault): it takes over 1 s, more than twice
    serve.unavailable_wait_s, yet the streams in flight wait for it and end with the reference's tokens."""
    short = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"unavailable_wait_s": 0.4})})
    grid = FakeGrid(model, sizes(cfg), lose_at={3})
    slow_recovery(grid, 0.25)
    engine = Engine(short, 0, grid)

    async def main():
        return await asyncio.gather(*(collect(engine, i) for i in range(len(PROMPTS))))

    t0 = time.perf_counter()
    done = asyncio.run(main())
    assert time.perf_counter() - t0 > 4 * 0.25
    for i, items in enumerate(done):
        assert not [x for x in items if "error" in x] and tokens(items) == reference(model, i), f"request {i}"
    (lost,) = engine.incident_log()
    assert lost["kind"] == "worker_lost" and lost["attempts"] == 1 and lost["seconds"]["total"] > 4 * 0.25


def test_a_recovery_that_fails_past_the_unavailable_wait_ends_the_streams_with_one_line(cfg, model):
    """The recovery progresses past serve.unavailable_wait_s, then fails: the streams in flight end at once with
    why (the next attempts go on for new requests)."""
    short = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"unavailable_wait_s": 0.4,
                                                                         "recovery_backoff_s": 5.0})})
    grid = FakeGrid(model, sizes(cfg), lose_at={3}, recover_fails=1)
    slow_recovery(grid, 0.25)
    engine = Engine(short, 0, grid)

    async def main():
        t0 = time.perf_counter()
        done = await asyncio.gather(*(collect(engine, i) for i in range(2)))
        return done, time.perf_counter() - t0

    done, seconds = asyncio.run(main())
    assert seconds < 4 * 0.25 + 2.0  # at the failure, not after the backoff and the next attempt
    for items in done:
        assert "accepted" in items[0] and items[-1]["error"] == "internal"
        message = items[-1]["message"]
        assert re.match(r"no serving grid for 1\.\ds: recovery 1 failed: TopologyError: lost world ranks \[0\]",
                        message), message
        assert "\n" not in message


def test_a_grid_that_keeps_failing_without_a_lost_worker_is_relaunched(cfg, model):
    """Iterations 2-4 fail with no worker lost: the requests in them end with the error, the third failure in a row
    relaunches the grid, and the next requests get the reference's tokens."""
    grid = FakeGrid(model, sizes(cfg))
    grid.fail_at = {2, 3, 4}
    engine = Engine(cfg, 0, grid)
    engine.loop.overlap = False  # one grid call per iteration (overlapped, a failure's successor in flight is one more)

    async def main():
        failed = [await collect(engine, i) for i in range(3)]
        return failed, await asyncio.gather(*(collect(engine, i) for i in range(2)))

    failed, after = asyncio.run(main())
    assert all(items[-1]["error"] == "internal" and "connection closed" in items[-1]["message"] for items in failed)
    assert grid.calls == ["relaunch"]
    kinds = [i["kind"] for i in engine.incident_log()]
    assert kinds == ["iteration_failed", "iteration_failed", "grid_broken", "iteration_failed"]
    assert "3 grid calls in a row failed" in engine.incident_log()[2]["why"]
    assert [tokens(items) for items in after] == [reference(model, 0), reference(model, 1)]


def test_an_observer_that_raises_does_not_stop_the_engine(cfg, model):
    class Broken:
        expert_load_every = 5
        seen = 0

        def iteration(self, changed, sched, seconds):
            Broken.seen += 1
            raise RuntimeError("metrics backend down")

        def expert_load(self, loads, home, copies):
            raise RuntimeError("metrics backend down")

    engine = Engine(cfg, 0, FakeGrid(model, sizes(cfg)), observers=[Broken()])

    async def main():
        return await asyncio.gather(*(collect(engine, i, timeout_s=30) for i in range(2)))

    for i, items in enumerate(asyncio.run(main())):
        assert tokens(items) == reference(model, i)
    assert Broken.seen > 3


@pytest.mark.parametrize("call", ["expert_load", "drill"])
def test_expert_load_and_drill_leave_the_event_loop_running(cfg, model, monkeypatch, call):
    """The grid call takes 0.5 s (the workers' answers, a kill): meanwhile the engine's event loop keeps ticking."""
    from k3ray.serve import engine as serve_engine

    monkeypatch.setattr(serve_engine, "inject", lambda *args: time.sleep(0.5))
    engine = Engine(cfg, 0, FakeGrid(model, sizes(cfg)))

    async def main():
        ticks = [0]

        async def tick():
            while True:
                ticks[0] += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        result = engine.expert_load() if call == "expert_load" else engine.drill("kill_worker", [0])
        if asyncio.iscoroutine(result):
            await result
        ticker.cancel()
        return ticks[0]

    assert asyncio.run(main()) > 10


# -- the serving grid's recovery (plain Python over a fake WorkerGroup) --------------------------------------------
class FakeGroup:
    """WorkerGroup's recovery surface: 5 CPUs alive in total; Ray's free count lags right after a close (0 free);
    the first `lose_in_assume` grids launched or rebuilt in place lose world rank 0 while taking their places."""
    launched: list[int] = []
    lose_in_assume = 1

    def __init__(self, cfg, ep, home, avoid_nodes=frozenset(), serving=False):
        self.cfg, self.pp, self.ep, self.home = cfg, cfg.parallel.pp, ep, list(home)
        self.launch_seconds, self.spares, self.generation = {}, [], 1
        self.worker_start_seconds, self.calls = {}, []
        self.alive_nodes = self.resources = self  # the group's parts: this fake plays them itself

    def capacity(self, free: bool = False) -> int:
        return 0 if free else 5

    def spares_ready(self) -> int:
        return 0  # the replacement spare is still starting

    def standing_by(self, ranks: set[int]) -> frozenset[int]:
        return frozenset()  # no standbys (CPU)

    def start_standbys(self) -> int:
        return 0

    def close(self) -> None:
        pass

    def launch(self, timeout_s, restore=None, wait_for_spares=True):
        FakeGroup.launched.append(self.ep)
        if len(FakeGroup.launched) <= FakeGroup.lose_in_assume:
            raise WorkerLost({0}, "ActorDiedError in assume")
        self.launch_seconds = {"place_and_start_workers": 0.0}

    def regroup(self, lost, ep, home, keep, spare_for, restore, timeout_s):
        self.ep, self.home, self.generation = ep, list(home), self.generation + 1
        self.launch(timeout_s, restore)

    def call(self, method, *args, timeout_s=None):
        self.calls.append((method, *args))
        return []


def test_recovery_interrupted_in_assume_plans_on_the_nodes_totals(cfg, monkeypatch):
    """pp=2 x ep=2 with a hot spare still starting loses a worker; the grid rebuilt around the surviving column loses
    rank 0 in `assume` (the drill's next SIGKILL), so the next is launched anew. Planning it on Ray's free count,
    which lags the closed grids, found no room and failed serving for good ('the alive nodes hold no 2-stage
    grid')."""
    monkeypatch.setattr(serve_grid, "WorkerGroup", FakeGroup)
    monkeypatch.setattr(ray, "put", lambda x: x)
    FakeGroup.launched = []
    grid_cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"pp": 2, "ep": 2}),
                                      "fault_tolerance": cfg.fault_tolerance.model_copy(update={"spares": 1})})
    grid = serve_grid.ServingGrid(grid_cfg, {})
    grid.group = FakeGroup(grid_cfg, 2, serve_grid.recovery.grow(cfg.model.n_experts, 2).tolist())
    out = grid.recover(WorkerLost({3}, "ActorDiedError in serve_step"))
    assert out["interrupted"] == ["lost world ranks [0]: ActorDiedError in assume"]
    assert len(FakeGroup.launched) == 2 and grid.group.ep == out["ep"][-1] >= 1


def test_a_recovered_grid_captures_the_graphs_of_the_traffic_served_most_used_first(cfg, monkeypatch):
    """The serving grid counts its iterations' decode shapes; the grid a recovery launches is handed them, most
    used first, for its decode graphs (the first grid, before any traffic, is handed none: the likeliest then)."""
    from k3ray.parallel.serving import RankPlan

    monkeypatch.setattr(serve_grid, "WorkerGroup", FakeGroup)
    monkeypatch.setattr(ray, "put", lambda x: x)
    FakeGroup.launched, FakeGroup.lose_in_assume = [], 0
    grid_cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"pages_per_rank": 32})})
    grid = serve_grid.ServingGrid(grid_cfg, {})
    grid.launch(1)
    assert [c[-1] for c in grid.group.calls if c[0] == "serve_init"] == [None]
    grid.graph.submit = lambda group, plans, timeout_s: None  # no workers: only the shapes are counted
    sampled = RankPlan(slots=[0, 1], starts=[40, 7], counts=[1, 1])
    for _ in range(3):
        grid.submit({0: sampled})
    grid.submit({0: RankPlan(slots=[0], starts=[3], counts=[1], greedy=True)})
    grid.recover(WorkerLost({0}, "ActorDiedError in serve_step"))
    assert [c[-1] for c in grid.group.calls if c[0] == "serve_init"] == [[(2, 64, False), (1, 4, True)]]


def test_a_worker_gone_before_the_serving_graph_compiles_is_a_lost_worker(monkeypatch):
    """A grid rebuilt by a recovery can lose a worker before its first iteration compiles the graph: that is a lost
    worker (recovered again), not an iteration that fails every request."""
    from ray.exceptions import ActorDiedError

    from k3ray.serve.dag import ServingGraph

    group = type("Group", (), {"generation": 7, "ep": 2, "size": 4, "workers": [], "dead_ranks": lambda self: {1}})()

    def compile_over_a_dead_worker(self, group):
        raise ActorDiedError()

    monkeypatch.setattr(ServingGraph, "_compile", compile_over_a_dead_worker)
    with pytest.raises(WorkerLost) as lost:
        ServingGraph().run(group, {0: None, 1: None}, timeout_s=5)
    assert lost.value.ranks == {1} and not lost.value.hung
