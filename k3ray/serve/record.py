"""What the serving engine did and what happened to it: the iterations' counters (`ServingStats`, counted by the
iteration loop) and the incident log (`IncidentLog`: lost workers, relaunches, resizes, guard trips, failed
iterations), which the engine's parts share by reference."""
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


class IncidentLog:
    """The engine's incidents, oldest first, each stamped with its time and the iteration it happened at (the front
    door's /v1/incidents, `k3ray incidents --serve`)."""

    def __init__(self, stats: ServingStats):
        self.stats = stats
        self.entries: list[dict] = []

    def record(self, kind: str, **fields) -> dict:
        """Append an incident; returns it (a recovery fills in its phases as they end)."""
        incident = {"time": time.time(), "kind": kind, "iteration": self.stats.iterations, **fields}
        self.entries.append(incident)
        return incident

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> dict:
        return self.entries[i]
