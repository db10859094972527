"""Recovery and grow-back as bounded handlers, against the fake worker group (fakes/training.py, no Ray): a loss
during every attempt ends in one readable stop after the attempt limit (never a recursion); a grow-back whose
placement fails leaves the shrunk grid training; a second failure inside a rollback never leaves half of it; the
control API's calls wait for the step that holds the grid; checkpoint folders belong to one job."""
from __future__ import annotations

import json
import threading

import pytest

from fakes.training import Cluster, config, run, states
from k3ray.config import load_config
from k3ray.train import failures
from k3ray.train.controller import Controller, GuardError
from k3ray.train.failures import RecoveryFailed
from k3ray.train.state import AttemptsExhausted, JobState, StateMachine
from k3ray.io.checkpoint import CheckpointError


def test_the_machine_bounds_a_handlers_attempts_and_backs_off():
    machine = StateMachine({JobState.RECOVERING: 3}, backoff_s=0.5)
    machine.to(JobState.SCHEDULING)
    machine.to(JobState.RUNNING)
    waits = []
    for _ in range(3):
        machine.to(JobState.RECOVERING, "lost rank 1")
        waits.append(machine.backoff_s())
    assert waits == [0.5, 1.0, 2.0]
    with pytest.raises(AttemptsExhausted, match="recovering: 3 attempts failed"):
        machine.to(JobState.RECOVERING)
    machine.to(JobState.RUNNING)
    machine.to(JobState.RECOVERING)  # a new episode counts from 1 again
    assert machine.attempt == 1


