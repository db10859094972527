"""The controller's logic without Ray: its state machine, rollback, the failure ladder's escalation, shrink-or-restart
and growing back, driven against a fake worker group (fakes/training.py) in milliseconds (the real group is covered
by test_faults.py).

The fake group's "model" is the tuple of batches it has trained on, so a rollback that replays exactly is visible as
the same tuple a run that never saw the bad batch ends with."""
from __future__ import annotations

import pytest
import torch

from fakes.training import Cluster, clean_run, config, resume, run, states
from k3ray.grid.calls import TopologyError
from k3ray.io import checkpoint as ckpt
from k3ray.io.checkpoint import part_name
from k3ray.policies import ladder, recovery
from k3ray.train.controller import Controller, GuardError
from k3ray.train.failures import RecoveryFailed
from k3ray.train.state import TRANSITIONS, IllegalTransition, JobState, StateMachine

def test_every_transition_is_checked_against_the_table():
    machine = StateMachine()
    machine.to(JobState.SCHEDULING, "start")
    with pytest.raises(IllegalTransition, match="scheduling -> recovering"):
        machine.to(JobState.RECOVERING)
    machine.to(JobState.RUNNING)
    machine.to(JobState.FINISHED)
    assert machine.done and [s for _, s, _ in machine.history] == ["scheduling", "running", "finished"]
    assert all(not TRANSITIONS[s] for s in (JobState.FINISHED, JobState.ERRORED))  # final states


def test_steps_run_through_scheduling_running_finished():
    cluster = Cluster()
    ctrl = run(cluster, 3, **{"parallel.ep": 2})
    ctrl.shutdown()
    assert states(ctrl) == ["scheduling", "running", "finished"]
    assert cluster.groups[-1].trained == (0, 1, 2) and not cluster.groups[-1].alive


def test_topology_that_does_not_fit_errors():
    ctrl = Controller(config(**{"parallel.ep": 4}), group_factory=Cluster(capacity=2).group)
    with pytest.raises(TopologyError):
        ctrl.start()
    assert ctrl.machine.state == JobState.ERRORED


def test_blowup_rolls_back_and_equals_a_run_that_skipped_the_batch():
    cluster = Cluster(nan_batches={6})
    ctrl = run(cluster, 10, **{"parallel.ep": 2})
    (incident,) = ctrl.incidents
    assert incident["kind"] == "blowup" and incident["rule"] == "nonfinite_loss" and incident["batch_ids"] == [6]
    assert states(ctrl) == ["scheduling", "running", "recovering", "running"]
    clean = Cluster()
    run(clean, 10, **{"parallel.ep": 2, "data.skip_batches": [6]})
    assert cluster.groups[-1].trained == clean.groups[-1].trained == (0, 1, 2, 3, 4, 5, 7, 8, 9, 10)


def test_a_step_asked_to_run_ahead_announces_the_batch_its_data_order_gives_next():
    """The next batch in data order, past the skipped ones; after a blow-up, the steps replayed from the start point
    announce none (a replay runs on), and the attempt that runs again the one after its own batch; without `ahead`
    none."""
    cluster = Cluster(nan_batches={3})
    ctrl = Controller(config(**{"data.skip_batches": [5], "fault_tolerance.snapshot_every": 100}),
                      group_factory=cluster.group)
    ctrl.start()
    for s in range(5):
        ctrl.train_step(s, ahead=s < 4)
    ctrl.shutdown()
    assert cluster.announced == [(0, 0, 1), (1, 1, 2), (2, 2, 3), (3, 3, 4),  # batch 3 blows up
                                 (0, 0, None), (1, 1, None), (2, 2, None),  # replayed from the start point
                                 (3, 4, 6), (4, 6, None)]


def test_a_step_before_a_snapshot_does_not_run_ahead():
    """The boundary after it stages a snapshot, whose copies must not queue behind the next step's work: the steps
    before boundaries 4 and 8 (snapshot_every 4) announce no next batch, the others theirs."""
    cluster = Cluster()
    ctrl = Controller(config(), group_factory=cluster.group)
    ctrl.start()
    for s in range(9):
        ctrl.train_step(s, ahead=True)
    ctrl.shutdown()
    assert [(step, nxt) for step, _, nxt in cluster.announced] == \
        [(0, 1), (1, 2), (2, 3), (3, None), (4, 5), (5, 6), (6, 7), (7, None), (8, 9)]


