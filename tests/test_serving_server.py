"""`k3ray serve` end to end: a durable checkpoint trained on pp=1 x ep=2 is served on pp=2 x ep=2 (resharded on
load) behind Ray Serve, and spoken to with the real `openai` client.

- 16 concurrent greedy requests of mixed lengths (completions and chat, streaming and not) return the same tokens as
  the single-process reference generation from the same checkpoint (float64: batching, the pipeline hand-offs,
  data-parallel request placement and the EP exchange with MoonEP must not change a token);
- seeded sampling gives the same text alone and under concurrent load;
- bad input gets a 4xx naming the field, and the server keeps serving;
- past the queue limit requests get 429 with Retry-After; clients that disconnect free their pages;
- a request whose activations blow up fails alone, with an error naming the guard, and is an incident;
- every route but /health needs the API key (401 in the OpenAI error shape without it); a non-loopback host needs a
  key or --insecure;
- while the grid recovers from a lost worker /health answers 503 with the reason, then 200 again."""
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
import ray

from k3ray.control.cli import main
from k3ray.control.local_nodes import free_port
from k3ray.serve.app import start_serving, stop_serving
from k3ray.serve.metrics import SERVE_SPECS, ServeMetrics
from k3ray.data import EOS, chat_prompt, decode, encode
from k3ray.model.sampling import SamplingParams, visible_ids
from k3ray.tokenizer import load_tokenizer

PROMPTS = ["def ", "import sys\n", "class A:\n    def f(self", "x", "for k, v in d.items():\n", "return ",
           "# -*- coding: utf-8 -*-\n\"\"\"Support for ", "if not path:\n    raise ValueError(", "@classmethod\n",
           "try:\n    pass\nexcept", "s = ", "    while i < n:\n        i += 1\n        if i % 7 == 0:\n",
           "print(", "with lock:\n", "from . import "]
CHAT = [("user", "write a loop")]
METRICS_JOB = "serve-test"
SERVE_RETRY_AFTER = 2
API_KEY = "k3ray-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVE = {"page_size": 4, "pages_per_rank": 96, "slots_per_rank": 6, "token_budget": 24, "max_waiting": 8,
         "max_tokens": 64, "retry_after_s": SERVE_RETRY_AFTER}


@pytest.fixture(scope="module")
def server(serving_checkpoint):
    port = free_port()
    serving = start_serving(serving_checkpoint, pp=2, ep=2, port=port, serve_overrides=SERVE, front_doors=2,
                            observers=[ServeMetrics(METRICS_JOB, expert_load_every=5)], api_key=API_KEY)
    url = serving.url
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    try:
        yield serving
    finally:
        stop_serving(serving)


@pytest.fixture(scope="module")
def reference(serving_reference):
    def generate(prompt: str, **params) -> tuple[str, str]:
        sp = SamplingParams(**params)
        out, reason = serving_reference(encode(prompt), sp)
        return decode(visible_ids(out, sp, EOS)), reason

    return generate


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


