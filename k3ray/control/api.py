"""The job's control API: a FastAPI app served by uvicorn in a daemon thread of the Controller actor's process,
started and stopped by `ApiCallback` (a controller callback).

Handlers call the controller object directly (same process). Bearer-token auth on everything but /healthz: the
token is generated per job and written to a 0600 file; a 0600 `control.json` beside it ({"url", "token_file",
"job"}) is how `k3ray status --job NAME` finds the job. Policy updates are validated by request models derived from
the config's policy models (every field optional, unknown fields rejected) and queued for the next step boundary.
"""
from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Optional

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, create_model

from k3ray.config import PoliciesConfig
from k3ray.train.callbacks import Callback

log = logging.getLogger("k3ray.api")

POLICY_MODELS: dict[str, type[BaseModel]] = {name: f.annotation for name, f in PoliciesConfig.model_fields.items()}


def update_model(policy: type[BaseModel]) -> type[BaseModel]:
    """`policy` with every field optional (same types and constraints; an absent field is left as it is), unknown
    fields, empty bodies and non-finite numbers rejected."""
    fields = {}
    for field, info in policy.model_fields.items():
        copy = info._copy()  # keeps gt/ge/le and the description
        copy.default = None  # defaults are not validated: absent -> unchanged, explicit null -> checked as usual
        fields[field] = (info.annotation, copy)
    cfg = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra={"minProperties": 1})
    return create_model(f"{policy.__name__}Update", __config__=cfg, **fields)


UPDATE_MODELS = {name: update_model(model) for name, model in POLICY_MODELS.items()}


class Error(BaseModel):
    detail: str


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


class PolicyChange(BaseModel):
    policy: str
    value: dict[str, Any]
    applies_at_step: int


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ep: int


def finite(obj: Any) -> Any:
    """JSON-safe copy: NaN/inf floats become None (a blown-up loss must not turn into a 500)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def build_app(ctrl, token: str) -> FastAPI:
    """The app for one job; `ctrl` is the Controller object (status, placement, get_policies, set_policy, ...)."""
    bearer = HTTPBearer(auto_error=False, description="per-job token from runs/<job>/api_token")

    def token_ok(header: str | None) -> bool:
        scheme, _, credentials = (header or "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(credentials.strip().encode(), token.encode())

    def authorize(creds: Optional[HTTPAuthorizationCredentials] = Depends(bearer)) -> None:
        """Declares the scheme in OpenAPI; `require_token` below has already checked it before any parsing."""

    app = FastAPI(title="k3ray control API", version="1",
                  description="Live view and steering of one k3ray training job. Changes apply at the next step "
                              "boundary and are audited.")
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)],
                   responses={401: {"model": Error, "description": "missing or wrong token"}})

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        # before routing and body parsing: a client without the token learns nothing, not even a 422
        if request.url.path.startswith("/v1") and not token_ok(request.headers.get("authorization")):
            return JSONResponse({"detail": "missing or wrong bearer token (see the job's api_token file)"},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        policy = request.path_params.get("name") or request.url.path.rstrip("/").rsplit("/", 1)[-1]
        parts = []
        for e in err.errors():
            loc = [str(x) for x in e["loc"] if x != "body"]
            where = ".".join([policy, *loc]) if request.method == "PUT" else ".".join(loc) or "request"
            parts.append(f"{where}: {e['msg']}")
        return JSONResponse({"detail": "; ".join(parts) or "invalid request"}, status_code=422)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @v1.get("/status", response_model=Status)
    def status() -> dict:
        s = ctrl.status()
        return finite({"job": s["name"], "state": s["state"], "step": s["step"], "loss": s["loss"],
                       "tokens_per_s": s.get("tokens_per_s"), "api_url": s.get("api_url"),
                       "topology": {k: s[k] for k in ("pp", "ep", "workers", "device")},
                       "transitions": s["transitions"]})

    @v1.get("/placement")
    def placement() -> dict[str, Any]:
        return finite(ctrl.placement())

    @v1.get("/policies")
    def policies() -> dict[str, dict[str, Any]]:
        return finite(ctrl.get_policies())

    @v1.get("/policies/{name}", responses={404: {"model": Error}})
    def policy(name: str) -> dict[str, Any]:
        try:
            return finite(ctrl.get_policies(name))
        except KeyError as err:
            raise HTTPException(404, err.args[0]) from None

    def setter(name: str, body_model: type[BaseModel]):
        def put(body: body_model, request: Request) -> PolicyChange:  # type: ignore[valid-type]
            params = body.model_dump(exclude_unset=True)
            if not params:
                raise HTTPException(422, f"{name}: give at least one field to change")
            source = f"api:{request.client.host}:{request.client.port}" if request.client else "api"
            try:
                return PolicyChange(**finite(ctrl.set_policy(name, params, source)))
            except ValueError as err:
                raise HTTPException(422, str(err)) from None
        put.__name__ = f"set_{name}"
        put.__annotations__ = {"body": body_model, "request": Request, "return": PolicyChange}
        return put

    for name, model in UPDATE_MODELS.items():
        v1.add_api_route(f"/policies/{name}", setter(name, model), methods=["PUT"], response_model=PolicyChange,
                         responses={400: {"model": Error, "description": "the body is not JSON"},
                                    422: {"model": Error, "description": "a field is invalid (named in detail)"}},
                         summary=f"update the {name} policy (applied at the next step boundary)")

    @v1.put("/policies/{name}", include_in_schema=False)
    def unknown_policy(name: str) -> None:
        raise HTTPException(404, f"unknown policy {name!r}; policies: {', '.join(POLICY_MODELS)}")

    @v1.post("/checkpoints", status_code=202)
    def checkpoint() -> dict[str, Any]:
        """A durable checkpoint at the next step boundary (written asynchronously, committed one step later)."""
        return ctrl.request_checkpoint()

    @v1.post("/scale", status_code=202, responses={422: {"model": Error, "description": "ep is invalid"}})
    def scale(body: ScaleRequest) -> dict[str, Any]:
        """Resize the grid to pp x ep at the next step boundary (`k3ray scale --ep N`); the global batch is kept."""
        try:
            return ctrl.request_scale(body.ep)
        except ValueError as err:
            raise HTTPException(422, str(err)) from None

    @v1.get("/incidents")
    def incidents() -> list[dict[str, Any]]:
        return finite(ctrl.get_incidents())

    @v1.get("/audit")
    def audit() -> list[dict[str, Any]]:
        return finite(ctrl.audit_log())

    app.include_router(v1)
    return app


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` readable by the owner only (0600), creating parent directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


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
    token = secrets.token_urlsafe(32)
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
