"""The best policy for a grid: a search over snapshot_every, checkpoint every_n_steps and spares, every candidate
run on the same sampled faults (common random numbers, so that differences are the policies'), averaged over a
few seeds; and the Young/Daly optimum of each interval as a check.

Young/Daly: with a stall of delta per save and a mean time M between the faults that roll back to that save, the
interval that minimises (stall + expected lost work) per second is tau = sqrt(2 delta M) - delta (Daly's first
order; Young's is sqrt(2 delta M)), here in steps: tau / t_step.
"""
from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

from k3ray.goodput.costs import PhaseCosts
from k3ray.goodput.profiles import Profile
from k3ray.goodput.simulate import Outcome, Policy, sample_faults, simulate

SNAPSHOT_EVERY = (1, 2, 5, 10, 20, 50, 100)
CHECKPOINT_EVERY = (100, 200, 500, 1000, 2000, 5000)
SPARES_PER_NODE = (0, 1, 2, 4, 8, 16)              # candidates in nodes' worth of GPUs


@dataclass(frozen=True)
class Best:
    outcome: Outcome                               # the best policy's averaged outcome
    young_daly_snapshot: float                     # steps
    young_daly_checkpoint: float                   # steps (inf: no fault goes back to a checkpoint)
    candidates: int

    def to_json(self) -> dict:
        finite = lambda x: x if math.isfinite(x) else None  # noqa: E731 - JSON has no infinity
        return {**self.outcome.to_json(), "young_daly_snapshot_every": finite(self.young_daly_snapshot),
                "young_daly_checkpoint_every": finite(self.young_daly_checkpoint), "candidates": self.candidates}


def young_daly(stall_s: float, mtbf_s: float, step_s: float) -> float:
    """The optimal save interval in steps: (sqrt(2 delta M) - delta) / t_step; inf when no fault rolls back to it."""
    if not math.isfinite(mtbf_s):
        return math.inf
    if stall_s <= 0:
        return 1.0
    tau = math.sqrt(2 * stall_s * mtbf_s)
    return max(tau - stall_s if stall_s < mtbf_s / 2 else tau, step_s) / step_s


def rollback_mtbf_s(profile: Profile, costs: PhaseCosts) -> tuple[float, float]:
    """(mean seconds between faults that go back to a snapshot, ... to a durable checkpoint) on the grid."""
    g, per_node = costs.gpus, costs.gpus_per_node
    on_node_zero = sum(c.rate * per_node for c in profile.classes if c.scope == "node")   # the controller's node
    to_ckpt = on_node_zero + sum(c.rate * g for c in profile.classes if c.scope == "job" and c.detection != "planned")
    to_snap = sum(c.rate * g for c in profile.classes if c.scope != "job") - on_node_zero
    return (3600 / to_snap if to_snap > 0 else math.inf), (3600 / to_ckpt if to_ckpt > 0 else math.inf)


def average(outcomes: list[Outcome]) -> Outcome:
    """The mean of one policy's outcomes over seeds."""
    first = outcomes[0]
    losses = {k: statistics.fmean(o.losses[k] for o in outcomes) for k in first.losses}
    names = {n for o in outcomes for n in o.by_class}
    by_class = {n: {key: statistics.fmean(o.by_class.get(n, {}).get(key, 0) for o in outcomes)
                    for key in ("faults", "lost")} for n in sorted(names)}
    return Outcome(first.gpus, first.policy, statistics.fmean(o.seconds for o in outcomes),
                   statistics.fmean(o.goodput for o in outcomes), losses, by_class,
                   round(statistics.fmean(o.faults for o in outcomes)), statistics.fmean(o.steps for o in outcomes))


def evaluate(costs: PhaseCosts, profile: Profile, policies: list[Policy], seconds: float,
             seeds: list[int]) -> list[Outcome]:
    """Each policy's outcome averaged over `seeds` (the same faults for every policy of a seed)."""
    faults = [sample_faults(profile, costs.gpus, seconds, s) for s in seeds]
    return [average([simulate(costs, profile, p, f, seconds) for f in faults]) for p in policies]


def best_policy(costs: PhaseCosts, profile: Profile, seconds: float, seeds: list[int]) -> Best:
    """The candidate with the highest mean goodput (ties: the first, i.e. the fewest spares and saves)."""
    spare_counts = tuple(n * costs.gpus_per_node for n in SPARES_PER_NODE)
    policies = [Policy(s, c, n) for n, s, c in itertools.product(spare_counts, SNAPSHOT_EVERY, CHECKPOINT_EVERY)]
    outcomes = evaluate(costs, profile, policies, seconds, seeds)
    best = max(outcomes, key=lambda o: o.goodput)
    snap_m, ckpt_m = rollback_mtbf_s(profile, costs)
    p = best.policy
    return Best(best, young_daly(costs.snapshot_stall_s(p.snapshot_every), snap_m, costs.step_s),
                young_daly(costs.checkpoint_stall_s(p.checkpoint_every), ckpt_m, costs.step_s), len(policies))
