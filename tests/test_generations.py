"""Grid generations without Ray: a left engine refuses its collectives (never the default group, which is the newest
grid's), a worker refuses calls for an older generation, and the one failure path of calls to workers (`calls.gather`)
reports a dead worker after a short grace for the survivors, and errors with no worker lost in one line."""
from __future__ import annotations

import pytest
import torch.distributed as dist
from ray.exceptions import RayActorError, RayTaskError

from k3ray.config import load_config
from k3ray.control.local_nodes import free_port
from k3ray.grid import worker_group
from k3ray.grid.calls import AFTER_DEATH_GRACE_S, WorkerError, WorkerLost, gather
from k3ray.grid.worker import fenced
from k3ray.grid.worker_seat import StaleGeneration, WorkerSeat
from k3ray.grid.worker_group import WorkerGroup
from k3ray.parallel.engine import StageEngine
from k3ray.parallel.grid_groups import LeftGrid


def engine(generation: int) -> StageEngine:
    cfg = load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 1, "train.eval_batches": 1})
    e = StageEngine(cfg, 0, 0, [0] * cfg.model.n_experts, 1)
    e.init_process_groups(f"tcp://127.0.0.1:{free_port()}", "gloo", generation)
    return e


def test_a_left_grids_engine_refuses_collectives_instead_of_using_the_new_grids_default_group():
    old = engine(1)
    old.leave_process_groups()
    new = engine(2)  # the worker joined the next grid: the default group is now generation 2's
    try:
        with pytest.raises(LeftGrid, match="generation 1 was left"):
            old.evaluate()  # a stale thread's collective on the old engine
        with pytest.raises(LeftGrid):
            dist.all_reduce(__import__("torch").zeros(1), group=old.ctx.group)  # the EP context's group too
        assert new.evaluate() > 0  # the new grid's engine is unaffected
    finally:
        new.leave_process_groups()


class Holder:
    """The Worker's fencing on a plain class (the actor is this pattern plus Ray)."""

    def __init__(self):
        self.seat = WorkerSeat(None, "cpu")

    @fenced
    def train_step(self, step: int) -> int:
        return step


def test_a_worker_refuses_calls_for_an_older_generation():
    w = Holder()
    w.seat.join_generation(3, "assume")
    assert w.train_step(3, 7) == 7 and w.train_step(4, 8) == 8
    with pytest.raises(StaleGeneration, match="generation 2 refused: this worker holds generation 3"):
        w.train_step(2, 9)  # queued before the regroup


class FakeRef:
    def __init__(self, rank: int, at: float, result=None, error: Exception | None = None):
        self.rank, self.at, self.result, self.error = rank, at, result, error


