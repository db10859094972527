"""`k3ray plan --faults`: the plan for each GPU count (the given policy and the best found), the table with the
formulas, the JSON, and an SVG of goodput against GPUs for several policies (written by hand: no plotting
dependency)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from k3ray.goodput import calibration as calibration_file
from k3ray.goodput.calibration import Calibration
from k3ray.goodput.costs import PhaseCosts, formulas, phase_costs
from k3ray.goodput.optimise import Best, best_policy, evaluate
from k3ray.goodput.profiles import Profile, load_profile
from k3ray.goodput.simulate import PHASES, Outcome, Policy
from k3ray.policies.snapshot_cadence import snapshot_interval

ANCHORS = (("Llama 3, 16,384 H100s, 54 days", "> 90 %"), ("ByteRobust, 9,600 GPUs, 3 months", "97 %"),
           ("Gemini, in-memory redundant copies", "97 %"))


@dataclass
class GridPlan:
    costs: PhaseCosts
    given: Outcome
    best: Best
    no_spares: Outcome          # the best policy's intervals without spares
    formulas: list[str]


def parse_gpus(text: str) -> list[int]:
    try:
        gpus = [int(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"--gpus {text!r}: expected GPU counts separated by commas, e.g. 1024,4096,16384") from None
    if any(g <= 0 for g in gpus):
        raise ValueError(f"--gpus {text!r}: GPU counts must be positive")
    return gpus


def parse_count(flag: str, text: str | None, default: int, least: int) -> int:
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: not an integer") from None
    if value < least:
        raise ValueError(f"{flag} {value}: must be {least} or more")
    return value


def parse_days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        raise ValueError(f"--days {text!r}: not a number") from None
    if not 0 < days <= 3650:
        raise ValueError(f"--days {days:g}: must be more than 0 and at most 3650")
    return days


def plan(cfg, gpus: list[int], faults: str, policy: Policy, days: float, seed: int = 0, seeds: int = 3,
         calib_path: str | None = None) -> tuple[Profile, Calibration, list[GridPlan]]:
    """Every GPU count's plan; ValueError (one line) on bad input."""
    profile = load_profile(faults)
    calib = calibration_file.load(calib_path) if calib_path else Calibration()
    seconds = days * 86400.0
    seed_list = list(range(seed, seed + seeds))
    plans = []
    for g in gpus:
        costs = phase_costs(cfg, g, calib, profile.gpus_per_node)
        given = evaluate(costs, profile, [at_grid(policy, costs, cfg.fault_tolerance.snapshot_budget)], seconds,
                         seed_list)[0]
        best = best_policy(costs, profile, seconds, seed_list)
        no_spares = evaluate(costs, profile, [replace(best.outcome.policy, spares=0)], seconds, seed_list)[0]
        plans.append(GridPlan(costs, given, best, no_spares, formulas(cfg, calib, costs)))
    return profile, calib, plans


def at_grid(policy: Policy, costs, budget: float) -> Policy:
    """The policy with snapshot_every "auto" resolved as training resolves it (k3ray.policies.snapshot_cadence) from
    this grid's modelled snapshot stall, offload and step."""
    if policy.snapshot_every != "auto":
        return policy
    arrival_steps = math.floor(costs.snapshot_offload_s / costs.step_s) + 1 if costs.step_s > 0 else 1
    return replace(policy, snapshot_every=snapshot_interval(costs.snapshot_stage_s, costs.step_s, arrival_steps,
                                                            budget))


def _row(label: str, g: int, o: Outcome) -> str:
    cells = " ".join(f"{100 * o.losses[k]:>7.2f}" for k in PHASES)
    return f"{g:>7,} {label:<7} {o.faults:>6} {100 * o.goodput:>8.2f} {cells}  {o.policy.label()}"


def format_table(cfg, profile: Profile, calib: Calibration, plans: list[GridPlan], days: float, seeds: int) -> str:
    heads = {"detection": "detect", "swap": "swap", "relaunch": "launch", "restore": "restore", "warmup": "warmup",
             "replay": "replay", "shrunk": "shrunk", "grow_back": "growbk", "snapshot_stall": "snap",
             "checkpoint_stall": "ckpt", "spares_idle": "spares"}
    lines = [f"goodput of {cfg.name} under {profile.name} faults, {days:g} days, mean of {seeds} seeded runs; "
             f"repair {profile.repair_hours:g} h; calibration: {'; '.join(calib.sources)}",
             "  losses in % of the GPU time of the grid and its spares (they add up to 100 - goodput)",
             f"{'GPUs':>7} {'policy':<7} {'faults':>6} {'goodput':>8} " + " ".join(f"{heads[k]:>7}" for k in PHASES)]
    for p in plans:
        g = p.costs.gpus
        lines += [_row("given", g, p.given), _row("best", g, p.best.outcome), _row("0 spare", g, p.no_spares)]
    lines.append("best intervals against Young/Daly (tau = sqrt(2 x stall x MTBF) - stall, in steps):")
    for p in plans:
        b, pol = p.best, p.best.outcome.policy
        lines.append(f"  G={p.costs.gpus:,}: snapshot_every {pol.snapshot_every} (Young/Daly "
                     f"{b.young_daly_snapshot:.1f}), checkpoint every_n_steps {pol.checkpoint_every} (Young/Daly "
                     f"{b.young_daly_checkpoint:.0f}), spares {pol.spares}; job MTBF "
                     f"{profile.mtbf_hours(p.costs.gpus):.2f} h, t_step {p.costs.step_s:.1f} s")
    lines.append("anchors: " + "; ".join(f"{name} {value}" for name, value in ANCHORS))
    worst = plans[-1]
    gap = 0.98 - worst.best.outcome.goodput
    if gap > 0:
        phase = max(PHASES, key=lambda k: worst.best.outcome.losses[k])
        lines.append(f"at {worst.costs.gpus:,} GPUs the best policy is {100 * gap:.2f} points under 98 %; the largest "
                     f"loss is {phase} ({100 * worst.best.outcome.losses[phase]:.2f} %)")
    lines.append(f"formulas (G = {worst.costs.gpus:,}):")
    lines += [f"  {f}" for f in worst.formulas]
    return "\n".join(lines)


