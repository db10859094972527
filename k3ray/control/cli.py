"""`k3ray` command line: train, drill, config show, plan (the K3-scale simulator), submit and job (Ray Jobs), and
the control commands of a running job (status, placement, policy, incidents, audit, checkpoint, dashboards)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

from k3ray.config import ConfigError, JobConfig, load_config, parse_assignments
from k3ray.control import client, hf_cli, jobs, serve_cli, warmup
from k3ray.control import prepare as prepare_command
from k3ray.faults import TRAINING_FAULTS

log = logging.getLogger("k3ray")


def _load(args) -> JobConfig:
    overrides = parse_assignments(args.set)
    if getattr(args, "pp", None) is not None:
        overrides["parallel.pp"] = args.pp
    if getattr(args, "ep", None) is not None:
        overrides["parallel.ep"] = args.ep
    cfg = load_config(args.config, overrides).with_paths_from(Path.cwd())
    from k3ray.data import check_data

    check_data(cfg)  # the tokenizer and shards, here: a bad one is one line before any worker starts
    return cfg


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more")
    return value


class UsageError(Exception):
    """Bad input found before anything ran (an unreachable --address, ...): one line, exit 2."""


def _check_address(address: str | None) -> None:
    """Fail fast on a HOST:PORT nobody answers on; ray.init would retry for minutes, printing warnings."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--address {address!r}: expected HOST:PORT of a Ray cluster's GCS, e.g. 127.0.0.1:6379")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as err:
        raise UsageError(f"--address {address}: no Ray cluster answers there ({err.strerror or err}); start one "
                         f"with `ray start --head` or leave out --address for a local cluster") from None


def _announce(status: dict, cfg: JobConfig) -> None:
    """What a person needs once the job runs: where it writes and how to steer it."""
    lines = [f"k3ray: job {cfg.name!r}: {status['workers']} workers (pp {status['pp']} x ep {status['ep']}) "
             f"on {cfg.parallel.device}, from step {status['step']}",
             f"  run dir      {Path(cfg.api.token_file).parent}  (control.json, api_token)",
             f"  checkpoints  {cfg.checkpoint.dir}"]
    if status.get("api_url"):
        lines += [f"  control API  {status['api_url']}  (token: {cfg.api.token_file})",
                  f"  steer it     k3ray status --job {cfg.name} | k3ray policy get moonep --job {cfg.name} | "
                  f"k3ray policy set moonep enabled=false --job {cfg.name}"]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _format_summary(summary: dict) -> str:
    """The end of a run, for a person."""
    steps, secs = summary["steps"], summary.get("seconds") or 0.0
    losses = summary.get("losses") or []
    lines = [f"k3ray: done: {steps} steps in {secs:.1f} s, {summary.get('tokens_per_s', 0.0):,.0f} tokens/s"]
    if "resumed_from" in summary:
        lines[0] += f" (resumed from step {summary['resumed_from']})"
    if losses:
        lines.append(f"  loss         {losses[0]:.4f} -> {losses[-1]:.4f} (final)")
    if summary.get("val_loss"):
        vals = sorted(summary["val_loss"].items())
        lines.append(f"  val loss     {vals[0][1]:.4f} at step {vals[0][0]} -> {vals[-1][1]:.4f} at step {vals[-1][0]}")
    if summary.get("final_maxvio") is not None:
        lines.append(f"  MaxVio       {summary['final_maxvio']:.3f} (last step, mean over MoE layers)")
    topo = summary.get("topology")
    if topo:
        lines.append(f"  workers      pp {topo['pp']} x ep {topo['ep']} (configured ep {topo['ep_configured']})")
    if "incidents" in summary:
        kinds: dict[str, int] = {}
        for incident in summary["incidents"]:
            kinds[incident["kind"]] = kinds.get(incident["kind"], 0) + 1
        text = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "none"
        lines.append(f"  incidents    {text}")
        for i in summary["incidents"]:
            if i["kind"] == "worker_lost":
                first, until = i["replayed_steps"]
                lines.append(f"    step {i['step']}: lost world ranks {i['ranks']} ({i['why']}), ep {i['ep'][0]} -> "
                             f"{i['ep'][1]}, replayed steps {first}..{until - 1} ({until - first}), micro-batches of DP "
                             f"ranks per EP rank {i['dp_ranks_per_ep_rank']} (global batch unchanged)")
            elif i["kind"] == "checkpoint_abandoned":
                lines.append(f"    step {i['step']}: checkpoint abandoned ({i['why']}), newest stays {i['newest']}")
    return "\n".join(lines)