def test_repeated_blowups_escalate_skip_more_lower_lr_then_stop():
    cluster = Cluster(nan_batches=range(5, 100))
    ctrl = Controller(config(**{"fault_tolerance.max_retries_per_step": 2}), group_factory=cluster.group)
    ctrl.start()
    for s in range(5):
        ctrl.train_step(s)
    with pytest.raises(GuardError, match="guard tripped 3 times"):
        ctrl.train_step(5)
    assert [i["batch_ids"] for i in ctrl.incidents] == [[5], [6, 7], [8, 9, 10, 11]]
    assert [i["action"] for i in ctrl.incidents] == ["rollback", "rollback", "stop"]
    assert [c[1] for c in cluster.calls if c[0] == "set_lr_scale"] == [1.0, 0.5]
    assert ctrl.machine.state == JobState.ERRORED and ctrl.status()["lr_scale"] == 0.5
    ctrl.shutdown()
    assert ctrl.machine.state == JobState.ERRORED  # stays errored: no transition out of it


def test_lost_worker_shrinks_rehomes_replays_then_grows_back():
    cluster = Cluster(capacity=4, lose={6: 2})
    ctrl = run(cluster, 7, **{"parallel.ep": 4, "fault_tolerance.grow_back_after_steps": 2})
    (lost,) = ctrl.incidents
    assert lost["kind"] == "worker_lost" and lost["action"] == "reshard" and lost["ep"] == [4, 3]
    home = ctrl.placement()["home"]
    assert sorted(set(home)) == [0, 1, 2] and home[:8] == [0] * 4 + [1] * 4  # survivors keep theirs
    assert cluster.groups[-1].trained == tuple(range(7))  # replayed from the step-4 snapshot, then step 6
    assert ctrl.status()["ep"] == 3
    cluster.capacity = 7  # 3 running + 4 free: the full grid fits again
    ctrl.train_step(7)
    ctrl.train_step(8)
    assert [i["kind"] for i in ctrl.incidents] == ["worker_lost", "grow_back"]
    assert ctrl.status()["ep"] == 4 and ctrl.placement()["home"] == recovery.grow(16, 4).tolist()
    assert states(ctrl) == ["scheduling", "running", "recovering", "running", "resizing", "running"]


def test_after_a_scale_down_a_loss_grows_back_to_the_size_asked_for_not_the_configured_one():
    cluster = Cluster(capacity=8)
    ctrl = run(cluster, 2, **{"parallel.ep": 4, "fault_tolerance.grow_back_after_steps": 1})
    ctrl.request_scale(2)
    ctrl.train_step(2)
    assert ctrl.status()["ep"] == 2 and ctrl.status()["ep_target"] == 2
    cluster.lose[3] = 1
    ctrl.train_step(3)  # the loss leaves 1 rank
    assert ctrl.status()["ep"] == 1
    for s in range(4, 7):
        ctrl.train_step(s)
    assert [i["kind"] for i in ctrl.incidents] == ["scaled", "worker_lost", "grow_back"]
    assert ctrl.incidents[-1]["ep"] == [1, 2] and ctrl.status()["ep"] == 2  # never back to parallel.ep=4
    ctrl.request_scale(4)
    ctrl.train_step(7)
    assert ctrl.status()["ep"] == 4 and ctrl.status()["ep_target"] == 4
    assert cluster.groups[-1].trained == tuple(range(8))


def test_lost_stage_restarts_the_same_grid():
    cluster = Cluster(lose={5: 1})
    ctrl = run(cluster, 6, **{"parallel.pp": 2, "parallel.ep": 1})
    (lost,) = ctrl.incidents
    assert lost["action"] == "restart" and lost["ep"] == [1, 1]
    assert cluster.groups[-1].trained == tuple(range(6))


def test_policy_change_reaches_the_workers_at_the_next_step():
    cluster = Cluster()
    ctrl = run(cluster, 1, **{"parallel.ep": 2})
    ctrl.set_policy("moonep", {"enabled": False}, "test")
    pushed = [c[1] for c in cluster.calls if c[0] == "set_policies"]
    assert len(pushed) == 1 and pushed[0]["moonep"]["enabled"] is True
    ctrl.train_step(1)
    pushed = [c[1] for c in cluster.calls if c[0] == "set_policies"]
    assert pushed[-1]["moonep"]["enabled"] is False and ctrl.audit_log()[-1]["applies_at_step"] == 1


