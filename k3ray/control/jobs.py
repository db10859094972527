"""`k3ray submit` and `k3ray job status|logs|stop`: a thin wrapper over Ray's JobSubmissionClient.

Clusters started by `ray start` on Ray >= 2.5x use token auth; the client reads the token from ~/.ray/auth_token
when RAY_AUTH_MODE=token, which k3ray.control.cli sets before Ray is imported whenever that file exists."""
from __future__ import annotations

import shlex
import time

from k3ray.config import load_config, parse_assignments


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def cmd_submit(args) -> int:
    """`k3ray submit --config X [--set K=V ...]`: submit `k3ray train` as a Ray job; print its id (and with --wait,
    its logs). The config and its overrides are checked here first, so a bad value fails before anything is sent."""
    load_config(args.config, parse_assignments(args.set))
    client = _client(args.address)
    entrypoint = f"k3ray train --config {shlex.quote(args.config)} --no-progress"
    if args.steps:
        entrypoint += f" --steps {args.steps}"
    entrypoint += "".join(f" --set {shlex.quote(item)}" for item in args.set)
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": args.working_dir})
    print(job_id)
    if not args.wait:
        return 0
    status = wait(client, job_id)
    print(client.get_job_logs(job_id))
    print(f"{job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def cmd_job(args) -> int:
    """`k3ray job status|logs|stop JOB_ID`."""
    client = _client(args.address)
    if args.action == "status":
        print(client.get_job_status(args.job_id).value)
    elif args.action == "logs":
        print(client.get_job_logs(args.job_id))
    else:
        print("stopped" if client.stop_job(args.job_id) else "not running")
    return 0


def wait(client, job_id: str, timeout_s: float = 1800.0) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status = client.get_job_status(job_id).value
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(1.0)
    return "TIMEOUT"
