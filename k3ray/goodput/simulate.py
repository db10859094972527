"""One seeded run of a job under a failure process: the discrete-event simulation.

Fault times are drawn per failure class at once (a Poisson process on the whole grid: the number of faults, then
their times and GPUs, vectorised); the loop then walks the faults in time order, a few thousand at most. Between
faults the job trains: each step takes t_step x ceil(C / C_alive) plus its share of the snapshot and checkpoint
stalls. A fault, as k3ray handles it (k3ray.train.failures):
  - gpu or node scope, found by detection (crash, node, hang): roll back to the last snapshot; hot spares take the
    lost places when enough are free (swap, the grid keeps its size), else the grid is launched anew without the
    lost columns (relaunch; shrunk until the grow-back; when no column survives, the same grid once its GPUs are
    back); the state is restored, the new workers' first steps are slower (warm-up), the lost steps run again;
  - guard (a blow-up, e.g. silent data corruption): roll back to the last snapshot and replay, on the same grid;
  - job scope, or a node fault on the node holding the controller (node 0): the whole job restarts from the last
    durable checkpoint (planned stops write one first, so they lose no steps).
Spares in use and lost GPUs come back `repair_hours` after a fault that needs repair (at once otherwise); the grid
grows back to full size when every lost GPU is back and grow_back_after_steps steps ran shrunk, taking a snapshot
there (a later fault goes back no further).

Losses are fractions of the GPU time of the grid and its spares; with the goodput they add up to 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from k3ray.goodput.costs import PhaseCosts
from k3ray.goodput.profiles import Profile

PHASES = ("detection", "swap", "relaunch", "restore", "warmup", "replay", "shrunk", "grow_back", "snapshot_stall",
          "checkpoint_stall", "spares_idle")


@dataclass(frozen=True)
class Policy:
    snapshot_every: int | str  # "auto" until resolved for a grid (k3ray.goodput.report.at_grid)
    checkpoint_every: int      # 0: no periodic checkpoint (a job restart goes back to the start)
    spares: int                # hot spare GPUs beside the grid

    def label(self) -> str:
        return f"snapshot {self.snapshot_every}, checkpoint {self.checkpoint_every}, spares {self.spares}"


@dataclass(frozen=True)
class Faults:
    """Faults of one run, in time order: wall second [n], class index [n], GPU index [n]."""
    time_s: np.ndarray
    cls: np.ndarray
    gpu: np.ndarray


def sample_faults(profile: Profile, gpus: int, seconds: float, seed: int) -> Faults:
    """Each class: Poisson(rate x G x hours) faults, uniform in time and over the GPUs."""
    rng = np.random.default_rng(seed)
    hours = seconds / 3600.0
    counts = rng.poisson([c.rate * gpus * hours for c in profile.classes])
    times = rng.uniform(0.0, seconds, int(counts.sum()))
    cls = np.repeat(np.arange(len(profile.classes)), counts)
    gpu = rng.integers(0, gpus, int(counts.sum()))
    order = np.argsort(times, kind="stable")
    return Faults(times[order], cls[order], gpu[order])


@dataclass
class Outcome:
    gpus: int
    policy: Policy
    seconds: float                                   # wall time simulated (T, or more if a recovery ran past it)
    goodput: float
    losses: dict[str, float]                         # by phase, fractions of GPU time
    by_class: dict[str, dict] = field(default_factory=dict)   # faults and lost fraction per failure class
    faults: int = 0
    steps: float = 0.0                               # steps kept
    fault_steps: list[int] = field(default_factory=list)      # the step each fault landed in

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "policy": self.policy.__dict__, "seconds": self.seconds, "goodput": self.goodput,
                "losses": self.losses, "by_class": self.by_class, "faults": self.faults, "steps": self.steps}


class _Run:
    """The job's state while the loop walks the faults; `wall[phase]` holds grid seconds by phase."""

    def __init__(self, costs: PhaseCosts, policy: Policy, stop_steps: float | None):
        self.c, self.p = costs, policy
        self.stop_steps = stop_steps    # end once this many steps are kept (None: at the end of the time)
        self.done = False
        self.t = 0.0                    # wall seconds
        self.steps = 0.0                # steps done (fractions: a step under way)
        self.lost_columns = 0
        self.back_at = 0.0              # when every lost GPU is back
        self.shrunk_since = 0.0         # wall second the grid shrank (grow-back waits grow_back_after_steps)
        self.grown_back_at = 0.0        # step of the last grow-back: it takes a snapshot there
        self.spares_free = policy.spares
        self.spare_returns: list[tuple[float, int]] = []
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.useful = 0.0
        self.snap_stall = costs.snapshot_stall_s(policy.snapshot_every) / policy.snapshot_every
        self.ckpt_stall = (costs.checkpoint_stall_s(policy.checkpoint_every) / policy.checkpoint_every
                           if policy.checkpoint_every else 0.0)

    def _train(self, until: float) -> None:
        """Train from t to `until` at the grid's present speed."""
        dt = until - self.t
        if dt <= 0:
            return
        f = self.c.slowdown(self.lost_columns)
        per_step = self.c.step_s * f + self.snap_stall + self.ckpt_stall
        n = dt / per_step
        if self.stop_steps is not None and self.steps + n >= self.stop_steps:
            n, self.done = self.stop_steps - self.steps, True
            until = self.t + n * per_step
        self.steps += n
        self.useful += n * self.c.step_s
        self.wall["shrunk"] += n * self.c.step_s * (f - 1)
        self.wall["snapshot_stall"] += n * self.snap_stall
        self.wall["checkpoint_stall"] += n * self.ckpt_stall
        self.t = until

    def advance(self, until: float) -> None:
        """Train until `until`, growing back on the way when due."""
        while self.lost_columns and self.t < until and not self.done:
            due = max(self.back_at, self.shrunk_since + self.c.grow_back_after_steps * self.c.step_s
                      * self.c.slowdown(self.lost_columns))
            if due >= until:
                break
            self._train(max(due, self.t))
            self.pause("grow_back", self.c.grow_back_s)
            self.pause("warmup", self.c.warmup_s)
            self.lost_columns = 0
            self.grown_back_at = self.steps
        self._train(until)

    def pause(self, phase: str, seconds: float) -> None:
        self.wall[phase] += seconds
        self.t += seconds

    def roll_back(self, every: int, snapshot: bool = True) -> float:
        """Back to the last snapshot (the periodic one, or a grow-back's), or to the last checkpoint (`snapshot`
        False; `every` 0 = the start); returns the lost steps."""
        kept = math.floor(self.steps / every + 1e-9) * every if every else 0.0
        kept = max(kept, self.grown_back_at) if snapshot else kept
        self.grown_back_at = min(self.grown_back_at, kept)
        lost = self.steps - kept
        self.steps = kept
        self.useful -= lost * self.c.step_s
        self.wall["replay"] += lost * self.c.step_s
        return lost

    def free_spares(self) -> None:
        back = [n for when, n in self.spare_returns if when <= self.t]
        self.spare_returns = [(when, n) for when, n in self.spare_returns if when > self.t]
        self.spares_free += sum(back)


