"""The job's start point, against the fake worker group (fakes/training.py, no Ray): a job's first boundary takes
no snapshot; until the first one has arrived, a lost worker or a blow-up goes back to where the job started (the
seed, or the checkpoint it resumed from) and replays from there, with the results of a run that never failed."""
from __future__ import annotations

import pytest

from fakes.training import Cluster, clean_run, resume, run, states
from k3ray.grid.snapshots import StartPoint


def test_the_first_boundary_takes_no_snapshot_the_start_point_stands_in():
    cluster = Cluster()
    ctrl = run(cluster, 4, **{"parallel.ep": 2})  # snapshot_every 4
    assert cluster.seen.get("stage_snapshot", 0) == 0 and ctrl.status()["snapshots"]["committed"] == 0
    start = ctrl.snapshots.committed
    assert isinstance(start, StartPoint) and start.step == 0 and start.sources() is None
    assert cluster.warmed_after == [(0,)]  # the stores are warmed once, after the first step, for the first snapshot
    ctrl.train_step(4)
    assert cluster.seen["stage_snapshot"] == 1 and ctrl.snapshots.committed.step == 4
    assert ctrl.status()["snapshots"]["committed"] == 1


def test_a_worker_lost_before_the_first_snapshot_replays_from_the_seed():
    cluster = Cluster(capacity=4, lose={2: 1})
    ctrl = run(cluster, 6, **{"parallel.ep": 2, "fault_tolerance.grow_back": False})
    (lost,) = ctrl.incidents
    assert lost["kind"] == "worker_lost" and lost["replayed_steps"] == [0, 2] and lost["ep"] == [2, 1]
    assert ("regroup", [1], 1, [0], []) in cluster.calls  # in place, the survivor initialised from the seed
    assert cluster.groups[-1].trained == clean_run(6, **{"parallel.ep": 2}) == tuple(range(6))
    assert states(ctrl) == ["scheduling", "running", "recovering", "running"]


@pytest.mark.parametrize("in_place", [True, False])
def test_a_snapshot_lost_with_its_node_gives_way_to_the_start_point(in_place):
    """The step-4 snapshot's parts were on the lost node and no neighbour had mapped a copy yet: the restore reads
    the start point instead (rebuilt from the seed) and replays from step 0, with the results of an unfailed run,
    whether the grid is rebuilt in place (a survivor per stage) or launched anew (a lost stage)."""
    cluster = Cluster(capacity=4, lose={6: 1})
    cluster.snapshots_lost = 1
    grid = {"parallel.ep": 2} if in_place else {"parallel.pp": 2}
    ctrl = run(cluster, 8, **grid, **{"fault_tolerance.grow_back": False})
    (lost,) = [i for i in ctrl.incidents if i["kind"] == "worker_lost"]
    assert lost["snapshot_lost"] == 4 and lost["replayed_steps"] == [0, 6], lost
    assert ctrl.status()["snapshots"]["lost"] == [4]
    assert cluster.groups[-1].trained == clean_run(8, **grid) == tuple(range(8))


def test_a_lost_stage_before_the_first_snapshot_launches_the_grid_anew_from_the_seed():
    cluster = Cluster(lose={0: 1})
    ctrl = run(cluster, 3, **{"parallel.pp": 2})
    (lost,) = ctrl.incidents
    assert lost["action"] == "restart" and lost["replayed_steps"] == [0, 0]
    assert cluster.groups[-1].trained == (0, 1, 2)


def test_a_blowup_before_the_first_snapshot_rolls_back_to_the_seed_and_equals_a_run_that_skipped_the_batch():
    cluster = Cluster(nan_batches={2})
    ctrl = run(cluster, 6, **{"parallel.ep": 2})
    (incident,) = ctrl.incidents
    assert incident["kind"] == "blowup" and incident["batch_ids"] == [2]
    assert ("regroup", [], 2, [0, 1], []) in cluster.calls  # the grid rebuilt in place from the seed
    assert cluster.groups[-1].trained == clean_run(6, **{"parallel.ep": 2, "data.skip_batches": [2]})
    assert cluster.groups[-1].trained == (0, 1, 3, 4, 5, 6)
    assert "rolled back to step 0" in ctrl.machine.history[-1][2]