def cmd_train(args) -> int:
    cfg = _load(args)
    steps = cfg.train.steps if args.steps is None else args.steps
    if args.single_process:
        from k3ray.control.driver import run_training
        from k3ray.parallel.reference import ReferenceTrainer

        summary = run_training(ReferenceTrainer(cfg), cfg, steps, progress=not args.no_progress)
    else:
        from k3ray.control.driver import train_distributed

        _check_address(args.address)
        if args.resume_from is not None and not args.resume:
            raise UsageError("--from DIR goes with --resume: start from DIR's newest verified checkpoint")
        if args.resume_from is not None:
            args.resume_from = str(Path(args.resume_from).absolute())
        summary = train_distributed(cfg, steps, address=args.address, progress=not args.no_progress,
                                    resume=args.resume, fresh=args.fresh, resume_from=args.resume_from,
                                    announce=None if args.json else _announce)
    if args.json:
        summary.pop("losses", None)
        print(json.dumps({"summary": summary}, default=str))
    else:
        print(_format_summary(summary))
    return 0


def _rank_list(text: str) -> list[int]:
    try:
        return [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected world ranks separated by commas, e.g. 1,2") from None


def cmd_drill(args) -> int:
    """Train with one fault injected and report what the job did about it."""
    spec = {"kind": args.kind, "step": args.at_step}
    if args.worker is not None:
        spec["worker"] = args.worker
    if args.workers:
        spec["workers"] = args.workers
    if args.at != "step":
        spec["at"] = args.at
    if args.layer is not None:
        spec["layer"] = args.layer
    args.set = args.set + [f"fault_tolerance.faults=[{json.dumps(spec)}]"]
    cfg = _load(args)
    from k3ray.control.driver import train_distributed

    summary = train_distributed(cfg, args.steps or cfg.train.steps, address=args.address, progress=False)
    report = {"drill": spec, "incidents": summary["incidents"], "topology": summary["topology"],
              "final_loss": summary["final_loss"], "steps": summary["steps"]}
    print(json.dumps(report, indent=None if args.json else 2, default=str))
    return 0


def cmd_config_show(args) -> int:
    from k3ray.model.params import model_totals

    cfg = load_config(args.config)
    totals = model_totals(cfg.model)
    if args.json:
        print(json.dumps({"name": cfg.name, **totals}))
        return 0
    print(f"{cfg.name} ({args.config})")
    for key, value in totals.items():
        text = f"{value / 1e9:,.2f} B" if key.endswith("params") and value > 1e8 else f"{value:,}"
        print(f"  {key:<34} {text}")
    print(f"  {'workers (pp x ep)':<34} {cfg.parallel.pp} x {cfg.parallel.ep} = {cfg.parallel.world_size}")
    print(f"  {'global batch (sequences)':<34} {cfg.global_batch_sequences}")
    return 0


def cmd_plan(args) -> int:
    from k3ray.sim import format_table, run_simulation

    cfg = load_config(args.config, parse_assignments(args.set))
    goodput_flags = (args.gpus, args.spares, args.snapshot_every, args.checkpoint_every, args.days, args.calibration,
                     args.svg)
    if not args.faults and any(flag is not None for flag in goodput_flags):
        raise UsageError("plan: --gpus, --spares, --snapshot-every, --checkpoint-every, --days, --calibration and "
                         "--svg go with --faults")
    if args.faults:
        from k3ray.goodput.report import plan_command

        try:
            print(plan_command(cfg, args.faults, args.gpus, args.spares, args.snapshot_every, args.checkpoint_every,
                               args.days, args.seed, args.calibration, args.svg, args.json))
        except ValueError as err:
            raise UsageError(f"plan --faults: {err}") from None
        return 0
    try:
        result = run_simulation(cfg, ranks=args.ranks, trace=args.trace, steps=args.steps, layers=args.layers,
                                tokens_per_rank=args.tokens_per_rank, seed=args.seed, progress=not args.json)
    except ValueError as err:  # a trace spec or file that does not fit
        raise UsageError(f"plan: {err}") from None
    print(json.dumps(result.to_json()) if args.json else format_table(result))
    return 0


def _control_args(p: argparse.ArgumentParser) -> None:
    """How a control command finds its job's API."""
    p.add_argument("--job", help="job name (default: the newest job under --runs-dir)")
    p.add_argument("--runs-dir", default=os.environ.get("K3RAY_RUNS_DIR", "runs"), help="where jobs write control.json")
    p.add_argument("--url", help="control API URL (instead of --job)")
    p.add_argument("--token-file", help="file holding the bearer token (else K3RAY_TOKEN)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="JSON output for scripts")


def _serve_args(p: argparse.ArgumentParser, help_: str) -> None:
    p.add_argument("--serve", metavar="URL", help=help_)
    p.add_argument("--api-key-file", metavar="F", help="that endpoint's API key (else $K3RAY_API_KEY)")


def _ray_jobs_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265"),
                   help="Ray dashboard (Jobs API) address")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3ray", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a config (local Ray cluster unless --address/RAY_ADDRESS)")
    t.add_argument("--config", required=True)
    t.add_argument("--steps", type=_positive_int, help="override train.steps")
    t.add_argument("--single-process", action="store_true", help="the reference trainer: one process, no Ray")
    t.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else start a local cluster)")
    t.add_argument("--pp", type=_positive_int, help="override parallel.pp")
    t.add_argument("--ep", type=_positive_int, help="override parallel.ep")
    t.add_argument("--resume", action="store_true", help="continue from the newest verified checkpoint")
    t.add_argument("--from", dest="resume_from", metavar="DIR",
                   help="with --resume: start from the newest verified checkpoint in DIR (another job's folder; "
                        "this job writes its own checkpoints to its checkpoint.dir)")
    t.add_argument("--fresh", action="store_true", help="with --resume: start from step 0 when no checkpoint "
                                                         "verifies (without it, that is an error)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config field")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--json", action="store_true", help="summary as one JSON line instead of text")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("drill", help="fault drill: train with one injected fault and report the recovery")
    d.add_argument("--config", required=True)
    d.add_argument("--kind", required=True, choices=TRAINING_FAULTS)
    d.add_argument("--at-step", type=int, required=True, help="step to inject at")
    d.add_argument("--worker", type=int, help="world rank (kill_worker, hang_collective)")
    d.add_argument("--workers", type=_rank_list, help="kill_worker: several world ranks at once, e.g. 1,2")
    d.add_argument("--at", default="step", choices=["step", "boundary", "after_step", "relaunch"],
                   help="kill_worker: during the step, at its boundary, after it, or in the next grid launched")
    d.add_argument("--layer", type=int, help="layer (nan)")
    d.add_argument("--steps", type=_positive_int)
    d.add_argument("--address")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_drill, pp=None, ep=None)

    serve_cli.add_parser(sub, _count)
    warmup.add_parser(sub)
    hf_cli.add_commands(sub, _positive_int)
    prepare_command.add_parser(sub, _positive_int)

    c = sub.add_parser("config", help="inspect configs")
    csub = c.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="derived totals: parameters, active parameters, dispatch volume")
    show.add_argument("config")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_config_show)

    pl = sub.add_parser("plan", help="simulate expert placement policies at scale, without weights, and price them "
                                     "(modelled step time: expert rows and weight traffic)")
    pl.add_argument("--config", required=True)
    pl.add_argument("--ranks", type=_positive_int, default=64)
    pl.add_argument("--trace", default="zipf:1.2", help="uniform | zipf:A | dirichlet:A | hot-shift | FILE")
    pl.add_argument("--steps", type=_positive_int, default=4)
    pl.add_argument("--layers", type=_positive_int, help="simulate only the first N layers")
    pl.add_argument("--tokens-per-rank", type=_positive_int, default=4096)
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override config fields, e.g. policies.moonep.ib_gb_per_s=25 policies.moonep.ranks_per_node=4")
    pl.add_argument("--json", action="store_true")
    g = pl.add_argument_group("goodput under faults (k3ray.goodput): --faults replaces the placement simulation")
    g.add_argument("--faults", help="llama3 | mtbf:H | node-mtbf:H | hang-mtbf:H (joined by +) | a YAML/JSON file")
    g.add_argument("--gpus", help="GPU counts, whole replicas of pp x ep (default 1024,4096,16384)")
    g.add_argument("--spares", help="hot spare GPUs (default fault_tolerance.spares)")
    g.add_argument("--snapshot-every", help="steps (default fault_tolerance.snapshot_every)")
    g.add_argument("--checkpoint-every", help="steps, 0 = none (default checkpoint.every_n_steps)")
    g.add_argument("--days", help="days simulated (default 54)")
    g.add_argument("--calibration", metavar="FILE", help="measured phase figures (python -m k3ray.goodput.calibrate)")
    g.add_argument("--svg", metavar="FILE", help="write a plot of goodput against GPUs")
    pl.set_defaults(func=cmd_plan)

    s = sub.add_parser("submit", help="submit `k3ray train --config X` to a cluster as a Ray job; prints the job id")
    s.add_argument("--config", required=True, help="config to train")
    s.add_argument("--steps", type=_positive_int)
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config field")
    s.add_argument("--working-dir", default=".")
    s.add_argument("--wait", action="store_true", help="follow the job until it ends, then print its logs")
    _ray_jobs_address(s)
    s.set_defaults(func=jobs.cmd_submit)

    j = sub.add_parser("job", help="a submitted Ray job: status, logs, stop")
    j.add_argument("action", choices=["status", "logs", "stop"])
    j.add_argument("job_id", help="submission id (printed by k3ray submit)")
    _ray_jobs_address(j)
    j.set_defaults(func=jobs.cmd_job)

    for name, func, help_ in [("status", client.cmd_status, "live job status: step, loss, tokens/s, topology, state"),
                              ("placement", client.cmd_placement, "expert placement and per-rank load"),
                              ("incidents", client.cmd_incidents, "the job's incident log"),
                              ("audit", client.cmd_audit, "every policy change: what, when, from where"),
                              ("checkpoint", client.cmd_checkpoint, "request a durable checkpoint now")]:
        cp = sub.add_parser(name, help=help_)
        _control_args(cp)
        cp.set_defaults(func=func)
        if name in ("status", "incidents", "placement", "audit"):
            _serve_args(cp, f"the {name} of a `k3ray serve` endpoint instead")

    sc = sub.add_parser("scale", help="resize a job's EP dimension: a training job at the next step boundary (the "
                                      "global batch kept), a serving job between two iterations (no request dropped)")
    sc.add_argument("--ep", type=int, required=True, help="the new EP size")
    _control_args(sc)
    _serve_args(sc, "a `k3ray serve` endpoint instead (the request then waits for the new grid)")
    sc.set_defaults(func=client.cmd_scale)

    pol = sub.add_parser("policy", help="read or change live policies (applied at the next step boundary)")
    psub = pol.add_subparsers(dest="policy_command", required=True)
    get = psub.add_parser("get", help="show all policies or one")
    get.add_argument("name", nargs="?")
    _control_args(get)
    _serve_args(get, "the policies of a `k3ray serve` endpoint instead")
    get.set_defaults(func=client.cmd_policy_get)
    put = psub.add_parser("set", help="change fields of one policy: k3ray policy set moonep enabled=false")
    put.add_argument("name")
    put.add_argument("values", nargs="+", metavar="KEY=VALUE", help="values are YAML: true, 2, 0.5, null")
    _control_args(put)
    _serve_args(put, "change a `k3ray serve` endpoint's policy instead (applied at its next iteration)")
    put.set_defaults(func=client.cmd_policy_set)

    dash = sub.add_parser("dashboards", help="Grafana dashboards generated from code")
    dsub = dash.add_subparsers(dest="dashboards_command", required=True)
    exp = dsub.add_parser("export", help="write dashboard JSON and provisioning YAML to DIR")
    exp.add_argument("dir")
    exp.add_argument("--json", action="store_true")
    exp.set_defaults(func=client.cmd_dashboards_export)
    push = dsub.add_parser("push", help="upload the dashboards to a Grafana server")
    push.add_argument("--url", required=True, help="Grafana URL, e.g. http://localhost:3000")
    push.add_argument("--token", help="Grafana service-account token (else GRAFANA_TOKEN)")
    push.add_argument("--datasource-uid", default="prometheus")
    push.add_argument("--folder-uid", default=None)
    push.add_argument("--json", action="store_true")
    push.set_defaults(func=client.cmd_dashboards_push)
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
    message = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    kind = {"CheckpointError": "checkpoint", "GuardError": "training stopped", "TopologyError": "topology",
            "WorkerLost": "workers lost", "RecoveryFailed": "training stopped", "WorkerError": "workers failed"}.get(type(cause).__name__, type(cause).__name__)
    Path("runs").mkdir(exist_ok=True)
    with tempfile.NamedTemporaryFile("w", prefix="error-", suffix=".log", dir="runs", delete=False) as f:
        f.write("".join(traceback.format_exception(err)))
    print(f"k3ray: {kind}: {message} (details: {os.path.relpath(f.name)})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
