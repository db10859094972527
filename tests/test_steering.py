"""One steering API for training and serving: the control API (over a controller) and a front door (over an engine
actor) serve the same steering routes, refuse a request without the token with the same 401 body, and answer
/health and /healthz alike. Both apps run in-process over stand-ins for the controller and the engine (no Ray)."""
from __future__ import annotations

import pickle

import pytest
from fastapi.testclient import TestClient

from k3ray.config import PoliciesConfig
from k3ray.control.api import build_app as control_app
from k3ray.jobs.live_policies import LivePolicies
from k3ray.serve.front_door import build_app as front_door_app
from k3ray.steering.protocol import Refused

KEY = "steering-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
STEERING = [("GET", "/v1/status"), ("GET", "/v1/stats"), ("GET", "/v1/placement"), ("GET", "/v1/policies"),
            ("GET", "/v1/policies/moonep"), ("PUT", "/v1/policies/moonep"), ("GET", "/v1/audit"),
            ("POST", "/v1/scale"), ("GET", "/v1/incidents")]
OWN = {"training": [("POST", "/v1/checkpoints")],
       "serving": [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")]}
BODIES = {"/v1/policies/moonep": {"enabled": False}, "/v1/scale": {"ep": 1}}

class Controller:
    """What the control API calls on the training controller."""

    def __init__(self):
        self.live, self.incidents, self.scale_to = LivePolicies(PoliciesConfig()), [{"rule": "loss_spike"}], None

    def status(self) -> dict:
        return {"name": "job", "state": "running", "step": 7, "loss": float("nan"), "pp": 1, "ep": 2, "workers": 2,
                "device": "cpu", "transitions": []}

    def placement(self) -> dict:
        return {"experts_of_ep_rank": {"0": [0, 1], "1": [2, 3]}, "rank_load": {}}

    def get_policies(self, name=None) -> dict:
        return self.live.get(name)

    def set_policy(self, name, params, source) -> dict:
        return self.live.set(name, params, source, 7)

    def audit_log(self) -> list:
        return self.live.audit_log()

    def request_scale(self, ep) -> dict:
        if ep > 2:
            raise ValueError(f"ep: must be a whole number from 1 to parallel.ep=2, got {ep}")
        self.scale_to = ep
        return {"ep": [2, ep], "applies_at_step": 7}

    def get_incidents(self) -> list:
        return list(self.incidents)

    def request_checkpoint(self) -> dict:
        return {"requested": True, "at_step": 7}


class Engine:
    """What a front door calls on the serving engine actor, as `engine.method.remote(...)` awaitables."""

    def __init__(self):
        self.live, self.down = LivePolicies(PoliciesConfig()), None

    def __getattr__(self, name):
        method = getattr(EngineMethods, name)

        class Remote:
            @staticmethod
            async def remote(*args):
                return method(self, *args)
        return Remote

    @property
    def info(self) -> dict:
        return {"model": "tiny", "step": 3, "pp": 1, "ep": 2, "max_seq_len": 64, "serve": {"max_tokens": 8},
                "tokenizer": "bytes"}


class EngineMethods:
    @staticmethod
    def health(engine) -> dict:
        if engine.down:
            return {"status": "unavailable", "reason": engine.down, "since": 1.0, "retry_after": 2}
        return {"status": "ok", "pp": 1, "ep": 2}

    @staticmethod
    def stats(engine) -> dict:
        return {"running": 0, "waiting": 0, "pp": 1, "ep": 2}

    @staticmethod
    def placement_view(engine) -> dict:
        return {"home": [0, 0, 1, 1], "copies": [[], []], "iteration": 5}

    @staticmethod
    def policies(engine, name=None) -> dict:
        return engine.live.get(name)

    @staticmethod
    def set_policy(engine, name, params, source) -> dict:
        return engine.live.set(name, params, source, 5)

    @staticmethod
    def policy_audit(engine) -> list:
        return engine.live.audit_log()

    @staticmethod
    def scale(engine, ep) -> dict:
        if ep < 1:
            raise ValueError(f"ep: must be a whole number >= 1, got {ep!r}")
        if ep == 3:
            raise Refused(409, "ep=3 does not divide model.n_experts=16")
        return {"ep": [2, ep], "action": "none"}

    @staticmethod
    def incident_log(engine) -> list:
        return [{"kind": "worker_lost"}]


@pytest.fixture
def apps():
    engine = Engine()
    training = TestClient(control_app(Controller(), KEY))
    serving = TestClient(front_door_app(engine, engine.info, KEY))
    serving.engine = engine
    return {"training": training, "serving": serving}


def test_both_apps_serve_the_same_steering_routes(apps):
    for name, app in apps.items():
        for method, path in STEERING:
            r = app.request(method, path, headers=AUTH, json=BODIES.get(path) if method != "GET" else None)
            assert r.status_code in (200, 202), (name, method, path, r.text)
        for method, path in OWN["serving" if name == "training" else "training"]:
            assert app.request(method, path, headers=AUTH).status_code in (404, 405), (name, path)
        change = app.put("/v1/policies/moonep", json={"enabled": False}, headers=AUTH).json()
        assert change["policy"] == "moonep" and change["value"]["enabled"] is False
        assert app.get("/v1/policies/moonep", headers=AUTH).json()["enabled"] is False
        audit = app.get("/v1/audit", headers=AUTH).json()
        assert audit[-1]["params"] == {"enabled": False} and audit[-1]["source"].startswith("api:")
        r = app.put("/v1/policies/nosuch", json={"enabled": True}, headers=AUTH)
        assert r.status_code == 404 and r.json()["detail"].startswith("unknown policy 'nosuch'; policies: moonep")
        assert app.get("/v1/policies/nosuch", headers=AUTH).status_code == 404
    assert apps["training"].get("/v1/status", headers=AUTH).json()["loss"] is None  # NaN: JSON-safe
    assert apps["serving"].get("/v1/status", headers=AUTH).json()["model"] == "tiny"


def test_a_bad_body_names_the_field_on_both_apps(apps):
    """Training answers 422 (its spec says so), serving 400; the message is the same."""
    for name, status in (("training", 422), ("serving", 400)):
        app = apps[name]
        r = app.put("/v1/policies/moonep", json={"slots_per_rank": 0}, headers=AUTH)
        assert r.status_code == status and r.json()["detail"].startswith("moonep.slots_per_rank: "), r.text
        r = app.put("/v1/policies/replication", content=b"[1]", headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == status and r.json()["detail"].startswith("replication: "), r.text
        r = app.put("/v1/policies/moonep", json={}, headers=AUTH)
        assert r.status_code == status and r.json()["detail"] == "moonep: give at least one field to change"
        r = app.post("/v1/scale", json={"ep": "two"}, headers=AUTH)
        assert r.status_code == status and r.json()["detail"].startswith("ep: "), r.text


def test_scale_is_queued_on_training_and_done_on_serving(apps):
    r = apps["training"].post("/v1/scale", json={"ep": 1}, headers=AUTH)
    assert r.status_code == 202 and r.json() == {"ep": [2, 1], "applies_at_step": 7}
    r = apps["training"].post("/v1/scale", json={"ep": 5}, headers=AUTH)
    assert r.status_code == 422 and r.json()["detail"].startswith("ep: must be a whole number from 1")
    r = apps["serving"].post("/v1/scale", json={"ep": 1}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"ep": [2, 1], "action": "none"}
    r = apps["serving"].post("/v1/scale", json={"ep": 3}, headers=AUTH)
    assert r.status_code == 409 and r.json()["detail"] == "ep=3 does not divide model.n_experts=16"
    r = apps["serving"].post("/v1/scale", json={"ep": 0}, headers=AUTH)  # a bad value: serving's 400, as a bad body
    assert r.status_code == 400 and r.json()["detail"] == "ep: must be a whole number >= 1, got 0"


def test_a_refusal_crosses_processes_whole():
    """The serving engine's refusals reach the front door pickled (Ray): status, message and code kept."""
    err = pickle.loads(pickle.dumps(Refused(409, "ep=3 does not divide model.n_experts=16", "too_big")))
    assert (err.status, err.message, err.code) == (409, "ep=3 does not divide model.n_experts=16", "too_big")


def test_write_routes_take_json_bodies_only_on_both_apps(apps):
    """A body not declared JSON is refused before it is read (415, the OpenAI error shape beside `detail`), even one
    that would parse as JSON; a route that needs no body takes none."""
    writes = [("PUT", "/v1/policies/moonep"), ("PUT", "/v1/policies/nosuch"), ("POST", "/v1/scale")]
    for name, app in apps.items():
        for method, path in writes + [("POST", "/v1/checkpoints")] * (name == "training"):
            for media in ("text/plain", "application/x-www-form-urlencoded", None):
                headers = AUTH if media is None else {**AUTH, "Content-Type": media}
                r = app.request(method, path, headers=headers, content=b'{"enabled": false, "ep": 1}')
                assert r.status_code == 415, (name, method, path, media, r.text)
                err = r.json()["error"]
                assert err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
                assert err["message"] == r.json()["detail"] and "application/json" in err["message"]
        assert app.get("/v1/policies/moonep", headers=AUTH).json()["enabled"] is True  # nothing changed
        r = app.put("/v1/policies/moonep", json={"enabled": False}, headers=AUTH)
        assert r.status_code == 200, r.text
        r = app.put("/v1/policies/moonep", content=b'{"enabled": true}',
                    headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text
    assert apps["training"].post("/v1/checkpoints", headers=AUTH).status_code == 202  # no body


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": "Bearer "}])
def test_a_request_without_the_token_gets_the_same_401_on_both_apps(apps, headers):
    bodies = []
    for name, app in apps.items():
        for method, path in STEERING + OWN[name]:
            r = app.request(method, path, headers=headers, content=b"{not json")
            assert r.status_code == 401, (method, path, r.text)  # the token is checked before the body is read
            assert r.headers["www-authenticate"] == "Bearer"
            bodies.append(r.json())
    assert all(body == bodies[0] for body in bodies)
    err = bodies[0]["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert err["message"] == bodies[0]["detail"] and "API key" in err["message"]
    assert err["message"].startswith("invalid API key" if "wrong" in str(headers) else "no API key given")


def test_health_and_healthz_answer_alike_without_the_token(apps):
    for app in apps.values():
        ok = [app.get(path) for path in ("/health", "/healthz")]
        assert [r.status_code for r in ok] == [200, 200] and ok[0].json() == ok[1].json()
        assert ok[0].json()["status"] == "ok"
    apps["serving"].engine.down = "recovering from lost world ranks [3]"
    down = [apps["serving"].get(path) for path in ("/health", "/healthz")]
    for r in down:
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["reason"] == "recovering from lost world ranks [3]" and r.json()["model"] == "tiny"


def test_an_open_front_door_needs_no_token():
    engine = Engine()
    app = TestClient(front_door_app(engine, engine.info, None))
    assert app.get("/v1/status").status_code == 200
    assert app.get("/v1/models").json()["data"][0]["id"] == "tiny"
