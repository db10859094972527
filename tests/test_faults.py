"""Fault tolerance on the tiny config: blow-up rollback is exact, a killed worker is resharded away and the job
continues, capacity returning grows the job back, a hung collective is detected. Every wait is bounded."""
from __future__ import annotations

import tempfile
import time

import pytest

import ray

from k3ray.config import load_config
from conftest import SMALL_BATCH, job_params, run_job
from k3ray.control.driver import running_job


def tiny(**overrides):
    base = {"parallel.pp": 1, "parallel.ep": 1, "train.eval_every": 0, "train.steps": 20, "model.dtype": "float64", "parallel.collective_timeout_s": 10,
            "fault_tolerance.snapshot_every": 4, "policies.guards.warmup_steps": 100,
            "checkpoint.dir": tempfile.mkdtemp(prefix="k3ray-faults-"), **SMALL_BATCH}  # a folder belongs to one job
    return load_config("configs/tiny.yaml", {**base, **overrides})


def run(cfg, steps: int):
    """reports, incidents, status and the parameters at the end."""
    job = run_job(cfg, steps, params_after=(steps,))
    return job.reports, job.incidents, job.status, job.params[steps]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_blowups_before_and_after_the_first_snapshot_roll_back_and_equal_the_run_that_skipped_them(ray_cluster):
    """Batch 2 turns NaN before the first snapshot: there is none at step 0, so the job's start point (its weights
    from the seed) is what the rollback goes back to; the grid is rebuilt in place from the seed and steps 0-1
    replayed. Step 6 (batch 7, batch 2 being skipped) turns NaN after step 4's snapshot, which the rollback restores.
    Each blow-up is an incident naming its batch, the batch is skipped, and the run equals one that never saw either
    batch: the same losses every step, the same parameters after 6 steps (the seed's rollback alone) and after 10."""
    steps, second = 10, 6
    batch_of_step = {2: 2, second: 7}  # the NaN steps and the batches they train
    faults = [{"kind": "nan", "step": k, "layer": 1} for k in batch_of_step]
    with running_job(tiny(**{"parallel.ep": 2, "fault_tolerance.faults": faults})) as controller:
        reports = [ray.get(controller.train_step.remote(s), timeout=600) for s in range(second)]
        snapshots_by_step_6 = ray.get(controller.status.remote())["snapshots"]
        params_after_6 = job_params(controller)
        reports += [ray.get(controller.train_step.remote(s), timeout=600) for s in range(second, steps)]
        incidents = ray.get(controller.get_incidents.remote())
        status = ray.get(controller.status.remote())
        params = job_params(controller)
    assert snapshots_by_step_6["committed"] == 1  # step 4's: none at step 0
    warmed_gib, _ = snapshots_by_step_6["store_warmed"]  # after step 0, each worker its snapshot's size
    assert warmed_gib > 0
    assert len(incidents) == 2
    for incident, (k, batch) in zip(incidents, batch_of_step.items()):
        assert incident["kind"] == "blowup" and incident["step"] == k and incident["batch_ids"] == [batch]
        assert incident["rule"] in ("nonfinite_loss", "nonfinite_grad", "activation")
    assert status["skipped_batches"] == list(batch_of_step.values())
    assert [r["batch_index"] for r in reports] == [0, 1, 3, 4, 5, 6, 8, 9, 10, 11]
    clean = run_job(tiny(**{"parallel.ep": 2, "data.skip_batches": list(batch_of_step.values())}), steps,
                    params_after=(second, steps))
    assert clean.incidents == []
    assert [r["loss"] for r in reports] == clean.losses
    assert max_diff(params_after_6, clean.params[second]) == 0.0
    assert max_diff(params, clean.params[steps]) <= 1e-6


def test_repeated_trips_escalate_then_stop(ray_cluster):
    # the drill poisons every attempt of step 5 (same step listed 4 times): skip more, lower lr, then stop
    faults = [{"kind": "nan", "step": 5, "layer": 0}] * 4
    cfg = tiny(**{"fault_tolerance.faults": faults, "fault_tolerance.max_retries_per_step": 2})
    with running_job(cfg) as controller:
        for s in range(5):
            ray.get(controller.train_step.remote(s), timeout=300)
        try:
            ray.get(controller.train_step.remote(5), timeout=300)
            raise AssertionError("a step that always blows up must stop the job")
        except ray.exceptions.RayTaskError as err:
            assert "guard tripped 3 times" in str(err)
        incidents = ray.get(controller.get_incidents.remote())
        assert [i["attempt"] for i in incidents] == [1, 2, 3]
        assert incidents[1]["batch_ids"] == [6, 7]  # skip_growth=2: the second trip skips two batches
        status = ray.get(controller.status.remote())
        assert status["state"] == "errored" and status["lr_scale"] == 0.5


