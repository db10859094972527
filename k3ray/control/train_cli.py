"""`k3ray train` and `k3ray drill`: load and check the config, train on a Ray cluster (or the single-process
reference), and tell the person what the job did."""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

from k3ray.config import JobConfig, load_config, parse_assignments
from k3ray.control.cli_args import UsageError, positive_int
from k3ray.faults import KILL_AT, TRAINING_FAULTS


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
    snaps = summary.get("snapshots")
    if snaps and snaps["committed"]:
        k = snaps.get("every")
        every = f" (every {k} step{'s' if k != 1 else ''} at the end)" if k else ""
        lines.append(f"  snapshots    {snaps['committed']} in memory{every}, training stalled "
                     f"{snaps['stall_ms_median']:.0f} ms (median) / {snaps['stall_ms_max']:.0f} ms (largest) for them "
                     f"({snaps['worker_stage_ms_median']:.0f} ms of it staging on the slowest worker), "
                     f"{len(snaps['skipped'])} skipped (the one before still arriving)")
        if snaps["read_wait_ms_max"] is not None:
            lines.append(f"               the optimizer waited {snaps['read_wait_ms_median']:.0f} ms (median) / "
                         f"{snaps['read_wait_ms_max']:.0f} ms (largest) per snapshot for the part read live (what the "
                         f"device had no room to stage)")
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


def add_parsers(sub) -> None:
    """The `train` and `drill` commands."""
    t = sub.add_parser("train", help="train a config (local Ray cluster unless --address/RAY_ADDRESS)")
    t.add_argument("--config", required=True)
    t.add_argument("--steps", type=positive_int, help="override train.steps")
    t.add_argument("--single-process", action="store_true", help="the reference trainer: one process, no Ray")
    t.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else start a local cluster)")
    t.add_argument("--pp", type=positive_int, help="override parallel.pp")
    t.add_argument("--ep", type=positive_int, help="override parallel.ep")
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
    d.add_argument("--at", default="step", choices=KILL_AT,
                   help="kill_worker: during the step, at its boundary, after it, in the next grid launched, or in a "
                        "phase of the snapshot taken at its boundary")
    d.add_argument("--layer", type=int, help="layer (nan)")
    d.add_argument("--steps", type=positive_int)
    d.add_argument("--address")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_drill, pp=None, ep=None)
