"""The command line: the placement simulator, a fault drill, and Ctrl-C ending a running job cleanly."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from conftest import REPO
from k3ray.control.cli import main


def test_plan_simulates_k3_scale_placement(capsys):
    code = main(["plan", "--config", "configs/k3.yaml", "--ranks", "64", "--trace", "zipf:1.2", "--layers", "2",
                 "--steps", "1", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    text = json.dumps(result)
    assert "moonep" in text and "replicas" in text
    main(["plan", "--config", "configs/k3.yaml", "--ranks", "64", "--trace", "zipf:1.2", "--layers", "2",
          "--steps", "1"])
    table = capsys.readouterr().out
    moonep_row = next(line for line in table.splitlines() if line.startswith("moonep "))
    assert moonep_row.split()[1] == "1.000"  # max/mean rank load: exactly balanced
    assert "moonep-priced" in table and "modelled ms/step" in table and "InfiniBand" in table


def test_plan_prices_each_policy_and_refuses_bad_overrides(capsys):
    args = ["plan", "--config", "configs/k3.yaml", "--ranks", "16", "--trace", "zipf:1.2", "--layers", "2",
            "--steps", "1", "--tokens-per-rank", "512", "--json"]
    assert main(args + ["--set", "policies.moonep.ib_gb_per_s=25"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cost"]["ib_bytes_per_s"] == 25e9
    step_ms = {name: p["modelled_ms_per_step"] for name, p in result["policies"].items()}
    assert 0 < step_ms["moonep-priced"] <= min(step_ms["none"], step_ms["moonep"])
    assert main(args + ["--set", "policies.moonep.ib_gb_per_s=0"]) == 2
    err = capsys.readouterr().err
    assert "policies.moonep.ib_gb_per_s" in err and "Traceback" not in err


def _k3ray(*args: str) -> list[str]:
    return [sys.executable, "-m", "k3ray.control.cli", *args]


def test_drill_kills_a_worker_and_reports_the_recovery(ray_cluster, tmp_path):
    cmd = _k3ray("drill", "--config", "configs/tiny.yaml", "--kind", "kill_worker", "--at-step", "3", "--worker", "1",
                 "--steps", "6", "--address", ray_cluster.address, "--json", "--set", f"checkpoint.dir={tmp_path}",
                 "--set", "parallel.pp=1", "--set", "parallel.ep=2", "--set", "train.eval_every=0",
                 "--set", "fault_tolerance.snapshot_every=2", "--set", "fault_tolerance.grow_back=false",
                 "--set", "data.micro_batch_size=2")
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [i["kind"] for i in report["incidents"]] == ["worker_lost"] and report["steps"] == 6
    assert report["incidents"][0]["ep"] == [2, 1] and report["topology"]["ep"] == 1  # carried on shrunk


def test_ctrl_c_stops_the_job_and_its_actors(ray_cluster):
    import ray
    from ray.util.state import list_actors

    # As from a terminal's foreground: SIGINT at its default. A harness started in the background by a shell without
    # job control ignores SIGINT, every child inherits that, and Python then installs no KeyboardInterrupt handler.
    foreground = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                  "from k3ray.control.cli import main; sys.exit(main())")
    cmd = [sys.executable, "-c", foreground, "train", "--config", "configs/tiny.yaml", "--steps", "100000",
           "--address", ray_cluster.address, "--no-progress", "--pp", "1", "--ep", "2", "--set", "train.eval_every=0",
           "--set", "data.micro_batch_size=2", "--set", "name=ctrlc"]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    for line in job.stderr:  # log lines go to stderr; wait for the first step
        if "loss=" in line or time.time() > deadline:
            break
    job.send_signal(signal.SIGINT)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 130, err[-2000:]
    assert "interrupted" in err

    def alive() -> list:  # no other job runs now: any live controller or worker would be this job's orphan
        return [a for a in list_actors(address=ray_cluster.address, filters=[("state", "=", "ALIVE")], limit=1000)
                if a.class_name in ("Controller", "Worker")]

    deadline = time.time() + 60
    while alive() and time.time() < deadline:
        time.sleep(1)
    assert not alive(), alive()
    assert ray.is_initialized()


def test_an_actor_constructor_failure_is_reported_as_its_own_error_in_one_line(tmp_path, monkeypatch, capsys):
    """Ray's text for an actor whose constructor raised ends with that error's line; the user gets that line."""
    import ray.exceptions

    from k3ray.control.cli import _report_failure

    class ConstructorFailed(ray.exceptions.ActorDiedError):
        def __str__(self):
            return ("The actor died because of an error raised in its creation task, ray::ServingEngine.__init__()\n"
                    "  File \"engine.py\", line 1, in __init__\n"
                    "k3ray.io.checkpoint.CheckpointError: /ck: no verified checkpoint\n")

    monkeypatch.chdir(tmp_path)
    assert _report_failure(ConstructorFailed()) == 1
    err = capsys.readouterr().err
    assert err.startswith("k3ray: checkpoint: /ck: no verified checkpoint (details: runs/error-")
    assert err.count("\n") == 1