def test_a_loss_in_every_recovery_attempt_stops_after_the_limit_with_one_line(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr(failures.time, "sleep", slept.append)
    incidents = tmp_path / "incidents.jsonl"
    cluster = Cluster(capacity=4, lose={6: 1})
    cluster.die_every = {"restore": {0}}  # every grid the recovery launches loses rank 0 while restoring
    ctrl = run(cluster, 6, **{"parallel.ep": 2, "fault_tolerance.recovery_attempts": 3,
                              "fault_tolerance.retry_backoff_s": 0.25,
                              "fault_tolerance.incidents_file": str(incidents)})
    with pytest.raises(RecoveryFailed) as stop:
        ctrl.train_step(6)
    message = str(stop.value)
    assert "\n" not in message and "{" not in message  # one line, no incident dicts
    assert message.startswith("step 6: recovery failed: recovering: 3 attempts failed") and str(incidents) in message
    assert ctrl.machine.state == JobState.ERRORED
    assert states(ctrl).count("recovering") == 3 and slept == [0.25, 0.5, 1.0]
    logged = [json.loads(line) for line in incidents.read_text().splitlines()]
    assert logged[-1]["kind"] == "stopped" and logged[-1]["rule"] == "recovery_failed"
    assert [(i["attempt"], i["outcome"].split(":")[0]) for i in logged if i["kind"] == "worker_lost"] == [
        (1, "interrupted"), (2, "interrupted"), (3, "interrupted")]


def test_a_guard_stop_is_one_line_naming_the_incidents_file(tmp_path):
    incidents = tmp_path / "incidents.jsonl"
    cluster = Cluster(nan_batches=range(5, 100))
    ctrl = run(cluster, 5, **{"fault_tolerance.max_retries_per_step": 1,
                              "fault_tolerance.incidents_file": str(incidents)})
    with pytest.raises(GuardError) as stop:
        ctrl.train_step(5)
    assert "{" not in str(stop.value) and f"Incidents: {incidents}" in str(stop.value)
    assert [json.loads(line)["kind"] for line in incidents.read_text().splitlines()] == ["blowup", "blowup"]


def test_a_grow_back_whose_placement_fails_keeps_the_shrunk_grid_training():
    cluster = Cluster(capacity=4, lose={6: 2})
    ctrl = run(cluster, 7, **{"parallel.ep": 4, "fault_tolerance.grow_back_after_steps": 1,
                              "fault_tolerance.grow_back_attempts": 2})
    grid = cluster.groups[-1]
    cluster.capacity, cluster.place_fails = 8, 1  # room again, but the placement times out (a race, a busy node)
    for s in range(7, 11):
        ctrl.train_step(s)  # never raises: the grid in use was kept
    assert grid.alive and grid.trained == tuple(range(11)) and cluster.groups[-1] is grid  # nothing relaunched
    kinds = [i["kind"] for i in ctrl.incidents]
    assert kinds == ["worker_lost", "grow_back_failed", "grow_back"] and ctrl.status()["ep"] == 4
    assert states(ctrl)[-4:] == ["resizing", "running", "resizing", "running"]


def test_grow_back_gives_up_after_its_attempts_and_the_job_trains_on_shrunk():
    cluster = Cluster(capacity=4, lose={6: 2})
    ctrl = run(cluster, 7, **{"parallel.ep": 4, "fault_tolerance.grow_back_after_steps": 1,
                              "fault_tolerance.grow_back_attempts": 2})
    cluster.capacity, cluster.place_fails = 8, 100
    for s in range(7, 14):
        ctrl.train_step(s)
    assert [i["kind"] for i in ctrl.incidents].count("grow_back_failed") == 2 and ctrl.status()["ep"] == 3
    assert ctrl.machine.state == JobState.RUNNING


def test_a_loss_between_a_rollbacks_skip_and_its_lr_scale_leaves_no_half_rollback():
    # step 5 trips on batch 5 (skip it), then on batch 6 (skip 6, 7 and halve the lr); a worker dies while the
    # second rollback restores: the recovery must carry both halves of that decision
    cluster = Cluster(nan_batches={5, 6}, die_in={"restore": (2, {0})})
    ctrl = run(cluster, 6)
    assert sorted(ctrl.progress.skip) == [5, 6, 7] and ctrl.progress.lr_scale == 0.5
    assert [c[1] for c in cluster.calls if c[0] == "set_lr_scale"][-1] == 0.5  # the workers train with it too
    assert cluster.groups[-1].trained[-1] == 8 and ctrl.machine.state == JobState.RUNNING


def test_a_move_requested_mid_step_waits_for_the_step():
    cluster = Cluster()
    ctrl = run(cluster, 1, **{"parallel.ep": 2})
    cluster.step_gate = threading.Event()
    stepping = threading.Thread(target=ctrl.train_step, args=(1,))
    stepping.start()
    while ("run_step", 1) not in cluster.calls:
        pass
    moving = threading.Thread(target=ctrl.move_experts, args=([0], 1))
    moving.start()
    moving.join(0.3)
    assert moving.is_alive()  # the API's call waits for the grid
    cluster.step_gate.set()
    stepping.join(10)
    moving.join(10)
    names = [c[0] for c in cluster.calls]
    assert names.index("export_shard") > names.index("run_step") and ctrl.placement()["home"][0] == 1


def test_a_checkpoint_folder_of_another_job_is_refused_in_one_line(tmp_path):
    folder = str(tmp_path / "shared")
    run(Cluster(), 6, **{"name": "jobA", "checkpoint.dir": folder, "checkpoint.every_n_steps": 4})
    other = Controller(config(**{"name": "jobB", "checkpoint.dir": folder, "optimizer.lr": 5e-3}),
                       group_factory=Cluster().group)
    with pytest.raises(CheckpointError, match=r"holds checkpoints of job 'jobA': refusing") as refused:
        other.start()
    assert "\n" not in str(refused.value) and other.machine.state == JobState.ERRORED
    changed_model = Controller(config(**{"name": "jobA", "checkpoint.dir": folder, "model.n_layers": 2}),
                               group_factory=Cluster().group)
    with pytest.raises(CheckpointError, match="job 'jobA' with another model config"):
        changed_model.start(resume=True)
    # asked for: job B starts from job A's checkpoint and writes its own elsewhere
    cluster = Cluster()
    b = Controller(config(**{"name": "jobB", "checkpoint.dir": str(tmp_path / "b")}), group_factory=cluster.group)
    b.start(resume_from=folder)
    assert b.progress.step == 4 and cluster.groups[-1].trained == (0, 1, 2, 3)


def test_each_job_has_its_own_checkpoint_folder_by_default():
    a = load_config("configs/tiny.yaml", {"name": "jobA"})
    b = load_config("configs/tiny.yaml", {"name": "jobB"})
    assert a.checkpoint.dir == "runs/jobA/checkpoints" and b.checkpoint.dir == "runs/jobB/checkpoints"
    assert load_config("configs/tiny.yaml", {"checkpoint.dir": "x"}).checkpoint.dir == "x"
