"""What the serving engine did: the iterations' counters (`ServingStats`, counted by the iteration loop), which the
engine's parts share by reference; what happened to it goes into the incident log (k3ray.jobs.incidents). Its status
at a glance (`ServingStatus`, the engine's `stats`: /v1/status) reads them beside the scheduler and the grid."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = ("schedule", "grid", "worker", "complete", "wake")


@dataclass
class ServingStats:
    """iterations and tokens_out since `started`; phase_s: where the iterations' time went (seconds, summed):
    scheduling, waiting for the grid (of which the workers' own time in the step: `worker`), completing (tokens to
    text, stops, guards) and waking the streams; worker_paths: the workers' time by how they ran the iteration
    (k3ray.parallel.serving `step_path` -> [iterations, seconds of the slowest rank])."""
    iterations: int = 0
    tokens_out: int = 0
    started: float = field(default_factory=time.time)
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    worker_paths: dict[str, list[float]] = field(default_factory=dict)


class ServingStatus:
    """The serving view of /v1/status (`k3ray status --serve`), read from the engine's parts: the scheduler's requests
    and pages, the iterations' counters, the grid's size and standbys, and how many incidents."""

    def __init__(self, grid, sched, counts: ServingStats, incidents):
        self.grid, self.sched, self.counts, self.incidents = grid, sched, counts, incidents

    def view(self) -> dict:
        c = self.counts
        return {**self.sched.usage(), "iterations": c.iterations, "tokens_out": c.tokens_out,
                "uptime_s": time.time() - c.started, "pp": self.grid.pp, "ep": self.grid.ep,
                "incidents": len(self.incidents), "phase_seconds": dict(c.phase_s),
                "worker_paths": {k: {"iterations": int(n), "seconds": t} for k, (n, t) in c.worker_paths.items()},
                **self._standbys()}

    def _standbys(self) -> dict:
        """How many standbys the grid has (one per worker where fault_tolerance.standbys is on), how many are up."""
        group = self.grid.group
        if group is None or not group.standbys_on:
            return {"standbys": 0, "standbys_up": 0}
        return {"standbys": group.size, "standbys_up": group.resources.standbys.up_count()}