def _lose_gpus(run: _Run, c: PhaseCosts, policy: Policy, fc, repair_s: float) -> None:
    """A GPU (or a node's, by fc.scope) lost and detected: back to the last snapshot, then a spare swapped in, or
    the grid shrunk by the lost columns, or (no column left) the same grid started again once the GPUs are back
    (LossDecision restart); the lost GPUs return after `repair_s`."""
    lost = c.gpus_per_node if fc.scope == "node" else 1
    run.pause("detection", c.detect_s[fc.detection])
    run.roll_back(policy.snapshot_every)
    run.free_spares()
    back = run.t + repair_s
    if run.spares_free >= lost:
        run.spares_free -= lost
        run.spare_returns.append((back, lost))
        run.pause("swap", c.swap_s)
    elif run.lost_columns + lost < c.columns:
        run.pause("relaunch", c.relaunch_s)
        run.lost_columns += lost
        run.back_at = max(run.back_at, back)
        run.shrunk_since = run.t
    else:
        run.back_at = max(run.back_at, back)
        run.pause("relaunch", max(run.back_at - run.t, 0.0) + c.relaunch_s)
        run.lost_columns = 0
    run.pause("restore", c.restore_s)
    run.pause("warmup", c.warmup_s)


def simulate(costs: PhaseCosts, profile: Profile, policy: Policy, faults: Faults, seconds: float,
             steps: float | None = None) -> Outcome:
    """Run `seconds` of wall time under `faults` (sample_faults), or, with `steps`, until that many steps are kept
    (a run of a fixed length, as the validation's); see the module's docstring."""
    c, run = costs, _Run(costs, policy, steps)
    repair_s = profile.repair_hours * 3600.0
    per_class = [dict(faults=0, seconds=0.0) for _ in profile.classes]
    fault_steps = []
    for when, ci, gpu in zip(faults.time_s.tolist(), faults.cls.tolist(), faults.gpu.tolist()):
        if when >= seconds:
            break
        run.advance(when)
        if run.done:
            break
        fc = profile.classes[ci]
        before = dict(run.wall), run.useful
        fault_steps.append(int(run.steps))
        node_zero = fc.scope == "node" and gpu // c.gpus_per_node == 0
        if fc.scope == "job" or node_zero:
            if fc.detection == "planned":
                run.pause("checkpoint_stall", c.checkpoint_write_s)   # a checkpoint on request, then the stop
                run.roll_back(1, snapshot=False)
            else:
                run.pause("detection", c.detect_s[fc.detection])
                run.roll_back(policy.checkpoint_every, snapshot=False)
            run.pause("relaunch", c.relaunch_s)
            run.pause("restore", c.checkpoint_load_s)
            run.pause("warmup", c.warmup_s)
        elif fc.detection == "guard":
            run.roll_back(policy.snapshot_every)
            run.pause("restore", c.restore_s)
        else:
            _lose_gpus(run, c, policy, fc, repair_s if fc.repair else 0.0)
        stats = per_class[ci]
        stats["faults"] += 1
        stats["seconds"] += sum(run.wall.values()) - sum(before[0].values()) + before[1] - run.useful
    run.advance(math.inf if steps is not None else max(seconds, run.t))
    total = run.t * (c.gpus + policy.spares)                           # GPU-seconds of the grid and its spares
    losses = {k: v * c.gpus / total for k, v in run.wall.items()}
    losses["spares_idle"] = run.t * policy.spares / total
    by_class = {fc.name: {"faults": s["faults"], "lost": s["seconds"] * c.gpus / total}
                for fc, s in zip(profile.classes, per_class) if s["faults"]}
    return Outcome(c.gpus, policy, run.t, run.useful * c.gpus / total, losses, by_class, len(fault_steps),
                   run.steps, fault_steps)
