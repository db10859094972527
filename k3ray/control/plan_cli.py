"""`k3ray config show` (a config's derived totals) and `k3ray plan` (expert placement policies simulated at scale,
goodput under faults, or one worker's device memory), none of which needs a cluster."""
from __future__ import annotations

import json

from k3ray.config import JobConfig, load_config, parse_assignments
from k3ray.control.cli_args import UsageError, positive_int


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
    if args.memory:
        print(_memory_plan(cfg, args.json))
        return 0
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


def _memory_plan(cfg: JobConfig, as_json: bool) -> str:
    """The heaviest worker's device memory (k3ray.policies.memory) and, for execution.device_memory_gib, what the
    pre-flight check of `k3ray train` decides."""
    from k3ray.policies import memory

    est = memory.estimate(cfg)
    device = cfg.execution.device_memory_gib
    decision = None if device is None else memory.decide(cfg, int(device * memory.GiB))
    if as_json:
        out = {"peak_gib": est.peak / memory.GiB, **{f"{k}_gib": v for k, v in est.parts_gib().items()}}
        if decision is not None:
            out |= {"device_gib": device, "decision": decision.outcome, "changes": decision.changes,
                    "fitting_grids": {g: e.peak / memory.GiB for g, e in decision.fitting_grids.items()}}
        return json.dumps(out)
    par = cfg.parallel
    lines = [f"{cfg.name}: device memory per worker (pp {par.pp} x ep {par.ep}, {par.micro_batches} micro-batches of "
             f"{cfg.data.micro_batch_size} x {cfg.data.seq_len} tokens, recompute {cfg.execution.recompute})"]
    lines += [f"  {name:<22} {gib:8.2f} GiB" for name, gib in est.parts_gib().items()]
    lines.append(f"  {'peak':<22} {est.peak / memory.GiB:8.2f} GiB  (static + max(activations + replica_weights + "
                 f"dispatch, optimizer_transient) + overhead)")
    lines.append("  " + (memory.describe(decision) if decision is not None else
                         "set execution.device_memory_gib to see what `k3ray train` decides for a device"))
    return "\n".join(lines)


def add_parsers(sub) -> None:
    """The `config show` and `plan` commands."""
    c = sub.add_parser("config", help="inspect configs")
    csub = c.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="derived totals: parameters, active parameters, dispatch volume")
    show.add_argument("config")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_config_show)

    pl = sub.add_parser("plan", help="simulate expert placement policies at scale, without weights, and price them "
                                     "(modelled step time: expert rows and weight traffic)")
    pl.add_argument("--config", required=True)
    pl.add_argument("--ranks", type=positive_int, default=64)
    pl.add_argument("--trace", default="zipf:1.2", help="uniform | zipf:A | dirichlet:A | hot-shift | FILE")
    pl.add_argument("--steps", type=positive_int, default=4)
    pl.add_argument("--layers", type=positive_int, help="simulate only the first N layers")
    pl.add_argument("--tokens-per-rank", type=positive_int, default=4096)
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override config fields, e.g. policies.moonep.ib_gb_per_s=25 policies.moonep.ranks_per_node=4")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--memory", action="store_true",
                    help="instead of the simulation: one worker's device memory estimate, and what `k3ray train` "
                         "decides for a device of execution.device_memory_gib (e.g. --set "
                         "execution.device_memory_gib=79.6)")
    g = pl.add_argument_group("goodput under faults (k3ray.goodput): --faults replaces the placement simulation")
    g.add_argument("--faults", help="llama3 | mtbf:H | node-mtbf:H | hang-mtbf:H (joined by +) | a YAML/JSON file")
    g.add_argument("--gpus", help="GPU counts, whole replicas of pp x ep (default 1024,4096,16384)")
    g.add_argument("--spares", help="hot spare GPUs (default fault_tolerance.spares)")
    g.add_argument("--snapshot-every", help="steps, or auto (default fault_tolerance.snapshot_every)")
    g.add_argument("--checkpoint-every", help="steps, 0 = none (default checkpoint.every_n_steps)")
    g.add_argument("--days", help="days simulated (default 54)")
    g.add_argument("--calibration", metavar="FILE", help="measured phase figures (python -m k3ray.goodput.calibrate)")
    g.add_argument("--svg", metavar="FILE", help="write a plot of goodput against GPUs")
    pl.set_defaults(func=cmd_plan)