def test_killed_worker_is_resharded_and_the_run_equals_an_unfailed_one(ray_cluster, unfailed_ep4):
    """ep=4, worker 2 killed at step 6: the 3 survivors re-home its experts, replay steps 4-5 from the snapshot and
    run the lost DP rank's micro-batches beside their own, so every step trains on the same global batch as the
    unfailed run. In float64 the losses then agree to 1e-12 relative: the only differences are summation orders
    (a survivor's two micro-batches are one concatenated micro-batch; the dense-gradient all-reduce sums 3 partial
    sums, not 4), each a few ulps (~1e-16) per step."""
    steps, k = 10, 6
    cfg = tiny(**{"parallel.ep": 4, "fault_tolerance.grow_back": False,
                  "fault_tolerance.faults": [{"kind": "kill_worker", "step": k, "worker": 2}]})
    reports, incidents, status, params = run(cfg, steps)
    (incident,) = incidents
    assert incident["kind"] == "worker_lost" and incident["ep"] == [4, 3] and incident["replayed_steps"] == [4, 6]
    assert incident["dp_ranks_per_ep_rank"] == [[0, 3], [1], [2]]
    assert status["ep"] == 3 and status["workers"] == 3 and len(reports) == steps
    # every expert placed exactly once across the 3 survivors
    assert len([n for n in params if n.startswith("0.expert") and n.endswith("w1")]) == 16
    assert all(r["tokens"] == reports[0]["tokens"] for r in reports)  # the global batch never shrank
    assert unfailed_ep4.incidents == []
    assert [r["loss"] for r in reports] == pytest.approx(unfailed_ep4.losses[:steps], rel=1e-12, abs=0)
    assert max_diff(params, unfailed_ep4.params[steps]) <= 1e-12


def test_grows_back_when_capacity_returns(ray_cluster):
    cfg = tiny(**{"parallel.ep": 4, "fault_tolerance.grow_back_after_steps": 2,
                  "fault_tolerance.faults": [{"kind": "kill_worker", "step": 3, "worker": 1}]})
    reports, incidents, status, _ = run(cfg, 8)
    kinds = [i["kind"] for i in incidents]
    assert kinds == ["worker_lost", "grow_back"]
    assert incidents[1]["ep"] == [3, 4] and status["ep"] == 4
    assert all(len(r["rank_load"][0]) == 4 for r in reports[-2:])


def test_hung_collective_is_detected_and_recovered(ray_cluster):
    cfg = tiny(**{"parallel.ep": 2, "fault_tolerance.grow_back": False,
                  "fault_tolerance.faults": [{"kind": "hang_collective", "step": 2, "worker": 1}]})
    reports, incidents, status, _ = run(cfg, 4)
    assert incidents[0]["kind"] == "worker_lost" and "no answer" in incidents[0]["why"]
    assert status["ep"] == 1 and len(reports) == 4


def test_lost_pipeline_stage_is_restarted_and_training_is_unchanged(ray_cluster):
    """pp=2, ep=1: the worker holding stage 1 dies; nothing can absorb a whole stage, so the same grid restarts
    on other resources from the neighbour's snapshot copy and replays; the run equals one that never failed."""
    steps = 8
    cfg = tiny(**{"parallel.pp": 2, "fault_tolerance.faults": [{"kind": "kill_worker", "step": 5, "worker": 1}]})
    reports, incidents, status, params = run(cfg, steps)
    assert [i["kind"] for i in incidents] == ["worker_lost"] and incidents[0]["action"] == "restart"
    assert status["pp"] == 2 and status["ep"] == 1
    clean_reports, _, _, clean_params = run(tiny(**{"parallel.pp": 2}), steps)
    assert [r["loss"] for r in reports] == [r["loss"] for r in clean_reports]
    assert max_diff(params, clean_params) == 0.0