def test_a_worker_lost_before_the_first_snapshot_of_a_resumed_job_restores_the_checkpoint(tmp_path):
    """Resumed at step 6 (checkpoint every 3 steps), snapshots every 4: until step 8's snapshot the checkpoint it
    resumed from is the state to go back to (before, a loss here stopped the job: no snapshot yet)."""
    checkpointed_at_6 = {"checkpoint.every_n_steps": 3}
    ctrl = run(Cluster(), 7, **{"checkpoint.dir": str(tmp_path), **checkpointed_at_6})
    ctrl.shutdown()
    ctrl, status, cluster = resume(tmp_path, **checkpointed_at_6, **{"parallel.ep": 1})
    assert status["step"] == 6 and ctrl.snapshots.committed.step == 6
    assert ctrl.snapshots.committed.sources() is not None  # the checkpoint's parts
    cluster.lose = {7: 0}
    for s in range(6, 9):
        ctrl.train_step(s)
    (lost,) = [i for i in ctrl.incidents if i["kind"] == "worker_lost"]
    assert lost["action"] == "restart" and lost["replayed_steps"] == [6, 7]
    assert cluster.groups[-1].trained == tuple(range(9))
    assert ctrl.snapshots.committed.step == 8 and cluster.seen["stage_snapshot"] == 1  # no snapshot at step 6


def test_auto_snapshots_come_as_close_as_their_cost_allows():
    """snapshot_every auto: the first snapshot FIRST_AUTO steps after the start point; these cost microseconds
    against 1-s steps and arrive at once, so from then on one at every boundary (a loss replays nothing)."""
    cluster = Cluster()
    ctrl = run(cluster, 9, **{"parallel.ep": 2, "fault_tolerance.snapshot_every": "auto"})
    assert cluster.snapshot_steps == [5, 6, 7, 8] and ctrl.status()["snapshots"]["every"] == 1
    fixed = Cluster()
    run(fixed, 9, **{"parallel.ep": 2, "fault_tolerance.snapshot_every": 3})
    assert fixed.snapshot_steps == [3, 6]


def test_the_auto_interval_is_the_least_that_keeps_the_cost_in_budget_and_lets_each_snapshot_arrive():
    from k3ray.policies.snapshot_cadence import MOST_STEPS, snapshot_interval
    assert snapshot_interval(cost_s=0.01, step_s=1.0, arrival_steps=1, budget=0.02) == 1  # CPU tiny: every step
    assert snapshot_interval(cost_s=0.3, step_s=0.885, arrival_steps=4, budget=0.02) == 17  # 0.3 / (0.02 x 0.885)
    assert snapshot_interval(cost_s=0.02, step_s=0.885, arrival_steps=4, budget=0.02) == 4  # found arrived 4th poll
    assert snapshot_interval(cost_s=50.0, step_s=1.0, arrival_steps=1, budget=0.02) == MOST_STEPS
    assert snapshot_interval(cost_s=0.0, step_s=0.0, arrival_steps=1, budget=0.02) == MOST_STEPS
    # one snapshot at a time: while one arrives a loss goes back to the base; they arrive in 1 step of 10 at most
    assert snapshot_interval(cost_s=0.3, step_s=0.62, arrival_steps=12, budget=0.02, one_at_a_time=True) == 120
    assert snapshot_interval(cost_s=0.3, step_s=0.62, arrival_steps=12, budget=0.02) == 25  # two held: at arrival
    assert snapshot_interval(cost_s=0.01, step_s=1.0, arrival_steps=1, budget=0.02, one_at_a_time=True) == 1


def test_snapshots_held_one_at_a_time_are_spaced_so_few_steps_fall_while_one_arrives():
    """The cadence asks the policy with the store's fit: a snapshot that took 12 steps to arrive, in a store that
    holds one, is followed by the next 120 steps after (two held: 25, its cost's)."""
    from types import SimpleNamespace

    from k3ray.config.train import FaultToleranceConfig
    from k3ray.train.snapshot_cadence import SnapshotCadence

    for one_at_a_time, interval in ((True, 120), (False, 25)):
        cadence = SnapshotCadence(FaultToleranceConfig(snapshot_every="auto"))
        snaps = SimpleNamespace(total_seconds=[1.0], stall_seconds=[0.3], read_wait_seconds=[], arrival_steps=[12],
                                one_at_a_time=one_at_a_time)
        cadence.after_step(0.62, snaps)
        assert cadence.interval == interval
