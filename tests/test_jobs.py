"""Ray Jobs end to end: `ray job submit ... -- k3ray train` on a `ray start --head` cluster ends SUCCEEDED, and
`k3ray submit` and `k3ray job status|logs` drive the same API."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

from conftest import REPO


def run_submit(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a submit command; right after `ray start` the Jobs API answers 'No available agent' until the node's
    dashboard agent registers, so retry that (only that) for up to 90 s."""
    deadline = time.time() + 90
    while True:
        done = subprocess.run(cmd, capture_output=True, text=True, **kw)
        if "No available agent" not in done.stdout + done.stderr or time.time() > deadline:
            return done
        time.sleep(2)


def test_ray_job_submit_trains_to_success(ray_cluster):
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    cmd = [shutil.which("ray"), "job", "submit", "--address", ray_cluster.dashboard_url, "--working-dir", ".",
           "--", "k3ray", "train", "--config", "configs/tiny.yaml", "--steps", "2", "--no-progress",
           "--set", "data.micro_batch_size=2"]
    done = run_submit(cmd, cwd=REPO, env=env, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    job_id = re.search(r"Job '(raysubmit_\w+)' succeeded", out)
    assert job_id, out[-3000:]
    from ray.job_submission import JobSubmissionClient

    assert JobSubmissionClient(ray_cluster.dashboard_url).get_job_status(job_id.group(1)).value == "SUCCEEDED"
    assert "k3ray: done: 2 steps" in out


def test_k3ray_submit_status_and_logs(ray_cluster):
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    # one worker: the grid's size is not what this checks (the `ray job submit` test above runs the default pp=2 x ep=2)
    sub = run_submit(["k3ray", "submit", "--address", ray_cluster.dashboard_url, "--config", "configs/tiny.yaml",
                      "--steps", "3", "--set", "data.micro_batch_size=2", "--set", "parallel.pp=1",
                      "--set", "parallel.ep=1", "--wait"], cwd=REPO, env=env, timeout=600)
    assert sub.returncode == 0, (sub.stdout + sub.stderr)[-3000:]
    job_id = sub.stdout.split()[0]
    status = subprocess.run(["k3ray", "job", "status", job_id, "--address", ray_cluster.dashboard_url], env=env,
                            capture_output=True, text=True, timeout=120)
    assert status.stdout.strip() == "SUCCEEDED"
    logs = subprocess.run(["k3ray", "job", "logs", job_id, "--address", ray_cluster.dashboard_url], env=env,
                          capture_output=True, text=True, timeout=120)
    assert "k3ray: done: 3 steps" in logs.stdout and "loss" in logs.stdout
