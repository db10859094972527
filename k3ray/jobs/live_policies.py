"""The live policies of a job: changes requested through the control API (or Python) are validated at once, queued,
and applied at the next step boundary; every change is audited. Thread-safe: API handlers run beside the step loop.

Interface: `get`, `set` (from any thread), `take_pending` (at a step boundary), `audit_log`."""
from __future__ import annotations

import logging
import threading
import time

from pydantic import BaseModel, ValidationError

from k3ray.config import POLICY_NAMES, PoliciesConfig

log = logging.getLogger("k3ray.controller")


class LivePolicies:
    def __init__(self, policies: PoliciesConfig):
        self.current = policies
        self.pending: dict[str, BaseModel] = {}  # name -> validated policy, applied at the next step
        self.audit: list[dict] = []
        self.lock = threading.Lock()

    @staticmethod
    def _check(name: str) -> None:
        if name not in POLICY_NAMES:
            raise KeyError(f"unknown policy {name!r}; policies: {', '.join(POLICY_NAMES)}")

    def get(self, name: str | None = None) -> dict:
        """Live policies (with any change still waiting for the next step boundary applied on top)."""
        if name is not None:
            self._check(name)
        with self.lock:
            current = {n: getattr(self.current, n).model_dump() for n in POLICY_NAMES}
            for n, pol in self.pending.items():
                current[n] = pol.model_dump()
        return current if name is None else current[name]

    def set(self, name: str, params: dict, source: str, step: int) -> dict:
        """Validate a change to one policy and queue it for the next step boundary. Raises KeyError for an unknown
        policy and ValueError naming the field for a bad value; nothing changes then."""
        self._check(name)
        with self.lock:
            base = self.pending.get(name) or getattr(self.current, name)
            try:
                new = type(base).model_validate({**base.model_dump(), **params})
            except ValidationError as err:
                fields = "; ".join(f"{name}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
                raise ValueError(fields) from None
            self.pending[name] = new
            self.audit.append({"time": time.time(), "policy": name, "params": params, "source": source,
                               "requested_at_step": step, "applies_at_step": step, "applied": False})
        log.info("policy %s change %s from %s queued for step %d", name, params, source, step)
        return {"policy": name, "value": new.model_dump(), "applies_at_step": step}

    def take_pending(self, step: int) -> set[str]:
        """Apply the queued changes (at the boundary of `step`); the names of the policies that changed."""
        with self.lock:
            pending, self.pending = self.pending, {}
            for entry in self.audit:
                if not entry["applied"] and entry["policy"] in pending:
                    entry.update(applied=True, applies_at_step=step)
        for name, pol in pending.items():
            setattr(self.current, name, pol)
        return set(pending)

    def audit_log(self) -> list[dict]:
        with self.lock:
            return [dict(e) for e in self.audit]