def test_failure_ladder_decisions():
    ft = config().fault_tolerance  # skip_growth 2, lr_backoff 0.5, max_retries_per_step 3
    assert ladder.on_trip(1, 10, 1.0, ft) == ladder.TripDecision("rollback", (10,), 1.0)
    assert ladder.on_trip(2, 10, 1.0, ft) == ladder.TripDecision("rollback", (10, 11), 0.5)
    assert ladder.on_trip(4, 10, 0.25, ft).action == "stop"


def test_shrink_or_restart_decisions():
    home = recovery.grow(8, 4)
    load = torch.ones(8)
    shrunk = recovery.on_workers_lost(home, 4, {5}, load)  # world rank 5 of a pp=2 x ep=4 grid: EP rank 1
    assert shrunk.action == "reshard" and shrunk.ep == 3 and sorted(set(shrunk.home.tolist())) == [0, 1, 2]
    restart = recovery.on_workers_lost(recovery.grow(8, 1), 1, {1}, load)
    assert restart.action == "restart" and restart.ep == 1


def test_a_shrink_is_carried_out_in_place_unless_a_node_is_lost():
    home, load = recovery.grow(8, 4), torch.ones(8)
    assert recovery.on_workers_lost(home, 4, {5}, load).in_place  # a worker died: its survivors regroup
    assert not recovery.on_workers_lost(home, 4, {5}, load, nodes_lost=True).in_place
    assert not recovery.on_workers_lost(home, 4, {5}, load, max_ep=3).in_place  # a plan for a grid launched anew
    assert recovery.on_workers_lost(home, 4, {5}, load, spares=1, nodes_lost=True).in_place  # a spare fills in
    assert not recovery.on_workers_lost(recovery.grow(8, 1), 1, {1}, load).in_place  # restart: nothing to keep
    assert recovery.on_lost_nodes(["a", "a", "b", "b"], {2}, healthy={"a"})
    assert not recovery.on_lost_nodes(["a", "a", "b", "b"], {2}, healthy={"a", "b"})  # only the process died


def test_silent_nodes_are_those_whose_every_rank_hung():
    nodes = ["a", "a", "b", "b"]
    assert recovery.silent_nodes(nodes, {2, 3}) == {"b"}
    assert recovery.silent_nodes(nodes, {1, 2, 3}) == {"b"}  # a's rank 0 answered: a hung worker, not a node
    assert recovery.silent_nodes(nodes, {3}) == set()
    assert recovery.silent_nodes(nodes, {0, 1, 2, 3}) == set()  # every node silent: evidence against none
    # a rank whose bundle Ray is placing again (its node lost) has no node: none is kept off for it (an empty id
    # would be a placement label selector Ray refuses)
    assert recovery.silent_nodes(["a", "a", "", ""], {2, 3}) == set()


# -- hot spares ------------------------------------------------------------------------------------------------------
def test_a_hot_spare_takes_the_lost_rank_in_place_and_a_new_one_starts_after_the_step():
    cluster = Cluster(capacity=5, lose={6: 2})
    ctrl = run(cluster, 6, **{"parallel.ep": 4, "fault_tolerance.spares": 1})
    started = [c for c in cluster.calls if c[0] == "start_spares"]
    ctrl.train_step(6)
    (lost,) = ctrl.incidents
    assert lost["action"] == "replace" and lost["ep"] == [4, 4] and lost["spares_used"] == [2]
    assert len(cluster.groups) == 1  # rebuilt in place: no grid launched anew, no capacity probe
    assert ("regroup", [2], 4, [0, 1, 2, 3], [2]) in cluster.calls
    assert ctrl.placement()["home"] == recovery.grow(16, 4).tolist() and ctrl.status()["ep"] == 4
    # the spare was used; its replacement started once the resumed step was done
    assert [c for c in cluster.calls if c[0] == "start_spares"] == started + [("start_spares", 1)]
    assert ctrl.status()["spares"] == 1
    ctrl.train_step(7)
    assert cluster.groups[-1].trained == clean_run(8, **{"parallel.ep": 4}) == tuple(range(8))
    assert states(ctrl) == ["scheduling", "running", "recovering", "running"]  # no grow-back: never shrank
    assert "1 of them hot spares" in ctrl.machine.history[-1][2]


def test_spares_cover_whole_columns_and_the_rest_shrinks_in_place():
    cluster = Cluster(capacity=5, lose={6: {1, 2}})  # two ranks lost, one spare
    ctrl = run(cluster, 7, **{"parallel.ep": 4, "fault_tolerance.spares": 1, "fault_tolerance.grow_back": False})
    (lost,) = ctrl.incidents
    assert lost["action"] == "reshard" and lost["ep"] == [4, 3] and lost["spares_used"] == [1]
    assert ("regroup", [1, 2], 3, [0, 1, 3], [1]) in cluster.calls and len(cluster.groups) == 1
    assert lost["dp_ranks_per_ep_rank"] == [[0, 3], [1], [2]]
    assert cluster.groups[-1].trained == tuple(range(7))


