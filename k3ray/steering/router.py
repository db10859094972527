"""The steering routes of any `Steering` implementation, one app factory for training's control API and serving's
front door alike.

Routes: GET /health and /healthz (the same answer, no token), and behind the token: GET /v1/status (alias /v1/stats),
/v1/placement, /v1/policies[/NAME], PUT /v1/policies/NAME, GET /v1/audit, POST /v1/scale ({"ep": N}), GET
/v1/incidents. Bodies are read and validated here, after the token is checked, so a client without it learns nothing,
not even a 422. A write route (PUT, POST) takes a body declared JSON (Content-Type: application/json) or none, else
415 (`json_bodies`), whatever the body would parse as. A policy change passes the policy's update model (every field
optional, unknown fields, empty bodies and non-finite numbers rejected), and a bad body is answered `invalid_status`
with "policy.field: why". Training answers 422 there (its OpenAPI spec says so); serving 400, as it answers every bad
request; a bad value the backend finds (a ValueError) is answered the same (`refusals`). Every refusal's body
carries FastAPI's `detail` and the OpenAI error shape (`error_body`).
"""
# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request) at runtime.
import math
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from k3ray.config import PoliciesConfig
from k3ray.steering.auth import BearerAuth, Unauthorized, answer_unauthorized
from k3ray.steering.protocol import Refused, Steering, error_body

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


class ErrorBody(BaseModel):
    """Every refusal's body (`error_body`): `detail` and the OpenAI error shape."""
    detail: str
    error: dict[str, Any]


NOT_JSON = {415: {"model": ErrorBody, "description": "a body not declared application/json"}}


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


def json_bodies(request: Request) -> None:
    """The dependency of the write routes (after the token's): a body must be declared JSON; none is fine (a route
    that needs one says so when it reads it)."""
    if request.method not in ("PUT", "POST", "PATCH"):
        return
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    has_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
    if media != "application/json" and (media or has_body):
        raise Refused(415, f"{request.method} {request.url.path} takes a JSON body (Content-Type: application/json), "
                           f"not {media or 'one without a Content-Type'}", code="unsupported_media_type")