async def complete(api: openai.AsyncOpenAI, model: str, prompt: str, stream: bool, **kw) -> tuple[str, str]:
    if not stream:
        r = await api.completions.create(model=model, prompt=prompt, **kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await api.completions.create(model=model, prompt=prompt, stream=True, **kw):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


async def chat(api: openai.AsyncOpenAI, model: str, stream: bool, **kw) -> tuple[str, str]:
    messages = [{"role": r, "content": c} for r, c in CHAT]
    if not stream:
        r = await api.chat.completions.create(model=model, messages=messages, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await api.chat.completions.create(model=model, messages=messages, stream=True, **kw):
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_openai_client_greedy_equals_reference(server, reference):
    engine, info, url = server.engine, server.info, server.url
    model = info["model"]
    max_tokens = [2 + (5 * i) % 17 for i in range(len(PROMPTS))]
    want = [reference(p, max_tokens=n) for p, n in zip(PROMPTS, max_tokens)]
    want_chat = reference(chat_prompt(CHAT), max_tokens=12, stop=load_tokenizer("bytes").chat_stop)

    async def everything():
        api = client(url)
        calls = [complete(api, model, p, i % 2 == 0, max_tokens=n, temperature=0)
                 for i, (p, n) in enumerate(zip(PROMPTS, max_tokens))]
        calls += [chat(api, model, s, max_tokens=12, temperature=0) for s in (False, True)]
        return await asyncio.gather(*calls)

    got = asyncio.run(everything())
    assert len(got) >= 16
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} ({PROMPTS[i]!r}, stream={i % 2 == 0})"
    assert got[-2] == got[-1] == want_chat
    stats = ray.get(engine.stats.remote())
    assert stats["pages_used"] == 0 and stats["running"] == 0
    assert stats["iterations"] < sum(n for n in max_tokens)  # requests shared iterations
    assert all(n > 0 for n in stats["tokens_per_rank"])  # both data-parallel ranks served requests
    paths = stats["worker_paths"]  # the workers' time by how they ran the iterations: on a CPU, eagerly
    assert set(paths) <= {"prompt eager", "decode eager", "prompt eager, saves inside rows"} and "prompt eager" in paths
    assert sum(p["iterations"] for p in paths.values()) == stats["iterations"]
    assert sum(p["seconds"] for p in paths.values()) == pytest.approx(stats["phase_seconds"]["worker"])


def test_seeded_sampling_same_text_alone_and_under_load(server, reference):
    info, url = server.info, server.url
    kw = {"max_tokens": 10, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    want = reference("import ", **{k: v for k, v in kw.items()})

    async def run(n_others: int):
        api = client(url)
        others = [complete(api, info["model"], p, True, max_tokens=6, temperature=1.0, seed=i)
                  for i, p in enumerate(PROMPTS[:n_others])]
        return (await asyncio.gather(complete(api, info["model"], "import ", False, **kw), *others))[0]

    assert asyncio.run(run(0)) == want
    assert asyncio.run(run(5)) == want


def test_bad_input_gets_a_4xx_naming_the_field(server):
    info, url = server.info, server.url
    model = info["model"]
    cases = [
        (b'{"model": "tiny", "prompt": "x",', 400, "body"),
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "body"),
        (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "model"),
        (json.dumps({"model": model, "prompt": "x", "max_tokens": -3}).encode(), 400, "max_tokens"),
        (json.dumps({"model": model, "prompt": "x" * 200}).encode(), 400, "prompt"),
        (json.dumps({"model": model, "prompt": "x", "max_tokens": 1000}).encode(), 400, "max_tokens"),
        (json.dumps({"model": model, "prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"model": model}).encode(), 400, "prompt"),
    ]
    with httpx.Client(base_url=url, timeout=60, headers=AUTH) as http:
        for body, status, param in cases:
            r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and param in err["message"], (body, err)
        r = http.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "robot", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
        assert http.get("/v1/models").json()["data"][0]["id"] == model
        ok = http.post("/v1/completions", json={"model": model, "prompt": "def ", "max_tokens": 2})
        # served after the bad ones: two tokens, or fewer where the untrained model ended its text (greedy over
        # near-ties that the placement other tests left may break either way)
        body = ok.json() if ok.status_code == 200 else {}
        assert body, ok.text
        n, finish = body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]
        assert (n, finish) == (2, "length") or (n < 2 and finish == "stop"), body


def test_overload_answers_429_and_disconnects_free_pages(server):
    engine, info, url = server.engine, server.info, server.url
    body = {"model": info["model"], "prompt": "def ", "max_tokens": 60, "stream": True}
    before = ray.get(engine.stats.remote())["tokens_out"]

    async def flood():
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=AUTH) as http:
            async def one():
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        return r.status_code, r.headers.get("retry-after"), await r.aread()
                    async for _ in r.aiter_lines():  # one event, then hang up
                        break
                    return 200, None, b""
            return await asyncio.gather(*(one() for _ in range(40)))

    results = asyncio.run(flood())
    refused = [r for r in results if r[0] == 429]
    assert refused and all(r[1] == str(SERVE_RETRY_AFTER) for r in refused)
    assert all(json.loads(r[2])["error"]["code"] == "overloaded" for r in refused)
    accepted = sum(r[0] == 200 for r in results)
    assert accepted >= 12  # two ranks x 6 slots ran, a few waited
    deadline = time.time() + 60
    while time.time() < deadline:
        stats = ray.get(engine.stats.remote())
        if stats["running"] == stats["waiting"] == stats["pages_used"] == 0:
            break
        time.sleep(0.5)
    assert stats["running"] == stats["waiting"] == stats["pages_used"] == 0, stats
    assert stats["tokens_out"] - before < accepted * body["max_tokens"] // 2  # hung-up requests stopped early


def test_a_request_that_blows_up_fails_alone_and_is_an_incident(server, reference, tmp_path):
    """A drill makes the embedding of one byte NaN: the requests holding it fail with an error naming the guard
    (streaming and not), the requests around them return the reference's text, and `k3ray incidents --serve` lists
    the blow-ups."""
    engine, info, url = server.engine, server.info, server.url
    model = info["model"]
    poison = "`"
    others = [p for p in PROMPTS if poison not in p][:6]
    want = [reference(p, max_tokens=8) for p in others]
    assert all(poison not in text for text, _ in want)
    ray.get(engine.drill.remote("nan_token", token=ord(poison)))

    async def run():
        api = client(url)
        calls = [complete(api, model, f"x = {poison}ls{poison}\n", stream, max_tokens=8, temperature=0)
                 for stream in (True, False)]
        calls += [complete(api, model, p, i % 2 == 0, max_tokens=8, temperature=0) for i, p in enumerate(others)]
        return await asyncio.gather(*calls, return_exceptions=True)

    try:
        got = asyncio.run(run())
    finally:
        ray.get(engine.drill.remote("clear"))
    for bad in got[:2]:
        assert isinstance(bad, openai.APIError) and "blew up" in str(bad), bad
    assert got[2:] == want
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        key_file = tmp_path / "key"
        key_file.write_text(API_KEY + "\n")
        assert main(["incidents", "--serve", url, "--json", "--api-key-file", str(key_file)]) == 0
    blowups = [i for i in json.loads(out.getvalue()) if i["kind"] == "blowup"]
    assert len(blowups) == 2 and all(i["rule"] == "activation" and i["detail"] == "not finite" for i in blowups)


def test_serving_metrics_are_exported(ray_cluster, server, monkeypatch):
    """Every ray_k3ray_serve_* metric reaches Ray's Prometheus export with samples from the requests above (the
    per-expert load histogram from the workers' counts), and `k3ray status --serve` shows the serving view."""
    url = server.url
    want = {f"ray_{name}" + ("_bucket" if kind == "histogram" else "") for name, (kind, _, _) in SERVE_SPECS.items()}
    deadline, seen, ttft = time.time() + 90, set(), 0.0

    def ttft_count(text: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith("ray_k3ray_serve_ttft_seconds_count")
                 and METRICS_JOB in line]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    # Ray exports what the engine records every few seconds: the first export may hold only part of the requests
    while time.time() < deadline and not (want <= seen and ttft >= 16):
        text = httpx.get(f"http://127.0.0.1:{ray_cluster.metrics_port}/metrics", timeout=10).text
        seen = {line.split("{")[0] for line in text.splitlines() if f'k3ray_job="{METRICS_JOB}"' in line}
        ttft = ttft_count(text)
        time.sleep(2)
    assert want <= seen, f"missing: {sorted(want - seen)}"
    assert ttft >= 16
    monkeypatch.setenv("K3RAY_API_KEY", API_KEY)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", "--serve", url]) == 0
    assert "requests   running=" in out.getvalue() and "pp=2 ep=2" in out.getvalue()


def test_every_route_but_health_needs_the_api_key(server, monkeypatch, capsys):
    info, url = server.info, server.url
    body = {"model": info["model"], "prompt": "def ", "max_tokens": 2}
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/openapi.json").status_code == http.get("/docs").status_code == 404
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            for method, path in (("GET", "/v1/models"), ("GET", "/v1/stats"), ("GET", "/v1/incidents"),
                                 ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                 ("GET", "/v1/placement"), ("GET", "/v1/policies"), ("PUT", "/v1/policies/moonep"),
                                 ("GET", "/v1/audit")):
                r = http.request(method, path, headers=headers, json=body)
                assert r.status_code == 401, (headers, path, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert "API key" in err["message"]
    wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=info["model"], prompt="def ", max_tokens=2)
    monkeypatch.delenv("K3RAY_API_KEY", raising=False)
    assert main(["status", "--serve", url]) != 0
    assert "needs an API key" in capsys.readouterr().err


def test_a_public_host_needs_a_key_or_insecure(tmp_path, monkeypatch, capsys):
    """Refused before anything starts: one line naming what to pass."""
    monkeypatch.delenv("K3RAY_API_KEY", raising=False)
    assert main(["serve", "--checkpoint", str(tmp_path), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--api-key-file" in err and "--insecure" in err
    empty = tmp_path / "key"
    empty.write_text("\n")
    assert main(["serve", "--checkpoint", str(tmp_path), "--host", "0.0.0.0", "--api-key-file", str(empty)]) == 2
    assert "empty" in capsys.readouterr().err


def test_policies_and_placement_of_a_serving_job_from_the_cli(server, monkeypatch, capsys):
    """`k3ray policy set|get`, `placement`, `audit` and `scale` with --serve: a bad value is one line naming the field
    (exit 2, nothing changes); turning the replication policy on makes the engine place read-only copies of hot experts
    while requests run, shown with the load and balancedness."""
    info, url = server.info, server.url
    monkeypatch.setenv("K3RAY_API_KEY", API_KEY)
    with httpx.Client(base_url=url, timeout=60, headers=AUTH) as http:
        assert http.put("/v1/policies/replication", content=b"[1]",
                        headers={"Content-Type": "application/json"}).status_code == 400
        assert http.put("/v1/policies/moonep", content=b'{"enabled": false}',
                        headers={"Content-Type": "text/plain"}).status_code == 415
        assert http.put("/v1/policies/nope", json={"enabled": True}).status_code == 404
    capsys.readouterr()
    assert main(["policy", "set", "replication", "spare_slots_per_rank=-1", "--serve", url]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "replication.spare_slots_per_rank" in err, err
    assert main(["policy", "set", "replication", "enabled=true", "every_n_steps=2", "spare_slots_per_rank=2",
                 "--serve", url]) == 0
    assert "replication: enabled=True every_n_steps=2" in capsys.readouterr().out
    assert main(["scale", "--ep", "3", "--serve", url]) == 2  # refused before anything changes
    assert "ep=3 does not divide model.n_experts=16" in capsys.readouterr().err
    assert main(["policy", "get", "replication", "--serve", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spare_slots_per_rank"] == 2
    body = {"model": info["model"], "prompt": "for i in range(", "max_tokens": 24}
    deadline, view = time.time() + 120, {}
    try:
        with httpx.Client(base_url=url, timeout=60, headers=AUTH) as http:
            while time.time() < deadline and not view.get("moves"):
                assert http.post("/v1/completions", json=body).status_code == 200
                assert main(["placement", "--serve", url, "--json"]) == 0
                view = json.loads(capsys.readouterr().out)
        assert view["moves"] and view["expert_load"] is not None and len(view["copies"]) == 2
        assert main(["placement", "--serve", url]) == 0
        text = capsys.readouterr().out
        assert "home experts" in text and "balancedness" in text and "decision -> switch" in text
        assert main(["audit", "--serve", url, "--json"]) == 0
        audit = json.loads(capsys.readouterr().out)
        assert audit[-1]["policy"] == "replication" and audit[-1]["applied"]
    finally:
        assert main(["policy", "set", "replication", "enabled=false", "--serve", url]) == 0


def test_a_front_door_that_dies_is_started_again_and_the_other_serves_meanwhile(server):
    """Two front doors share the port; one killed, requests still get answers (from the other, or from the new one
    once `keep_doors` has started it)."""
    victim = server.doors[0]
    pid = ray.get(victim.__ray_call__.remote(lambda door: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    deadline = time.time() + 30
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:  # gone, its socket with it
        time.sleep(0.1)
    ok = 0
    for _ in range(6):  # new connections: the kernel hands them to a live listener
        with httpx.Client(timeout=30) as http:
            ok += http.get(f"{server.url}/health").status_code == 200
    assert ok == 6
    assert server.keep_doors() == 1 and server.doors[0] is not victim
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_health_is_503_with_the_reason_while_the_grid_recovers(server):
    """Last in this module: the lost worker leaves the grid on pp=2 x ep=1 (rebuilt in place around the surviving
    column, each phase a second late: slow_recovery, so that the polls see the recovery under way)."""
    engine, info, url = server.engine, server.info, server.url
    seen = []
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        ray.get(engine.drill.remote("slow_recovery", seconds=1.0))
        ray.get(engine.drill.remote("kill_worker", [3]))
        api = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        done = []
        threading.Thread(target=lambda: done.append(api.completions.create(
            model=info["model"], prompt="def ", max_tokens=4, temperature=0)), daemon=True).start()
        deadline = time.time() + 120
        while time.time() < deadline and (not seen or seen[-1][0] != 200 or not done):
            r = http.get("/health")
            seen.append((r.status_code, r.json(), r.headers.get("retry-after")))
            time.sleep(0.05)
    down = [s for s in seen if s[0] == 503]
    assert down and seen[-1][0] == 200, seen[-5:]
    assert "recovering from lost world ranks [3]" in down[0][1]["reason"] and down[0][2] == str(SERVE_RETRY_AFTER)
    assert done and done[0].usage.completion_tokens == 4
    lost = [i for i in ray.get(engine.incident_log.remote()) if i["kind"] == "worker_lost"]
    assert lost[-1]["ranks"] == [3] and lost[-1]["ep"] == [2, 1]