def test_without_a_ready_spare_the_grid_shrinks_in_place_and_the_survivors_left_out_stand_by():
    """pp=2 x ep=2, rank 2 (stage 1 of column 0) lost, no spare: the grid shrinks in place to column 1 (no process
    started, no grid launched); rank 0, column 0's survivor, stands by and the grow-back takes it back without a
    placement beyond the one lost place."""
    cluster = Cluster(capacity=4, lose={6: 2})
    ctrl = run(cluster, 7, **{"parallel.pp": 2, "parallel.ep": 2, "fault_tolerance.grow_back_after_steps": 1})
    (lost,) = ctrl.incidents
    assert lost["action"] == "reshard" and lost["ep"] == [2, 1] and lost["spares_used"] == []
    assert ("regroup", [2], 1, [1], []) in cluster.calls and len(cluster.groups) == 1
    assert ctrl.status()["ep"] == 1 and ctrl.status()["spares"] == 1  # rank 0 on standby
    assert cluster.groups[-1].trained == tuple(range(7))
    ctrl.train_step(7)  # grow-back due: the standing-by survivor and one new worker (3 held + 1 <= capacity 4)
    assert [i["kind"] for i in ctrl.incidents] == ["worker_lost", "grow_back"] and ctrl.status()["ep"] == 2
    assert ctrl.status()["spares"] == 0 and cluster.groups[-1].trained == tuple(range(8))


def test_without_a_ready_spare_a_lost_node_launches_the_grid_anew():
    cluster = Cluster(capacity=4, lose={6: 2})  # no room for the spare: the job runs without one
    cluster.lost_node_ranks = {2}  # its node is gone: the grid is placed again off it
    ctrl = run(cluster, 7, **{"parallel.ep": 4, "fault_tolerance.spares": 1, "fault_tolerance.grow_back": False})
    (lost,) = ctrl.incidents
    assert lost["action"] == "reshard" and lost["ep"] == [4, 3] and lost["spares_used"] == []
    assert not any(c[0] == "regroup" for c in cluster.calls) and len(cluster.groups) == 2  # the new grid
    cluster = Cluster(capacity=5, lose={6: 2})
    cluster.spares_dead, cluster.lost_node_ranks = True, {2}  # the spare's node was lost before the worker's
    ctrl = run(cluster, 7, **{"parallel.ep": 4, "fault_tolerance.spares": 1, "fault_tolerance.grow_back": False})
    assert ctrl.incidents[0]["action"] == "reshard" and ctrl.incidents[0]["spares_used"] == []
    assert cluster.groups[-1].trained == tuple(range(7))


def test_a_spare_lost_while_it_takes_its_place_is_recovered_from_again():
    cluster = Cluster(capacity=5, lose={6: 2}, die_in={"restore": (1, {2})})  # the spare, now rank 2, dies
    ctrl = run(cluster, 8, **{"parallel.ep": 4, "fault_tolerance.spares": 1, "fault_tolerance.grow_back": False})
    first, second = ctrl.incidents
    assert first["action"] == "replace" and first["outcome"].startswith("interrupted: lost world ranks [2]")
    assert second["action"] == "reshard" and second["ep"] == [4, 3] and "seconds" in second
    assert states(ctrl) == ["scheduling", "running", "recovering", "recovering", "running"]
    assert cluster.groups[-1].trained == tuple(range(8))