def _body_schema(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


async def _validated(request: Request, model: type[BaseModel], where: str, invalid_status: int) -> dict:
    """The request's JSON body through `model`, as the fields it set; Refused naming each bad field otherwise."""
    try:
        return model.model_validate_json(await request.body()).model_dump(exclude_unset=True)
    except ValidationError as err:
        parts = [f"{'.'.join(x for x in (where, *map(str, e['loc'])) if x) or 'request'}: {e['msg']}"
                 for e in err.errors()]
        raise Refused(invalid_status, "; ".join(parts) or f"{where or 'request'}: invalid") from None


async def refusals(call, invalid_status: int) -> Any:
    """Await a steering call that may refuse the request (k3ray.steering.protocol), training's and serving's alike:
    KeyError (an unknown name) is a 404, ValueError (a bad value, named) an `invalid_status`; Refused passes as
    raised. Only the routes that take a name or a value map these: elsewhere a KeyError is a bug (a 500)."""
    try:
        return await call
    except KeyError as err:
        raise Refused(404, err.args[0]) from None
    except ValueError as err:
        raise Refused(invalid_status, str(err)) from None


def _add_policy_routes(v1: APIRouter, backend: Steering, invalid_status: int) -> None:
    """GET /v1/policies[/NAME] and PUT /v1/policies/NAME (one route per policy, its update model as the body)."""
    @v1.get("/policies")
    async def policies() -> dict[str, dict[str, Any]]:
        return finite(await backend.policies())

    @v1.get("/policies/{name}", responses={404: {"model": Error}})
    async def policy(name: str) -> dict[str, Any]:
        return finite(await refusals(backend.policies(name), invalid_status))

    def setter(name: str, body_model: type[BaseModel]):
        async def put(request: Request) -> PolicyChange:
            params = await _validated(request, body_model, name, invalid_status)
            if not params:
                raise Refused(invalid_status, f"{name}: give at least one field to change")
            source = f"api:{request.client.host}:{request.client.port}" if request.client else "api"
            return PolicyChange(**finite(await refusals(backend.set_policy(name, params, source), invalid_status)))
        put.__name__ = f"set_{name}"
        return put

    for name, model in UPDATE_MODELS.items():
        v1.add_api_route(f"/policies/{name}", setter(name, model), methods=["PUT"], response_model=PolicyChange,
                         openapi_extra=_body_schema(model),
                         responses={invalid_status: {"model": Error, "description": "a field is invalid (named)"},
                                    **NOT_JSON},
                         summary=f"update the {name} policy (applied at the next step boundary)")

    @v1.put("/policies/{name}", include_in_schema=False)
    async def unknown_policy(name: str) -> None:
        raise Refused(404, f"unknown policy {name!r}; policies: {', '.join(POLICY_MODELS)}")


def steering_router(backend: Steering, auth: BearerAuth, invalid_status: int = 422,
                    status_model: Any = dict[str, Any]) -> APIRouter:
    """The routes (module docstring) answering from `backend`; `status_model` documents GET /v1/status."""
    router = APIRouter()
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(auth), Depends(json_bodies)],
                   responses={401: {"model": ErrorBody, "description": "missing or wrong token"}})

    async def health() -> JSONResponse:
        h = await backend.health()
        return JSONResponse(finite(h.body), status_code=h.status, headers=h.headers)

    router.add_api_route("/healthz", health, methods=["GET"], tags=["health"], response_model=dict[str, Any])
    router.add_api_route("/health", health, methods=["GET"], include_in_schema=False)

    async def status() -> Any:
        return finite(await backend.status())

    v1.add_api_route("/status", status, methods=["GET"], response_model=status_model)
    v1.add_api_route("/stats", status, methods=["GET"], response_model=status_model, include_in_schema=False)

    @v1.get("/placement")
    async def placement() -> dict[str, Any]:
        return finite(await backend.placement())

    _add_policy_routes(v1, backend, invalid_status)

    @v1.post("/scale", status_code=202, openapi_extra=_body_schema(ScaleRequest),
             responses={invalid_status: {"model": Error, "description": "ep is invalid"}, **NOT_JSON})
    async def scale(request: Request) -> dict[str, Any]:
        """Resize the grid to pp x ep (`k3ray scale --ep N`): 202 with the step it applies at where the change is
        queued (training: at the next step boundary, the global batch kept), 200 where it is done (serving)."""
        body = await _validated(request, ScaleRequest, "", invalid_status)
        answer = finite(await refusals(backend.scale(body["ep"]), invalid_status))
        return answer if "applies_at_step" in answer else JSONResponse(answer, status_code=200)

    @v1.get("/incidents")
    async def incidents() -> list[dict[str, Any]]:
        return finite(await backend.incidents())

    @v1.get("/audit")
    async def audit() -> list[dict[str, Any]]:
        return finite(await backend.audit())

    router.include_router(v1)
    return router


async def _answer_refused(request: Request, err: Refused) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.status, err.code), status_code=err.status)


def steering_app(backend: Steering, auth: BearerAuth, title: str, description: str = "", docs: bool = True,
                 invalid_status: int = 422, status_model: Any = dict[str, Any]) -> FastAPI:
    """An app serving `steering_router`, with the answers for Refused and Unauthorized; its owner adds its own
    routes (guarded by `Depends(auth)`). `docs` False: no OpenAPI pages."""
    pages = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title=title, version="1", description=description, **pages)
    app.add_exception_handler(Refused, _answer_refused)
    app.add_exception_handler(Unauthorized, answer_unauthorized)
    app.include_router(steering_router(backend, auth, invalid_status, status_model))
    return app
