"""What the serving engine did: the iterations' counters (`ServingStats`, counted by the iteration loop), which the
engine's parts share by reference; what happened to it goes into the incident log (k3ray.jobs.incidents)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = ("schedule", "grid", "worker", "complete", "wake")


@dataclass
class ServingStats:
    """iterations and tokens_out since `started`; phase_s: where the iterations' time went (seconds, summed):
    scheduling, waiting for the grid (of which the workers' own time in the step: `worker`), completing (tokens to
    text, stops, guards) and waking the streams."""
    iterations: int = 0
    tokens_out: int = 0
    started: float = field(default_factory=time.time)
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