def test_spare_decisions():
    assert recovery.spare_cover({5}, 4, 1) == {5}
    assert recovery.spare_cover({1, 5}, 4, 1) == set()  # a whole column (both stages) needs two
    assert recovery.spare_cover({1, 5, 2}, 4, 2) == {2}  # the cheaper column first, a spare left over
    assert recovery.spare_cover({1, 5, 2}, 4, 3) == {1, 2, 5}
    home, load = recovery.grow(8, 4), torch.ones(8)
    same = recovery.on_workers_lost(home, 4, {6}, load, spares=1)  # pp=2 x ep=4: rank 6 is stage 1, column 2
    assert same.action == "replace" and same.ep == 4 and same.keep == (0, 1, 2, 3) and same.spare_for == {6}
    assert torch.equal(same.home, home)
    part = recovery.on_workers_lost(home, 4, {1, 2}, load, spares=1)
    assert part.action == "reshard" and part.keep == (0, 1, 3) and part.spare_for == {1}
    assert part.home.tolist()[:2] == [0, 0] and part.home.tolist()[6:] == [2, 2]  # survivors renumbered densely
    assert recovery.on_workers_lost(home, 4, {1}, load, spares=0).spare_for == frozenset()
    # standbys take only their own places, and need no spare
    assert recovery.spare_cover({1, 5}, 4, 0, frozenset({1, 5})) == {1, 5}
    assert recovery.spare_cover({1, 5}, 4, 1, frozenset({5})) == {1, 5}
    assert recovery.spare_cover({1, 5, 2}, 4, 1, frozenset({1})) == {1, 5}  # each column needs one: the lowest
    alone = recovery.on_workers_lost(recovery.grow(8, 1), 1, {0}, load, standing_by=frozenset({0}))
    assert alone.action == "replace" and alone.in_place and alone.spare_for == {0}  # pp1 x ep1: no restart


# -- a worker lost in any controller state -----------------------------------------------------------------------
@pytest.mark.parametrize("method, nth", [
    ("set_policies", 2),          # a policy change pushed at a step boundary
    ("stage_snapshot", 1),        # taking the step-4 snapshot (the job's first: step 0 is its start point)
    ("snapshot_bytes", 1),        # its bytes arriving after the step
    ("hold_peer_snapshots", 1),   # the neighbours mapping their copies
])
def test_worker_lost_at_a_boundary_is_recovered_and_changes_nothing(method, nth):
    cluster = Cluster(capacity=4, die_in={method: (nth, {1})})
    ctrl = Controller(config(**{"parallel.ep": 2, "fault_tolerance.grow_back": False}), group_factory=cluster.group)
    ctrl.start()
    for s in range(8):
        if s == 3:
            ctrl.set_policy("moonep", {"enabled": False}, "test")  # pushed at the boundary of step 4
        ctrl.train_step(s)
    (lost,) = [i for i in ctrl.incidents if i["kind"] == "worker_lost"]
    assert lost["ranks"] == [1] and method in lost["why"] and lost["ep"] == [2, 1]
    assert ctrl.machine.state == JobState.RUNNING and ctrl.status()["ep"] == 1
    assert cluster.groups[-1].trained == clean_run(8, **{"parallel.ep": 2}) == tuple(range(8))


def test_worker_lost_during_evaluation_is_recovered_then_evaluates():
    cluster = Cluster(capacity=4, die_in={"evaluate": (1, {0})})
    ctrl = run(cluster, 6, **{"parallel.ep": 2})
    assert ctrl.evaluate() == 6.0  # the fake's "evaluation": how many batches the restored grid has trained on
    (lost,) = ctrl.incidents
    assert lost["kind"] == "worker_lost" and "evaluate" in lost["why"] and lost["replayed_steps"] == [4, 6]
    assert cluster.groups[-1].trained == tuple(range(6))


def test_worker_lost_on_a_checkpoint_step_abandons_the_commit_and_the_new_grid_writes_it(tmp_path):
    """The pending checkpoint's writers are gone: it is abandoned (never committed with missing parts) and the
    recovered grid writes the same step again."""
    cluster = Cluster(capacity=4, lose={5: 1})
    ctrl = run(cluster, 8, **{"parallel.ep": 2, "checkpoint.dir": str(tmp_path), "checkpoint.every_n_steps": 5,
                              "fault_tolerance.grow_back": False})
    assert [i["kind"] for i in ctrl.incidents] == ["checkpoint_abandoned", "worker_lost"]
    assert ctrl.incidents[0]["step"] == 5 and ctrl.incidents[0]["newest"] is None
    manifest = ckpt.verify(tmp_path, 5)
    assert list(manifest.parts) == [part_name(0)]  # written by the one survivor, not the lost grid
    assert torch.load(tmp_path / "step_000000005" / part_name(0))["trained"].tolist() == list(range(5))


