"""A job's incident log: what went wrong and what the job did about it, in order. Training records blow-ups rolled
back, workers lost and recovered from, resizes and checkpoint writes that failed; serving records lost workers,
relaunches, resizes, guard trips and failed iterations, each stamped with the iteration it happened at. `k3ray
incidents` (`--serve`), the metrics and the status read the list. A training job also appends each incident to
`fault_tolerance.incidents_file` (JSON lines), where the user reads it after a stop; an incident updated later (its
outcome, its seconds) is written again: the last line wins."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("k3ray.controller")


class IncidentLog(list):
    """list[dict] of incidents, each {"time", "kind", ...stamp(), ...fields}."""

    def __init__(self, path: str = "", stamp: Callable[[], dict] = dict):
        """path: the incidents file ("" for none: serving, and tests of the controller alone); stamp: fields every
        incident gets when recorded (serving's: the iteration it happened at)."""
        super().__init__()
        self.path, self.stamp = path, stamp

    def record(self, kind: str, **fields) -> dict:
        """A new incident, in the list now; returned for updates (`write` puts it in the file once complete)."""
        incident = {"time": time.time(), "kind": kind, **self.stamp(), **fields}
        self.append(incident)
        return incident

    def add(self, kind: str, **fields) -> dict:
        """A complete incident: recorded and written at once; returned."""
        incident = self.record(kind, **fields)
        self.write(incident)
        return incident

    def write(self, incident: dict) -> None:
        """Append `incident` to the file (again, after an update: the last line wins)."""
        if not self.path:
            return
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(incident, default=str) + "\n")
        except OSError as err:
            log.warning("incident not written to %s: %s", self.path, err)

    def where(self) -> str:
        """Where the user finds the incidents, for the one line a stopping job prints."""
        return f"Incidents: {self.path}" if self.path else "Incidents: `k3ray incidents` while the job runs"
