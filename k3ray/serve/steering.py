"""The serving engine as a `Steering` implementation (k3ray.steering.protocol), for the front door's steering routes:
each method asks the engine actor. What the engine raises comes back as itself, out of Ray's wrapping: a refusal
(KeyError, ValueError, Refused) is answered by the router as training's are (k3ray.steering.router `refusals`)."""
from __future__ import annotations

from typing import Any

import ray

from k3ray.serve import openai_schema as oa
from k3ray.steering.protocol import Health


class EngineSteering:
    def __init__(self, engine, info: dict):
        self.engine, self.info = engine, info

    async def _ask(self, method: str, *args) -> Any:
        try:
            return await getattr(self.engine, method).remote(*args)
        except ray.exceptions.RayTaskError as err:  # its message is the actor's traceback: the cause's is the reason
            raise err.cause from None

    async def health(self) -> Health:
        """200 while a grid serves; 503 with the reason while the engine is gone or recovers its grid."""
        model = self.info["model"]
        try:
            state = await self.engine.health.remote()
        except ray.exceptions.RayError as err:
            return Health(oa.error(f"engine unavailable: {type(err).__name__}", "server_error"), 503)
        if state["status"] != "ok":
            return Health({**state, "model": model}, 503, {"Retry-After": str(state["retry_after"])})
        return Health({"status": "ok", "model": model})

    async def status(self) -> dict[str, Any]:
        """The serving view (`k3ray status --serve URL`): requests, pages, tokens generated."""
        info = {k: self.info[k] for k in ("model", "step", "pp", "ep")}
        return {**info, **(await self._ask("stats"))}

    async def placement(self) -> dict[str, Any]:
        """Per-expert load, copies, balancedness, moves (`k3ray placement --serve URL`)."""
        return await self._ask("placement_view")

    async def policies(self, name: str | None = None) -> dict[str, Any]:
        return await self._ask("policies", name)

    async def set_policy(self, name: str, params: dict[str, Any], source: str) -> dict[str, Any]:
        """Applied at the next iteration; ValueError naming the field for a bad value, KeyError for an unknown
        policy."""
        return await self._ask("set_policy", name, params, source)

    async def audit(self) -> list[dict[str, Any]]:
        return await self._ask("policy_audit")

    async def scale(self, ep: int) -> dict[str, Any]:
        """Done before the answer, no request dropped; Refused(409) where the grid cannot take that size."""
        return await self._ask("scale", ep)

    async def incidents(self) -> list[dict[str, Any]]:
        """Lost workers, requests stopped by the guards (`k3ray incidents --serve URL`)."""
        return await self._ask("incident_log")