def test_writer_lost_before_the_commit_keeps_the_previous_checkpoint_newest(tmp_path):
    # checkpoint_parts: 1st call commits step 2's, 2nd (at the boundary of 5) would commit step 4's
    cluster = Cluster(capacity=4, die_in={"checkpoint_parts": (2, {0})})
    ctrl = run(cluster, 7, **{"parallel.ep": 2, "checkpoint.dir": str(tmp_path), "checkpoint.every_n_steps": 2,
                              "fault_tolerance.grow_back": False})
    abandoned = [i for i in ctrl.incidents if i["kind"] == "checkpoint_abandoned"]
    assert [(i["step"], i["newest"]) for i in abandoned] == [(4, 2)]
    assert 4 not in ckpt.list_committed(tmp_path)
    assert ckpt.list_committed(tmp_path) == [2, 5]  # 5: written by the new grid at the boundary it recovered at
    assert cluster.groups[-1].trained == tuple(range(7))


def test_second_loss_during_recovery_restarts_it_on_the_smaller_grid():
    cluster = Cluster(capacity=4, lose={6: 3}, die_in={"restore": (1, {1})})  # the 3-worker grid loses rank 1
    ctrl = run(cluster, 8, **{"parallel.ep": 4, "fault_tolerance.grow_back": False})
    first, second = ctrl.incidents
    assert first["ep"] == [4, 3] and first["outcome"].startswith("interrupted: lost world ranks [1]")
    assert second["ep"] == [3, 2] and second["ranks"] == [1] and "seconds" in second
    assert states(ctrl) == ["scheduling", "running", "recovering", "recovering", "running"]
    assert ctrl.status()["ep"] == 2 and cluster.groups[-1].trained == tuple(range(8))


def test_worker_lost_while_growing_back_recovers_shrunk():
    cluster = Cluster(capacity=4, lose={6: 2})
    ctrl = run(cluster, 7, **{"parallel.ep": 4, "fault_tolerance.grow_back_after_steps": 2})
    cluster.capacity = 7
    cluster.die_in = {"restore": (cluster.seen["restore"] + 1, {3})}  # the grown-back grid's restore
    cluster.seen.setdefault("restore", 0)
    ctrl.train_step(7)
    ctrl.train_step(8)
    kinds = [i["kind"] for i in ctrl.incidents]
    assert kinds == ["worker_lost", "worker_lost"] and ctrl.incidents[1]["ep"] == [4, 3]
    assert states(ctrl)[-3:] == ["resizing", "recovering", "running"]
    assert cluster.groups[-1].trained == tuple(range(9))


def test_worker_lost_while_the_first_grid_starts_launches_again():
    """A worker that dies (or does not answer) while the job's first grid starts: the grid is launched again after
    the backoff, as a recovery would; past fault_tolerance.recovery_attempts the job stops in one line."""
    cluster = Cluster(capacity=4, die_in={"launch": (1, {1})})
    ctrl = run(cluster, 2, **{"parallel.ep": 4, "fault_tolerance.retry_backoff_s": 0.0})
    assert [i["kind"] for i in ctrl.incidents] == ["launch_failed"] and ctrl.incidents[0]["attempt"] == 1
    assert cluster.groups[-1].trained == (0, 1) and ctrl.machine.state == JobState.RUNNING
    assert not cluster.groups[0].alive  # the failed grid was closed
    cluster = Cluster(capacity=4)
    cluster.die_every = {"launch": {0}}
    ctrl = Controller(config(**{"parallel.ep": 4, "fault_tolerance.retry_backoff_s": 0.0,
                                "fault_tolerance.recovery_attempts": 2}), group_factory=cluster.group)
    with pytest.raises(RecoveryFailed, match=r"the workers did not start \(2 attempts; last: lost world ranks \[0\]"):
        ctrl.start()
    assert ctrl.machine.state == JobState.ERRORED and len(cluster.groups) == 2


def test_checkpoint_pending_when_growing_back_is_committed_first(tmp_path):
    """The shrunk grid writes the step-7 checkpoint; at the next boundary the grid grows back, and its workers leave
    the old grid (forgetting what they wrote): the checkpoint is committed before, not lost as a failed write."""
    cluster = Cluster(capacity=4, lose={6: 2})
    ctrl = run(cluster, 7, **{"parallel.ep": 4, "fault_tolerance.grow_back_after_steps": 2,
                              "checkpoint.dir": str(tmp_path), "checkpoint.every_n_steps": 7})
    cluster.capacity = 7
    ctrl.train_step(7)  # the boundary writes the step-7 checkpoint (shrunk)
    ctrl.train_step(8)  # grows back
    assert [i["kind"] for i in ctrl.incidents] == ["worker_lost", "grow_back"]
    assert ckpt.list_committed(tmp_path) == [7] and ctrl.status()["ep"] == 4