class Clock:
    """ray.wait/ray.get over FakeRefs that complete at given times of a fake clock (no sleeping)."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(worker_group.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(worker_group.ray, "wait", self.wait)
        monkeypatch.setattr(worker_group.ray, "get", self.get)
        self.got: list[int] = []

    def wait(self, refs, num_returns=1, timeout=None, **_):
        due = sorted(refs, key=lambda r: r.at)
        first = due[0]
        if timeout is not None and first.at > self.now + timeout:
            self.now += timeout
            return [], refs
        self.now = max(self.now, first.at)
        return [first], [r for r in refs if r is not first]

    def get(self, ref):
        self.got.append(ref.rank)
        if ref.error is not None:
            raise ref.error
        return ref.result


def group(monkeypatch) -> WorkerGroup:
    cfg = load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 4})
    g = WorkerGroup(cfg, 4, [0] * cfg.model.n_experts)
    monkeypatch.setattr(g, "dead_ranks", lambda exclude=frozenset(), timeout_s=2.0: set())
    return g


def test_gather_reports_a_dead_worker_after_a_short_grace_without_waiting_for_the_survivors(monkeypatch):
    clock = Clock(monkeypatch)
    g = group(monkeypatch)
    calls = [(0, FakeRef(0, 1.0, error=RayActorError())),  # dies first
             (1, FakeRef(1, 1.2, error=RayTaskError("train_step", "gloo: peer closed", ValueError("peer")))),
             (2, FakeRef(2, 4.0, result={}))]  # still computing (or blocked in a collective) when rank 0 died
    with pytest.raises(WorkerLost) as lost:
        gather(calls, 100.0, "step 5", g.dead_ranks)
    assert lost.value.ranks == {0} and not lost.value.hung  # rank 2 is pinged (alive), not taken for hung
    assert clock.got == [0, 1] and clock.now == pytest.approx(1.0 + AFTER_DEATH_GRACE_S)


def test_gather_gives_up_on_survivors_after_the_grace(monkeypatch):
    clock = Clock(monkeypatch)
    g = group(monkeypatch)
    calls = [(0, FakeRef(0, 1.0, error=RayActorError())), (1, FakeRef(1, 50.0, result={}))]
    with pytest.raises(WorkerLost) as lost:
        gather(calls, 100.0, "step 5", g.dead_ranks, grace_s=5.0)
    assert lost.value.ranks == {0} and clock.now == pytest.approx(1.0 + AFTER_DEATH_GRACE_S)  # not 50 s


def test_errors_of_every_rank_with_none_lost_are_one_readable_line(monkeypatch):
    Clock(monkeypatch)
    g = group(monkeypatch)
    calls = [(r, FakeRef(r, 1.0 + r, error=RayTaskError("evaluate", "Traceback...\nFileNotFoundError: data/x",
                                                        FileNotFoundError("data/x: no such corpus"))))
             for r in range(2)]
    with pytest.raises(WorkerError) as err:
        gather(calls, 10.0, "evaluate", g.dead_ranks)
    text = str(err.value)
    assert "\n" not in text and text.startswith("evaluate failed on 2 of 2 workers (rank 0: ")
    assert "data/x: no such corpus" in text


def test_a_worker_whose_constructor_raised_is_an_error_to_show_not_a_loss_to_recover(monkeypatch):
    Clock(monkeypatch)
    g = group(monkeypatch)
    init = RayActorError(error_msg="The actor died because of an error raised in its creation task, ray::Worker"
                                   ".__init__()\nk3ray.config.ConfigError: data.source='/x' is neither 'stdlib' "
                                   "nor a directory", actor_init_failed=True)
    with pytest.raises(WorkerError, match=r"rank 0: .*data.source='/x' is neither 'stdlib' nor a directory\)$"):
        gather([(0, FakeRef(0, 1.0, error=init)), (1, FakeRef(1, 1.0, error=init))], 10.0, "assume",
               g.dead_ranks)


def test_worker_lost_crosses_ray_whole():
    import pickle

    back = pickle.loads(pickle.dumps(WorkerLost({1, 3}, "ActorDiedError in step 4", hung=True)))
    assert back.ranks == {1, 3} and back.hung and str(back) == "lost world ranks [1, 3]: ActorDiedError in step 4"


def plain_worker(generation: int):
    """A Worker's own class (the actor's, without Ray) on standby at `generation`."""
    from k3ray.grid.worker import Worker

    w = object.__new__(Worker.__ray_metadata__.modified_class.__mro__[1])
    w.own_parts(load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 1}), "cpu")
    w.seat.generation = generation
    return w


def test_taking_a_new_place_keeps_the_neighbours_snapshot_copies_for_the_restore_that_follows():
    w = plain_worker(1)
    w.state.peer_snapshots = {3: (8, "rank 3's snapshot of step 8")}  # perhaps the only copy left of a lost node's
    w.call(2, "assume", 0, 0, [0] * w.seat.cfg.model.n_experts, 1, False)  # a regroup: the restore reads them next
    assert w.state.peer_snapshots == {3: (8, "rank 3's snapshot of step 8")} and w.seat.generation == 2
    with pytest.raises(StaleGeneration):
        w.call(1, "stand_by")
    w.call(3, "stand_by")  # left out of the grid: standing by, it holds nothing of the grid's
    assert w.state.peer_snapshots == {} and w.seat.engine is None


class Starting:
    """What starting a Worker returns here: an actor whose `node_id` answer is still pending."""

    class node_id:  # noqa: N801 - the actor method's name
        @staticmethod
        def remote() -> str:
            return "pending"


def test_a_spare_that_never_comes_up_is_given_up_and_its_slot_on_a_silent_node_never_reused(monkeypatch):
    from k3ray.grid import spares
    from k3ray.grid.spares import Spare, SparePool

    monkeypatch.setattr(spares.ray, "wait", lambda refs, **_: ([], refs))  # never answers
    killed = []
    monkeypatch.setattr(spares.ray, "kill", lambda actor, no_restart: killed.append(actor))
    monkeypatch.setattr(spares.time, "monotonic", lambda: 1000.0)
    pool = SparePool(2)
    pool.spares = [Spare("starting", ("pg", 0), "up", None, started=990.0),
                   Spare("stuck", ("pg", 1), "up", None, started=1000.0 - spares.SPARE_START_TIMEOUT_S - 1)]
    healthy = {"ok"}  # alive and not silent
    assert pool.ready(healthy) == 0
    assert [s.actor for s in pool] == ["starting"] and killed == ["stuck"]  # a new one can start elsewhere
    assert pool.free_slots == []  # its slot (node unknown) is not handed to the next spare
    pool.free(("pg", 2), "silent", healthy)  # a lost rank's slot on a silent node
    pool.free(("pg", 3), "ok", healthy)
    assert pool.free_slots == [("pg", 3)]
    started = pool.start(room=0, start_worker=lambda slot: Starting(), new_slot=lambda: ("new", 0))
    assert started == 1 and pool.free_slots == [] and [s.slot for s in pool][-1] == ("pg", 3)


def test_every_grid_joined_takes_a_new_generation_that_its_workers_are_told(monkeypatch):
    """Launched, grown or rebuilt around spares: each join numbers the grid anew, so a call (or a compiled serving
    graph) made for the grid before is refused or rebuilt, never run on the new one."""
    cfg = load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 2})
    told = []

    def fake_calls(group: WorkerGroup) -> WorkerGroup:
        monkeypatch.setattr(group, "call_each", lambda method, args, timeout_s=None: (
            told.append((method, group.generation)) or {r: ("127.0.0.1", 1) for r in args}))
        monkeypatch.setattr(group, "call", lambda method, *args, timeout_s=None: told.append(
            (method, group.generation)))
        return group

    home = [e % 2 for e in range(cfg.model.n_experts)]
    first, second = fake_calls(WorkerGroup(cfg, 2, home)), fake_calls(WorkerGroup(cfg, 2, home))
    generations = []
    for group in (first, second, first):
        group._join(10.0, None, 0.0, "place_and_start_workers")
        generations.append(group.generation)
    assert generations[0] < generations[1] < generations[2]
    assert [gen for method, gen in told if method == "assume"] == generations