def test_worker_killed_on_a_checkpoint_step_abandons_that_commit_and_training_goes_on(ray_cluster, tmp_path):
    """The checkpoint of step 10 is being written when its writer dies: it is abandoned (never committed with a
    part missing) and the recovered grid writes step 10 again."""
    from k3ray.io import checkpoint as ckpt

    cfg = tiny(**{"parallel.ep": 2, "fault_tolerance.grow_back": False, "fault_tolerance.snapshot_every": 5,
                  "checkpoint.dir": str(tmp_path), "checkpoint.every_n_steps": 10, "checkpoint.at_end": False,
                  "fault_tolerance.faults": [{"kind": "kill_worker", "step": 10, "worker": 1}]})
    reports, incidents, status, _ = run(cfg, 12)
    assert [i["kind"] for i in incidents] == ["checkpoint_abandoned", "worker_lost"]
    assert incidents[0]["step"] == 10 and incidents[1]["ranks"] == [1] and incidents[1]["replayed_steps"] == [10, 10]
    assert status["ep"] == 1 and len(reports) == 12
    assert ckpt.list_committed(tmp_path) == [10] and list(ckpt.verify(tmp_path, 10).parts) == ["rank00000.pt"]


def test_worker_killed_between_steps_is_recovered_at_the_snapshot_and_at_evaluation(ray_cluster):
    faults = [{"kind": "kill_worker", "step": 8, "worker": 1, "at": "boundary"},  # the step-8 snapshot meets it
              {"kind": "kill_worker", "step": 9, "worker": 0, "at": "after_step"}]  # the evaluation meets it
    cfg = tiny(**{"parallel.ep": 4, "fault_tolerance.grow_back": False, "fault_tolerance.faults": faults})
    with running_job(cfg) as controller:
        for s in range(10):
            ray.get(controller.train_step.remote(s), timeout=300)
        value = ray.get(controller.evaluate.remote(), timeout=300)
        incidents = ray.get(controller.get_incidents.remote())
        status = ray.get(controller.status.remote())
    assert [(i["kind"], i["ranks"], i["ep"]) for i in incidents] == [("worker_lost", [1], [4, 3]),
                                                                     ("worker_lost", [0], [3, 2])]
    assert "stage_snapshot" in incidents[0]["why"] and "evaluate" in incidents[1]["why"]
    assert status["state"] == "running" and status["ep"] == 2 and value > 0


def test_two_workers_killed_at_once_are_both_named(ray_cluster):
    cfg = tiny(**{"parallel.ep": 4, "fault_tolerance.grow_back": False,
                  "fault_tolerance.faults": [{"kind": "kill_worker", "step": 5, "workers": [1, 2]}]})
    reports, incidents, status, _ = run(cfg, 6)
    (lost,) = incidents
    assert lost["ranks"] == [1, 2] and lost["ep"] == [4, 2] and status["ep"] == 2 and len(reports) == 6


def test_killed_worker_is_replaced_by_a_hot_spare_and_the_run_equals_an_unfailed_one(ray_cluster, unfailed_ep4):
    """ep=4 with one hot spare, worker 2 killed at step 2: the spare takes its place (no process started), the grid
    keeps ep=4 and its homes, steps 0-1 are replayed from the job's start point (the seed), and the float64 losses
    equal an unfailed run's; a new spare is started afterwards."""
    steps, k = 4, 2
    cfg = tiny(**{"parallel.ep": 4, "fault_tolerance.spares": 1,
                  "fault_tolerance.faults": [{"kind": "kill_worker", "step": k, "worker": 2}]})
    reports, incidents, status, params = run(cfg, steps)
    (incident,) = incidents
    assert incident["kind"] == "worker_lost" and incident["action"] == "replace" and incident["ep"] == [4, 4]
    assert incident["spares_used"] == [2] and incident["replayed_steps"] == [0, 2]
    assert "swap_in_spares" in incident["seconds"]
    assert "place_and_start_workers" not in incident["seconds"]  # no process was started to recover
    assert status["ep"] == 4 and status["workers"] == 4 and status["spares"] == 1 and len(reports) == steps
    assert [r["loss"] for r in reports] == pytest.approx(unfailed_ep4.losses[:steps], rel=1e-12, abs=0)
    assert max_diff(params, unfailed_ep4.params[steps]) <= 1e-12


