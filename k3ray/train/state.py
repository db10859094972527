"""The job's states and the only transitions allowed between them.

Every change of state goes through `StateMachine.to`, which checks `TRANSITIONS`, logs the change with its reason
and keeps it in `history` (the status view, the metrics and the dashboards read it from there).

    initializing -> scheduling -> running <-> recovering      (a rollback, or a lost worker replaced)
                                  running <-> resizing        (growing back to the configured size)
                     resizing, recovering -> recovering       (a worker lost while growing back or recovering)
    any live state -> errored (the job cannot go on) | finished (stopped)

Recovering and resizing are bounded handlers: `HANDLERS` gives each its attempt limit (from the job's
fault_tolerance config). Entering a handler state from itself is its next attempt; one attempt too many raises
AttemptsExhausted instead of the transition, and the caller stops the job (errored). Between attempts the handler
waits `backoff_s()` (doubling, capped).
"""
from __future__ import annotations

import enum
import logging
import time

from k3ray.policies import retry

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


# the handler states, bounded: each entry into one from itself is another attempt (see HANDLERS)
BOUNDED = (S.RECOVERING, S.RESIZING)


class IllegalTransition(RuntimeError):
    """A transition that TRANSITIONS does not allow: a bug in the controller, never a user error."""


class AttemptsExhausted(RuntimeError):
    """A bounded handler (recovering, resizing) asked for one attempt more than its limit."""


class StateMachine:
    def __init__(self, attempts: dict[JobState, int] | None = None, backoff_s: float = 0.0,
                 max_backoff_s: float = retry.MAX_BACKOFF_S) -> None:
        """attempts: the attempt limit of each bounded handler state (BOUNDED; unlimited where not given)."""
        self.state = JobState.INITIALIZING
        self.history: list[tuple[float, str, str]] = []  # (time, new state, why)
        self.limits = dict(attempts or {})
        self.base_backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.attempt = 0  # attempts of the bounded handler the machine is in (0 outside them)

    def to(self, new: JobState, why: str = "") -> None:
        if new not in TRANSITIONS[self.state]:
            allowed = ", ".join(s.value for s in TRANSITIONS[self.state]) or "none"
            raise IllegalTransition(f"{self.state.value} -> {new.value} ({why}) is not allowed; from "
                                    f"{self.state.value}: {allowed}")
        attempt = self.attempt + 1 if new in BOUNDED and new == self.state else 1 if new in BOUNDED else 0
        limit = self.limits.get(new)
        if limit is not None and attempt > limit:
            raise AttemptsExhausted(f"{new.value}: {limit} attempts failed (last: {why})")
        if new in BOUNDED and self.state in BOUNDED and new != self.state:
            attempt = 1  # a loss while resizing starts the recovery's own count
        self.attempt = attempt
        log.info("state %s -> %s %s", self.state.value, new.value, why)
        self.history.append((time.time(), new.value, why if attempt <= 1 else f"attempt {attempt}: {why}"))
        self.state = new

    def backoff_s(self) -> float:
        """How long the bounded handler waits before its next attempt: doubling from the base, capped."""
        return retry.backoff_s(self.attempt, self.base_backoff_s, self.max_backoff_s)

    @property
    def done(self) -> bool:
        return not TRANSITIONS[self.state]
