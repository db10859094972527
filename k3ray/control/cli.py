"""`k3ray` command line: train, drill, config show, plan (the K3-scale simulator), submit and job (Ray Jobs), and
the control commands of a running job (status, placement, policy, incidents, audit, checkpoint, dashboards).

The commands live beside their own parts: train_cli (train, drill), plan_cli (config show, plan), steer_cli (submit,
job, the control commands, dashboards), serve_cli, hf_cli, warmup, prepare; this module builds the parser from them
and turns a failure into one line."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import traceback
from pathlib import Path

from k3ray.config import ConfigError
from k3ray.control import client, hf_cli, plan_cli, serve_cli, steer_cli, train_cli, warmup
from k3ray.control import prepare as prepare_command
from k3ray.control.cli_args import UsageError, count, positive_int

log = logging.getLogger("k3ray")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3ray", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    train_cli.add_parsers(sub)
    serve_cli.add_parser(sub, count)
    warmup.add_parser(sub)
    hf_cli.add_commands(sub, positive_int)
    prepare_command.add_parser(sub, positive_int)
    plan_cli.add_parsers(sub)
    steer_cli.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    if os.path.exists(os.path.expanduser("~/.ray/auth_token")):
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # read by Ray at import: set before anything imports it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, UsageError) as err:
        print(f"k3ray: {err}", file=sys.stderr)
        return 2
    except client.ControlError as err:
        print(f"k3ray: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        print("k3ray: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the user gets one line; the traceback goes to a file
        return _report_failure(err)


def _report_failure(err: BaseException) -> int:
    """One line naming what failed and where the details are; never a traceback on the console."""
    import ray.exceptions

    cause = err
    while isinstance(cause, ray.exceptions.RayTaskError) and cause.cause is not None:
        cause = cause.cause  # the error raised inside the actor, without Ray's wrapping
    name, message = type(cause).__name__, str(cause).strip()
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if isinstance(cause, ray.exceptions.ActorDiedError) and ": " in (lines or [""])[-1]:
        # an actor's constructor failed: Ray's text ends with that error's own line, "module.Class: message"
        name, message = lines[-1].split(": ", 1)
        name = name.rsplit(".", 1)[-1]
    else:
        message = lines[0] if lines else name
    kind = {"CheckpointError": "checkpoint", "GuardError": "training stopped", "TopologyError": "topology",
            "WorkerLost": "workers lost", "RecoveryFailed": "training stopped", "WorkerError": "workers failed"}.get(
        name, name)
    Path("runs").mkdir(exist_ok=True)
    with tempfile.NamedTemporaryFile("w", prefix="error-", suffix=".log", dir="runs", delete=False) as f:
        f.write("".join(traceback.format_exception(err)))
    print(f"k3ray: {kind}: {message} (details: {os.path.relpath(f.name)})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