def test_killed_workers_are_replaced_by_their_standbys_and_the_run_equals_an_unfailed_one(ray_cluster, unfailed_ep4):
    """ep=4 with standbys (a process beside each worker, holding no resources) and no spare. Worker 2 killed at step
    2: its standby takes its place (no process started, no resources placed), the grid keeps ep=4 and its homes.
    Then two faults close together: worker 1 killed at step 4 and its standby, now rank 1, killed as soon as the
    rebuilt grid has joined; the second loss finds no standby for rank 1 (a new one starts only after a step on the
    new grid): the grid shrinks in place to ep=3 and grows back at the next step. The float64 losses equal the
    unfailed run's throughout."""
    steps = 6
    cfg = tiny(**{"parallel.ep": 4, "fault_tolerance.standbys": True,
                  "fault_tolerance.faults": [{"kind": "kill_worker", "step": 2, "worker": 2},
                                             {"kind": "kill_worker", "step": 4, "worker": 1},
                                             {"kind": "kill_worker", "step": 4, "worker": 1, "at": "relaunch"}]})

    def standbys_up(controller) -> None:
        deadline = time.monotonic() + 120  # they import torch and the model code beside the steps
        while ray.get(controller.status.remote())["standbys_up"] < 4 and time.monotonic() < deadline:
            time.sleep(0.2)

    with running_job(cfg) as controller:
        reports = []
        for s in range(steps):
            if s in (2, 4):
                standbys_up(controller)
            reports.append(ray.get(controller.train_step.remote(s), timeout=600))
        incidents = ray.get(controller.get_incidents.remote())
        status = ray.get(controller.status.remote())
    clean, first, second, grown = incidents
    assert clean["kind"] == "worker_lost" and clean["action"] == "replace" and clean["ep"] == [4, 4]
    assert clean["standbys_used"] == [2] and clean["spares_used"] == [2]
    assert "swap_in_spares" in clean["seconds"] and "place_and_start_workers" not in clean["seconds"]
    assert first["action"] == "replace" and first["standbys_used"] == [1]
    assert first["outcome"].startswith("interrupted: lost world ranks [1]")
    assert second["action"] == "reshard" and second["ep"] == [4, 3] and second["standbys_used"] == []
    assert grown["kind"] == "grow_back" and grown["ep"] == [3, 4]
    assert status["ep"] == 4 and status["workers"] == 4 and status["spares"] == 0 and status["standbys"] == 4
    assert [r["loss"] for r in reports] == pytest.approx(unfailed_ep4.losses[:steps], rel=1e-12, abs=0)


def test_killed_worker_without_a_spare_shrinks_in_place_keeping_the_survivors_processes(ray_cluster, unfailed_ep4):
    """ep=4, no spare, worker 2 killed at step 2: the grid shrinks to ep=3 in place (no worker process started,
    none launched anew): the 3 survivors are the same actors in the same processes, now EP ranks 0-2, and the
    float64 run still equals the unfailed one. The incident holds every phase, the first resumed step among them."""
    import os

    steps, k = 4, 2
    cfg = tiny(**{"parallel.ep": 4, "fault_tolerance.grow_back": False,
                  "fault_tolerance.faults": [{"kind": "kill_worker", "step": k, "worker": 2}]})

    def workers(controller) -> list[tuple[str, int]]:
        """(actor id, process id) of each world rank of the job's grid."""
        def ids(ctrl):
            group = ctrl.grid.group
            return list(zip([w._actor_id.hex() for w in group.workers],
                            group.run_on(list(range(group.size)), lambda worker: os.getpid())))
        return ray.get(controller.__ray_call__.remote(ids), timeout=120)

    with running_job(cfg) as controller:
        reports = [ray.get(controller.train_step.remote(s), timeout=600) for s in range(k)]
        before = workers(controller)
        reports += [ray.get(controller.train_step.remote(s), timeout=600) for s in range(k, steps)]
        after = workers(controller)
        (incident,) = ray.get(controller.get_incidents.remote())
        params = job_params(controller)
    assert incident["action"] == "reshard" and incident["ep"] == [4, 3] and incident["replayed_steps"] == [0, k]
    assert after == [before[0], before[1], before[3]]  # the survivors' own processes, renumbered
    assert {"regroup_survivors", "process_groups", "restore", "replay", "resumed_step"} <= incident["seconds"].keys()
    assert "place_and_start_workers" not in incident["seconds"]  # no process was started to recover
    assert [r["loss"] for r in reports] == pytest.approx(unfailed_ep4.losses[:steps], rel=1e-12, abs=0)
    assert max_diff(params, unfailed_ep4.params[steps]) <= 1e-12


