"""The job's states and the only transitions allowed between them.

Every change of state goes through `StateMachine.to`, which checks `TRANSITIONS`, logs the change with its reason
and keeps it in `history` (the status view, the metrics and the dashboards read it from there).

    initializing -> scheduling -> running <-> recovering      (a rollback, or a lost worker replaced)
                                  running <-> resizing        (growing back to the configured size)
                     resizing, recovering -> recovering       (a worker lost while growing back or recovering)
    any live state -> errored (the job cannot go on) | finished (stopped)
"""
from __future__ import annotations

import enum
import logging
import time

log = logging.getLogger("k3ray.controller")


class JobState(str, enum.Enum):
    INITIALIZING = "initializing"
    SCHEDULING = "scheduling"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESIZING = "resizing"
    FINISHED = "finished"
    ERRORED = "errored"


S = JobState
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.INITIALIZING: frozenset({S.SCHEDULING, S.ERRORED, S.FINISHED}),
    S.SCHEDULING: frozenset({S.RUNNING, S.ERRORED, S.FINISHED}),
    S.RUNNING: frozenset({S.RECOVERING, S.RESIZING, S.ERRORED, S.FINISHED}),
    S.RECOVERING: frozenset({S.RUNNING, S.RECOVERING, S.ERRORED, S.FINISHED}),
    S.RESIZING: frozenset({S.RUNNING, S.RECOVERING, S.ERRORED, S.FINISHED}),
    S.FINISHED: frozenset(),
    S.ERRORED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A transition that TRANSITIONS does not allow: a bug in the controller, never a user error."""


class StateMachine:
    def __init__(self) -> None:
        self.state = JobState.INITIALIZING
        self.history: list[tuple[float, str, str]] = []  # (time, new state, why)

    def to(self, new: JobState, why: str = "") -> None:
        if new not in TRANSITIONS[self.state]:
            allowed = ", ".join(s.value for s in TRANSITIONS[self.state]) or "none"
            raise IllegalTransition(f"{self.state.value} -> {new.value} ({why}) is not allowed; from "
                                    f"{self.state.value}: {allowed}")
        log.info("state %s -> %s %s", self.state.value, new.value, why)
        self.history.append((time.time(), new.value, why))
        self.state = new

    @property
    def done(self) -> bool:
        return not TRANSITIONS[self.state]
