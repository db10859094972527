"""What a live job answers to its steering API: the training controller and the serving engine each implement
`Steering` (through an adapter beside their app), and `k3ray.steering.router` serves any implementation.

Every method is a coroutine returning JSON-ready values. A request the job refuses raises, with a one-line reason
naming what is wrong: KeyError (an unknown name: 404) or ValueError (a bad value, the field named: the app's
`invalid_status`, training 422 and serving 400), as the live policies and training's resize request raise them, or
`Refused` with its HTTP status (409 a size the grid cannot take, 415 a body that is not JSON, 500 a resize that
failed). The router maps them to answers in one place (k3ray.steering.router `refusals`), for both jobs alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class Refused(Exception):
    """The job refused a request: answered as `error_body(message, status, code)` with `status`."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def __reduce__(self):
        # raised in the serving engine's actor, it crosses to the front door pickled: rebuilt from all three
        return type(self), (self.status, self.message, self.code)


def error_body(message: str, status: int, code: str | None = None) -> dict[str, Any]:
    """The error body of both apps: FastAPI's `detail` (the control CLI reads it) and the OpenAI error shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"detail": message, "error": {"message": message, "type": kind, "param": None, "code": code}}


@dataclass
class Health:
    """A job's health: `body` answered with `status` (200 while it serves; 503 with the reason while it cannot)."""
    body: dict[str, Any]
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


class Steering(Protocol):
    async def health(self) -> Health:
        """Whether the job serves (GET /health, /healthz); never needs the token."""

    async def status(self) -> dict[str, Any]:
        """The job at a glance (GET /v1/status): training its step and loss, serving its requests and pages."""

    async def placement(self) -> dict[str, Any]:
        """Experts on ranks and their load (GET /v1/placement)."""

    async def policies(self, name: str | None = None) -> dict[str, Any]:
        """The live policies, or one of them (GET /v1/policies[/NAME]); KeyError for an unknown name."""

    async def set_policy(self, name: str, params: dict[str, Any], source: str) -> dict[str, Any]:
        """Queue a change of one policy for the next step or iteration, audited with `source`: {'policy', 'value',
        'applies_at_step'} (PUT /v1/policies/NAME). `params` has passed the policy's update model; KeyError for an
        unknown policy, ValueError naming the field for a bad value."""

    async def audit(self) -> list[dict[str, Any]]:
        """Every policy change: what, when, from where, when it applied (GET /v1/audit)."""

    async def scale(self, ep: int) -> dict[str, Any]:
        """Resize the grid's EP dimension (POST /v1/scale); ValueError for a bad ep, Refused for one the grid cannot
        take or a resize that failed."""

    async def incidents(self) -> list[dict[str, Any]]:
        """The incident log (GET /v1/incidents)."""
