"""The job's control API: the steering app (k3ray.steering.router) over the training controller, plus POST
/v1/checkpoints, served by uvicorn in a daemon thread of the Controller actor's process, started and stopped by
`ApiCallback` (a controller callback).

`ControllerSteering` adapts the controller object (same process) to the `Steering` protocol; its calls run in worker
threads, beside the step loop. Bearer-token auth on everything but /health and /healthz: the token is generated per
job and written to a 0600 file; a 0600 `control.json` beside it ({"url", "token_file", "job"}) is how `k3ray status
--job NAME` finds the job. Policy updates are validated by the policies' update models and queued for the next step
boundary.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any, Optional

import uvicorn
from fastapi import Depends, FastAPI
from pydantic import BaseModel

from k3ray.steering.auth import BearerAuth, new_token, write_private
from k3ray.steering.protocol import Health
from k3ray.steering.router import NOT_JSON, ErrorBody, json_bodies, steering_app
from k3ray.train.callbacks import Callback

log = logging.getLogger("k3ray.api")


class Topology(BaseModel):
    pp: int
    ep: int
    workers: int
    device: str


class Status(BaseModel):
    job: str
    state: str
    step: int
    loss: Optional[float]
    tokens_per_s: Optional[float]
    topology: Topology
    api_url: Optional[str]
    transitions: list[dict[str, Any]]


class ControllerSteering:
    """The training controller as a `Steering` implementation: its refusals (KeyError, ValueError) are the router's
    to answer (k3ray.steering.router `refusals`)."""

    def __init__(self, ctrl):
        self.ctrl = ctrl

    async def _call(self, method: str, *args) -> Any:
        return await asyncio.to_thread(getattr(self.ctrl, method), *args)

    async def health(self) -> Health:
        return Health({"status": "ok"})

    async def status(self) -> dict[str, Any]:
        s = await self._call("status")
        return {"job": s["name"], "state": s["state"], "step": s["step"], "loss": s["loss"],
                "tokens_per_s": s.get("tokens_per_s"), "api_url": s.get("api_url"),
                "topology": {k: s[k] for k in ("pp", "ep", "workers", "device")}, "transitions": s["transitions"]}

    async def placement(self) -> dict[str, Any]:
        return await self._call("placement")

    async def policies(self, name: str | None = None) -> dict[str, Any]:
        return await self._call("get_policies", name)

    async def set_policy(self, name: str, params: dict[str, Any], source: str) -> dict[str, Any]:
        return await self._call("set_policy", name, params, source)

    async def audit(self) -> list[dict[str, Any]]:
        return await self._call("audit_log")

    async def scale(self, ep: int) -> dict[str, Any]:
        return await self._call("request_scale", ep)

    async def incidents(self) -> list[dict[str, Any]]:
        return await self._call("get_incidents")

    async def checkpoint(self) -> dict[str, Any]:
        """A durable checkpoint at the next step boundary (written asynchronously, committed one step later)."""
        return await self._call("request_checkpoint")


def build_app(ctrl, token: str) -> FastAPI:
    """The app for one job; `ctrl` is the Controller object."""
    steering, auth = ControllerSteering(ctrl), BearerAuth(token)
    app = steering_app(steering, auth, "k3ray control API", status_model=Status,
                       description="Live view and steering of one k3ray training job. Changes apply at the next step "
                                   "boundary and are audited.")
    app.add_api_route("/v1/checkpoints", steering.checkpoint, methods=["POST"], status_code=202,
                      dependencies=[Depends(auth), Depends(json_bodies)], response_model=dict[str, Any],
                      responses={401: {"model": ErrorBody, "description": "missing or wrong token"}, **NOT_JSON})
    return app


class ApiServer:
    """uvicorn in a daemon thread, on a socket bound before start so port 0 yields a known free port."""

    def __init__(self, app: FastAPI, host: str, port: int):
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted sockets inherit it: without, a response written in two parts waits ~40 ms on delayed ACKs
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.sock.bind((host, port))
        except OSError as err:
            self.sock.close()
            raise OSError(err.errno, f"api.host={host} api.port={port}: cannot listen there ({err.strerror}); "
                                     f"pick another port or 0 for a free one") from None
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="k3ray-api", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"control API did not start on {self.url} within {timeout_s:g}s")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()


def start_control_api(ctrl) -> tuple[ApiServer, dict]:
    """Generate the token, serve the API, write the token and control.json (both 0600). Returns the server and the
    control record {"url", "token_file", "job"}."""
    cfg = ctrl.cfg
    token_file = Path(cfg.api.token_file or Path("runs") / cfg.name / "api_token").absolute()
    token = new_token()
    write_private(token_file, token + "\n")
    server = ApiServer(build_app(ctrl, token), cfg.api.host, cfg.api.port)
    server.start()
    record = {"url": server.url, "token_file": str(token_file), "job": cfg.name}
    write_private(token_file.parent / "control.json", json.dumps(record) + "\n")
    log.info("control API for job %s at %s (token in %s)", cfg.name, server.url, token_file)
    return server, record


class ApiCallback(Callback):
    """Serves the control API while the job runs (when `api.enabled`)."""

    def __init__(self):
        self.server: ApiServer | None = None
        self.url: str | None = None

    def on_start(self, ctrl) -> None:
        if ctrl.cfg.api.enabled:
            self.server, record = start_control_api(ctrl)
            self.url = record["url"]

    def on_shutdown(self, ctrl) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def status(self) -> dict:
        return {"api_url": self.url}
