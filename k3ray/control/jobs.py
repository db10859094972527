"""`k3ray submit`: a thin wrapper over Ray's JobSubmissionClient (submit, status, logs, stop).

Clusters started by `ray start` on Ray >= 2.5x use token auth; the client reads the token from ~/.ray/auth_token
when RAY_AUTH_MODE=token, which k3ray.cli sets before Ray is imported whenever that file exists."""
from __future__ import annotations

import shlex
import sys
import time


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def submit_command(args) -> int:
    client = _client(args.address)
    if args.action == "submit":
        if not args.config:
            print("k3ray submit: --config is required to submit", file=sys.stderr)
            return 2
        entrypoint = f"k3ray train --config {shlex.quote(args.config)} --no-progress"
        if args.steps:
            entrypoint += f" --steps {args.steps}"
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env={"working_dir": args.working_dir})
        print(job_id)
        if args.wait:
            status = wait(client, job_id)
            print(client.get_job_logs(job_id))
            print(f"{job_id}: {status}")
            return 0 if status == "SUCCEEDED" else 1
        return 0
    if not args.job_id:
        print(f"k3ray submit {args.action}: a job id is required", file=sys.stderr)
        return 2
    if args.action == "status":
        print(client.get_job_status(args.job_id).value)
    elif args.action == "logs":
        print(client.get_job_logs(args.job_id))
    elif args.action == "stop":
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