def to_json(profile: Profile, calib: Calibration, plans: list[GridPlan], days: float) -> dict:
    return {"profile": profile.to_json(), "calibration": calib.to_json(), "days": days,
            "grids": [{"gpus": p.costs.gpus, "columns": p.costs.columns, "step_s": p.costs.step_s,
                       "mtbf_hours": profile.mtbf_hours(p.costs.gpus), "given": p.given.to_json(),
                       "best": p.best.to_json(), "best_without_spares": p.no_spares.to_json(),
                       "formulas": p.formulas} for p in plans]}


def svg(plans: list[GridPlan], title: str) -> str:
    """Goodput (%) against GPUs (log scale) for the given policy, the best one and the best without spares."""
    width, height, left, right, top, bottom = 640, 400, 60, 170, 30, 50
    series = {"given": [p.given for p in plans], "best": [p.best.outcome for p in plans],
              "best, no spares": [p.no_spares for p in plans]}
    colors = {"given": "#d62728", "best": "#2ca02c", "best, no spares": "#1f77b4"}
    xs = [math.log2(p.costs.gpus) for p in plans]
    ys = [100 * o.goodput for outs in series.values() for o in outs]
    x0, x1 = min(xs) - 0.5, max(xs) + 0.5
    y0, y1 = math.floor(min(ys + [90]) - 1), 100.0
    px = lambda x: left + (x - x0) / (x1 - x0) * (width - left - right)  # noqa: E731
    py = lambda y: top + (y1 - y) / (y1 - y0) * (height - top - bottom)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11">', f'<text x="{left}" y="18" font-size="13">{title}</text>',
           f'<line x1="{left}" y1="{py(y0)}" x2="{width - right}" y2="{py(y0)}" stroke="black"/>',
           f'<line x1="{left}" y1="{py(y0)}" x2="{left}" y2="{py(y1)}" stroke="black"/>']
    step = 1 if y1 - y0 <= 12 else 5
    for y in range(int(y0), int(y1) + 1, step):
        out.append(f'<line x1="{left}" y1="{py(y):.1f}" x2="{width - right}" y2="{py(y):.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y}</text>')
    for x, p in zip(xs, plans):
        out.append(f'<text x="{px(x):.1f}" y="{py(y0) + 16}" text-anchor="middle">{p.costs.gpus:,}</text>')
    mid = (top + height - bottom) / 2
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">GPUs</text>'
               f'<text x="14" y="{mid}" transform="rotate(-90 14 {mid})" text-anchor="middle">goodput %</text>')
    for i, (name, outs) in enumerate(series.items()):
        pts = " ".join(f"{px(x):.1f},{py(100 * o.goodput):.1f}" for x, o in zip(xs, outs))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{colors[name]}" stroke-width="2"/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(100 * o.goodput):.1f}" r="3" fill="{colors[name]}"/>'
                for x, o in zip(xs, outs)]
        out.append(f'<text x="{width - right + 10}" y="{top + 16 * i + 10}" fill="{colors[name]}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def plan_command(cfg, faults: str, gpus: str | None, spares: str | None, snapshot_every: str | None,
                 checkpoint_every: str | None, days: str | None, seed: int, calibration: str | None, svg_path: str | None,
                 as_json: bool) -> str:
    """`k3ray plan --faults`: the flags as given (text), checked here so that a bad one is one line (ValueError);
    the policy flags default to the config's fault_tolerance and checkpoint sections."""
    gpus, days = gpus or "1024,4096,16384", days or "54"
    ft = cfg.fault_tolerance
    every = "auto" if snapshot_every == "auto" else parse_count("--snapshot-every", snapshot_every,
                                                                   ft.snapshot_every, 1)
    policy = Policy(every,
                    parse_count("--checkpoint-every", checkpoint_every, cfg.checkpoint.every_n_steps, 0),
                    parse_count("--spares", spares, ft.spares, 0))
    day_count, seeds = parse_days(days), 3
    profile, calib, plans = plan(cfg, parse_gpus(gpus), faults, policy, day_count, seed, seeds, calibration)
    if svg_path:
        try:
            with open(svg_path, "w") as f:
                f.write(svg(plans, f"{cfg.name}: goodput under {profile.name} faults, {day_count:g} days"))
        except OSError as err:
            raise ValueError(f"--svg {svg_path}: {err.strerror or err}") from None
    if as_json:
        return json.dumps(to_json(profile, calib, plans, day_count))
    return format_table(cfg, profile, calib, plans, day_count, seeds)