def test_final_checkpoint_survives_a_writer_lost_at_shutdown(tmp_path):
    cluster = Cluster(capacity=4, die_in={"checkpoint_parts": (1, {1})})
    ctrl = run(cluster, 5, **{"parallel.ep": 2, "checkpoint.dir": str(tmp_path), "checkpoint.at_end": True,
                              "fault_tolerance.grow_back": False})
    ctrl.shutdown()
    assert ckpt.list_committed(tmp_path) == [5] and ctrl.machine.state == JobState.FINISHED
    assert [i["kind"] for i in ctrl.incidents] == ["checkpoint_abandoned", "worker_lost"]


# -- durable checkpoints: failed writes, damaged checkpoints, resume ------------------------------------------------
def test_failed_checkpoint_writes_warn_train_on_and_stop_only_after_the_limit(tmp_path):
    blocked = tmp_path / "ckpt"
    blocked.write_text("a file where the checkpoint directory should be")  # every write fails (also as root)
    cluster = Cluster()
    ctrl = Controller(config(**{"checkpoint.dir": str(blocked), "checkpoint.every_n_steps": 2,
                                "checkpoint.max_failures_in_a_row": 3}), group_factory=cluster.group)
    ctrl.start()
    warned = [w for s in range(6) for w in ctrl.train_step(s).get("warnings", [])]
    assert len(warned) == 2 and all("could not be written" in w for w in warned)  # steps 2 and 4, shown to the driver
    assert "(2/3 failures in a row)" in warned[1]
    failed = [i for i in ctrl.incidents if i["kind"] == "checkpoint_write_failed"]
    assert [i["step"] for i in failed] == [2, 4] and failed[0]["newest"] is None
    with pytest.raises(ckpt.CheckpointError, match="3 checkpoint writes failed in a row"):
        ctrl.train_step(6)
    assert ctrl.machine.state == JobState.ERRORED
    ctrl.shutdown()  # stops the workers without a second error that would hide the first
    assert not cluster.groups[-1].alive


def test_a_write_that_works_again_resets_the_failure_count(tmp_path):
    blocked = tmp_path / "ckpt"
    blocked.write_text("")
    cluster = Cluster()
    ctrl = Controller(config(**{"checkpoint.dir": str(blocked), "checkpoint.every_n_steps": 2,
                                "checkpoint.max_failures_in_a_row": 2}), group_factory=cluster.group)
    ctrl.start()
    for s in range(3):
        ctrl.train_step(s)
    blocked.unlink()  # the disk has room again
    for s in range(3, 7):
        ctrl.train_step(s)
    assert ckpt.list_committed(blocked) == [4] and ctrl.checkpoints.failures_in_a_row == 0
    assert [i["step"] for i in ctrl.incidents if i["kind"] == "checkpoint_write_failed"] == [2]


def checkpointed(tmp_path, steps: int = 9, **overrides) -> None:
    """A job that committed checkpoints at steps 4 and 8 under tmp_path."""
    ctrl = run(Cluster(), steps, **{"checkpoint.dir": str(tmp_path), "checkpoint.every_n_steps": 4, **overrides})
    ctrl.shutdown()
    assert ckpt.list_committed(tmp_path) == [4, 8]


@pytest.mark.parametrize("damage", ["truncate_part", "delete_manifest"])
def test_resume_past_a_damaged_newest_checkpoint_warns_and_moves_it_aside(tmp_path, damage):
    checkpointed(tmp_path)
    step8 = tmp_path / "step_000000008"
    if damage == "truncate_part":
        (step8 / part_name(0)).write_bytes((step8 / part_name(0)).read_bytes()[:10])
    else:
        (step8 / "manifest.json").unlink()
    ctrl, status, cluster = resume(tmp_path)
    assert status["step"] == 4 and cluster.groups[-1].trained == (0, 1, 2, 3)
    (warning,) = status["warnings"]  # for the driver's console
    assert warning.startswith("checkpoint step 8 is damaged") and "resuming from step 4" in warning
    (incident,) = ctrl.incidents
    assert incident["kind"] == incident["rule"] == "checkpoint_damaged" and incident["step"] == 8
    assert not step8.exists() and incident["moved_to"].startswith(str(step8) + ".damaged-")
    for s in range(4, 9):  # the resumed run writes step 8 anew, beside the damaged one
        ctrl.train_step(s)
    ctrl.shutdown()
    assert ckpt.list_committed(tmp_path) == [4, 8] and len(list(tmp_path.glob("step_000000008.damaged-*"))) == 1


