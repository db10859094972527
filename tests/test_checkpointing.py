"""Durable checkpoints in a running job: resume after the whole job (driver included) is killed reproduces the
uninterrupted run, a truncated newest checkpoint falls back to the previous one, experts reshard onto another EP
size on resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from conftest import REPO, SMALL_BATCH
from k3ray.config import load_config
from k3ray.control.driver import running_job

BASE = {"parallel.pp": 1, "parallel.ep": 1, "train.eval_every": 0, "model.dtype": "float64",
        "checkpoint.every_n_steps": 4, **SMALL_BATCH}


def tiny(tmp_path, **overrides):
    return load_config("configs/tiny.yaml", {**BASE, "checkpoint.dir": str(tmp_path / "ckpt"), **overrides})


def train_cli(ray_cluster, tmp_path, steps: int, *extra: str) -> subprocess.Popen:
    sets = [f"{k}={v}" for k, v in {**BASE, "checkpoint.dir": tmp_path / "ckpt", "parallel.ep": 2}.items()]
    cmd = [sys.executable, "-m", "k3ray.control.cli", "train", "--config", "configs/tiny.yaml", "--steps", str(steps),
           "--address", ray_cluster.address, "--no-progress", "--json", *extra]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


STEPS = 12


@pytest.fixture(scope="module")
def truncated_run(ray_cluster, tmp_path_factory) -> tuple[list[float], object]:
    """STEPS steps on ep=2 whose step-8 checkpoint is truncated after its write (at_end off, so it stays the newest):
    (the losses, the folder of the job's checkpoints). A damaged file changes nothing of the training, so these are
    also the losses of an uninterrupted run of BASE on ep=2, which a resumed run must reproduce."""
    root = tmp_path_factory.mktemp("truncated")
    cfg = tiny(root, **{"parallel.ep": 2, "checkpoint.at_end": False,
                        "fault_tolerance.faults": [{"kind": "corrupt_checkpoint", "step": 8}]})
    with running_job(cfg) as controller:
        losses = [ray.get(controller.train_step.remote(s), timeout=300)["loss"] for s in range(STEPS)]
        assert [c["step"] for c in ray.get(controller.list_checkpoints.remote())] == [4, 8]
    return losses, root


def test_resume_after_killing_the_whole_job_reproduces_final_loss(ray_cluster, tmp_path, truncated_run):
    steps = STEPS
    want = truncated_run[0][-1]

    job = train_cli(ray_cluster, tmp_path, steps)
    manifest = tmp_path / "ckpt" / "step_000000008" / "manifest.json"
    deadline = time.time() + 300
    while not manifest.exists() and time.time() < deadline and job.poll() is None:
        time.sleep(0.2)
    assert manifest.exists(), job.communicate(timeout=60)
    os.killpg(job.pid, signal.SIGKILL)  # the driver and everything it started, no clean shutdown
    job.wait(timeout=60)

    resumed = train_cli(ray_cluster, tmp_path, steps, "--resume")
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    assert summary["resumed_from"] == 8
    assert summary["final_loss"] == want


def test_truncated_newest_checkpoint_falls_back_and_experts_reshard(truncated_run):
    losses, tmp_path = truncated_run
    assert (tmp_path / "ckpt" / "step_000000008" / "manifest.json").exists()

    with running_job(tiny(tmp_path, **{"parallel.ep": 2, "checkpoint.at_end": False}), resume=True) as resumed:
        status = ray.get(resumed.status.remote())
        assert status["step"] == 4, status["transitions"]
        assert any("falling back to step 4" in t["why"] or "step 4" in t["why"] for t in status["transitions"])
        again = [ray.get(resumed.train_step.remote(s), timeout=300)["loss"] for s in range(4, 8)]
        assert again == losses[4:8]
        eval_ep2 = ray.get(resumed.evaluate.remote())
        ray.get(resumed.request_checkpoint.remote())
        ray.get(resumed.train_step.remote(8), timeout=300)  # the boundary of step 8 writes it
    # the stop committed step 8's checkpoint; no final one (at_end off), so 8 is the newest

    # the same state onto 4 EP ranks: every expert lands exactly once, the model computes the same function
    with running_job(tiny(tmp_path, **{"parallel.ep": 4}), resume=True) as wider:
        status = ray.get(wider.status.remote())
        assert status["ep"] == 4 and status["step"] == 8
        homes = ray.get(wider.placement.remote())["experts_of_ep_rank"]
        assert sorted(e for ids in homes.values() for e in ids) == list(range(16))
        assert abs(ray.get(wider.evaluate.remote()) - eval_ep2) <= 1e-9
