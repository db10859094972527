"""`k3ray` command line: train, config show, plan (the K3-scale simulator), submit (Ray Jobs)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from k3ray.config import ConfigError, JobConfig, load_config, parse_assignments


def _load(args) -> JobConfig:
    overrides = parse_assignments(args.set)
    if getattr(args, "pp", None):
        overrides["parallel.pp"] = args.pp
    if getattr(args, "ep", None):
        overrides["parallel.ep"] = args.ep
    return load_config(args.config, overrides)


def cmd_train(args) -> int:
    cfg = _load(args)
    steps = args.steps or cfg.train.steps
    if args.single_process:
        from k3ray.trainer import ReferenceTrainer, run_training

        summary = run_training(ReferenceTrainer(cfg), cfg, steps, progress=not args.no_progress)
    else:
        from k3ray.runtime.driver import train_distributed

        summary = train_distributed(cfg, steps, address=args.address, progress=not args.no_progress,
                                    resume=args.resume)
    summary.pop("losses", None)
    print(json.dumps({"summary": summary}, indent=None if args.json else 2, default=str))
    return 0


def cmd_drill(args) -> int:
    """Train with one fault injected and report what the job did about it."""
    spec = {"kind": args.kind, "step": args.at_step}
    if args.worker is not None:
        spec["worker"] = args.worker
    if args.layer is not None:
        spec["layer"] = args.layer
    args.set = args.set + [f"fault_tolerance.faults=[{json.dumps(spec)}]"]
    cfg = _load(args)
    from k3ray.runtime.driver import train_distributed

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

    cfg = load_config(args.config)
    result = run_simulation(cfg, ranks=args.ranks, trace=args.trace, steps=args.steps, layers=args.layers,
                            tokens_per_rank=args.tokens_per_rank, seed=args.seed, progress=not args.json)
    print(json.dumps(result.to_json()) if args.json else format_table(result))
    return 0


def cmd_submit(args) -> int:
    from k3ray.runtime.jobs import submit_command

    return submit_command(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3ray", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a config (local Ray cluster unless --address/RAY_ADDRESS)")
    t.add_argument("--config", required=True)
    t.add_argument("--steps", type=int, help="override train.steps")
    t.add_argument("--single-process", action="store_true", help="the reference trainer: one process, no Ray")
    t.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else start a local cluster)")
    t.add_argument("--pp", type=int, help="override parallel.pp")
    t.add_argument("--ep", type=int, help="override parallel.ep")
    t.add_argument("--resume", action="store_true", help="continue from the newest verified checkpoint")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config field")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--json", action="store_true", help="summary as one JSON line")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("drill", help="fault drill: train with one injected fault and report the recovery")
    d.add_argument("--config", required=True)
    d.add_argument("--kind", required=True, choices=["kill_worker", "nan", "hang_collective", "corrupt_checkpoint"])
    d.add_argument("--at-step", type=int, required=True, help="step to inject at")
    d.add_argument("--worker", type=int, help="world rank (kill_worker, hang_collective)")
    d.add_argument("--layer", type=int, help="layer (nan)")
    d.add_argument("--steps", type=int)
    d.add_argument("--address")
    d.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_drill, pp=None, ep=None)

    c = sub.add_parser("config", help="inspect configs")
    csub = c.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="derived totals: parameters, active parameters, dispatch volume")
    show.add_argument("config")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_config_show)

    pl = sub.add_parser("plan", help="simulate expert placement policies at scale, without weights")
    pl.add_argument("--config", required=True)
    pl.add_argument("--ranks", type=int, default=64)
    pl.add_argument("--trace", default="zipf:1.2", help="uniform | zipf:A | dirichlet:A | hot-shift | FILE")
    pl.add_argument("--steps", type=int, default=4)
    pl.add_argument("--layers", type=int, help="simulate only the first N layers")
    pl.add_argument("--tokens-per-rank", type=int, default=4096)
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(func=cmd_plan)

    s = sub.add_parser("submit", help="Ray Jobs: submit, status, logs, stop")
    s.add_argument("action", choices=["submit", "status", "logs", "stop"])
    s.add_argument("job_id", nargs="?", help="submission id (status, logs, stop)")
    s.add_argument("--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265"))
    s.add_argument("--config", help="config to train (submit)")
    s.add_argument("--steps", type=int)
    s.add_argument("--working-dir", default=".")
    s.add_argument("--wait", action="store_true", help="submit: follow the logs until the job ends")
    s.set_defaults(func=cmd_submit)

    from k3ray.control_cli import add_control_commands  # status, placement, policy, incidents, checkpoint, dashboards

    add_control_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    if os.path.exists(os.path.expanduser("~/.ray/auth_token")):
        os.environ.setdefault("RAY_AUTH_MODE", "token")  # read by Ray at import: set before anything imports it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"k3ray: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("k3ray: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