def test_a_store_too_small_for_one_snapshot_and_kills_in_its_phases_leave_the_run_exact(ray_cluster, extra_nodes):
    """The workers' node has an object store of 80 MB (Ray's least is 75) and the model's snapshot is ~160 MB: the
    job says so once, holds snapshots one at a time, and they spill to disk. A worker is killed entering a
    snapshot's staging, after streaming its first value, and after streaming all of it (before the commit): each
    time the job goes back to the newest state it holds (the committed snapshot, or the start point while one
    arrives) and shrinks (4 -> 3 -> 2 -> 1 EP ranks, the global batch kept), and ends with the losses of the same job
    run unfailed on the session's store."""
    from k3ray.control.local_nodes import head_room

    # ~6.7M parameters in float64 (short sequences: the snapshot's size is the parameters', not the batch's)
    wide = {"model.d_model": 128, "model.d_latent": 64, "model.expert_inner": 512, "data.seq_len": 32}
    steps, faults = 12, [{"kind": "kill_worker", "step": 2, "worker": 3, "at": "snapshot_stage"},
                        {"kind": "kill_worker", "step": 4, "worker": 2, "at": "snapshot_stream"},
                        {"kind": "kill_worker", "step": 6, "worker": 1, "at": "snapshot_commit"}]
    base = {"parallel.ep": 4, "fault_tolerance.snapshot_every": 2, "fault_tolerance.grow_back": False,
            "checkpoint.at_end": False, **wide}
    unfailed = run_job(tiny(**base), steps)
    extra_nodes(4, "--object-store-memory", str(80 << 20))
    with head_room(0):  # every worker on the small store's node
        failed = run_job(tiny(**base, **{"fault_tolerance.faults": faults}), steps)
    lost = [i for i in failed.incidents if i["kind"] == "worker_lost"]
    # the worker that dies after streaming all of step 6's snapshot is met by step 6, or later when the bytes
    # (spilled to disk) outlast steps: the run leaves five steps for them on a loaded machine
    met = [i["step"] for i in lost]
    assert met[:2] == [2, 4] and len(met) == 3 and 6 <= met[2] < steps, failed.incidents
    assert failed.status["snapshots"]["one_at_a_time"] and failed.status["snapshots"]["committed"] >= 1
    # float64 to 1e-11: the run steps at 4, 3, 2 and 1 EP ranks, each size summing the experts' outputs and
    # gradients in its own order, and when the third kill is met (timing) decides which steps ran at which size;
    # over 12 steps those roundings reach ~1e-12 of the loss (a wrong restore or replay is off by far more)
    assert failed.losses == pytest.approx(unfailed.losses, rel=1e-11, abs=0), failed.incidents


def test_steps_run_ahead_through_a_blowup_and_a_kill_equal_steps_that_do_not(ray_cluster):
    """Each step's successor queued on the worker behind it (execution.step_ahead, on here on a CPU), while a
    blow-up rolls back and skips its batch (the batch announced is not the one the next step runs), a worker is
    killed during a step and snapshots are taken: the same batches, losses and parameters as stepping without."""
    faults = [{"kind": "nan", "step": 3, "layer": 1}, {"kind": "kill_worker", "step": 6, "worker": 0}]

    def job(ahead: bool):
        cfg = tiny(**{"execution.step_ahead": ahead, "fault_tolerance.faults": faults,
                      "fault_tolerance.snapshot_every": 4})
        with running_job(cfg) as controller:
            reports = [ray.get(controller.train_step.remote(s, ahead=ahead), timeout=600) for s in range(9)]
            incidents = ray.get(controller.get_incidents.remote())
            return reports, [i["kind"] for i in incidents], job_params(controller)

    want, want_incidents, want_params = job(False)
    got, incidents, params = job(True)
    assert incidents == want_incidents == ["blowup", "worker_lost"]
    assert [r["batch_index"] for r in got] == [r["batch_index"] for r in want] == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert max_diff(params, want_params) == 0.0
    # run ahead: every step after one that ran its own batch on a worker that lived on, but the blow-up's retry
    # (its batch skipped: another than announced), the step of the kill (on a new worker) and the steps after a
    # snapshot's boundary (4 and 8: the step before it is not run ahead)
    assert [r["timings"]["run_ahead"] > 0 for r in got] == [False, True, True, False, False, True, False, True, False]
    assert not any(r["timings"]["run_ahead"] for r in want)