def test_resume_with_nothing_verifiable_fails_unless_fresh(tmp_path):
    checkpointed(tmp_path)
    for step in (4, 8):
        part = tmp_path / f"step_{step:09d}" / part_name(0)
        part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(ckpt.CheckpointError, match="no verified checkpoint under .*; add --fresh to start from step 0"):
        resume(tmp_path)
    assert ckpt.list_committed(tmp_path) == []  # both moved aside, nothing deleted
    assert len(list(tmp_path.glob("step_*.damaged-*"))) == 2
    ctrl, status, _ = resume(tmp_path, fresh=True)
    assert status["step"] == 0 and "starting from step 0 (--fresh)" in status["warnings"][-1]


def test_resume_with_declared_safe_changes_is_noted(tmp_path):
    checkpointed(tmp_path)
    ctrl, status, _ = resume(tmp_path, **{"optimizer.lr": 1e-4, "train.steps": 50})
    assert status["step"] == 8
    (noted,) = [i for i in ctrl.incidents if i["kind"] == "resumed_with_changes"]
    assert any(c.startswith("optimizer.lr:") for c in noted["changed"])
    assert any(c.startswith("train.steps:") for c in noted["changed"])


# -- a node lost: what is left decides the grid --------------------------------------------------------------------
def test_node_loss_shrinks_to_what_the_alive_nodes_hold_then_grows_back():
    """ep=4 over two nodes of 2 workers each; the second node dies: both its ranks are lost together and the grid
    shrinks to the 2 workers the first node holds; when a node joins again, the job grows back."""
    cluster = Cluster(capacity=4)
    ctrl = Controller(config(**{"parallel.ep": 4, "fault_tolerance.grow_back_after_steps": 2}),
                      group_factory=cluster.group)
    ctrl.start()
    for s in range(6):
        ctrl.train_step(s)
    cluster.capacity, cluster.lose = 2, {6: 2}  # the node holding ranks 2 and 3 is gone (rank 2 reported first)
    cluster.lost_node_ranks = {2, 3}
    ctrl.train_step(6)
    assert ctrl.status()["ep"] == 2 and ctrl.incidents[-1]["ep"] == [4, 2]
    cluster.capacity = 6  # a node of 2 CPUs... and 2 more: room for the full grid beside the running one
    for s in range(7, 10):
        ctrl.train_step(s)
    assert ctrl.status()["ep"] == 4 and [i["kind"] for i in ctrl.incidents] == ["worker_lost", "grow_back"]
    assert cluster.groups[-1].trained == tuple(range(10))


def test_a_lost_node_not_yet_reported_dead_fails_the_placement_and_the_plan_retries_smaller():
    cluster = Cluster(capacity=4)
    ctrl = run(cluster, 6, **{"parallel.ep": 4, "fault_tolerance.grow_back": False})
    cluster.capacity, cluster.phantom = 2, 2  # Ray still counts the lost node's two workers
    cluster.lose, cluster.lost_node_ranks = {6: 3}, {2, 3}
    ctrl.train_step(6)
    tried, done = ctrl.incidents
    assert tried["ep"] == [4, 3] and tried["outcome"].startswith("did not fit")
    assert done["ep"] == [4, 2] and "seconds" in done and ctrl.status()["ep"] == 2
    assert cluster.groups[-1].trained == tuple(range(7))


def test_resources_others_hold_fail_the_placement_and_the_plan_retries_on_what_is_free():
    cluster = Cluster(capacity=6)
    ctrl = run(cluster, 6, **{"parallel.ep": 4, "fault_tolerance.grow_back": False})
    cluster.others = 4  # another job takes 4 of the 6 while this one recovers: 2 stay free
    cluster.lose, cluster.lost_node_ranks = {6: 3}, {3}  # a node lost: the grid is placed again
    ctrl.train_step(6)
    tried, done = ctrl.incidents
    assert tried["ep"] == [4, 3] and tried["outcome"].startswith("did not fit")  # planned on the totals first
    assert done["ep"] == [4, 2] and ctrl.status()["ep"] == 2
    assert cluster.groups[-1].trained == tuple(range(7))


def test_plan_keeps_only_the_survivors_that_fit():
    home = recovery.grow(8, 4)
    d = recovery.on_workers_lost(home, 4, {3}, torch.ones(8), max_ep=2)
    assert d.action == "reshard" and d.ep == 2 and sorted(set(d.home.tolist())) == [0, 1]
    assert d.home.tolist()[:4] == [0, 0, 1, 1]  # survivors 0 and 1 keep their experts
