"""The OpenAI API's agent-facing fields against the tiny model (float64, barely trained), with the real `openai`
client: tool calls in K3's format (a round trip call -> tool result -> answer, streaming and not), tool_choice
'required' and a named function enforced by the grammar, json_schema outputs that validate, logprobs equal to the
log-softmax of the model's logits, n choices, logit_bias, max_completion_tokens, content parts; and, without Ray,
the request shapes, the tool-call parser and the grammar's errors, and tool calls with a K3-style tokenizer
(benchmarks/k3_style_tokenizer.py: the markers are special tokens, the chat template its own) end to end."""
from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import sys

import httpx
import jsonschema
import openai
import pytest
import torch

from conftest import REPO, SMALL_BATCH, run_job
from fakes.serving import SERVE as FAKE_SERVE
from fakes.serving import FakeGrid, sizes
from k3ray.config import load_config
from k3ray.control.local_nodes import free_port
from k3ray.model.decoder import build_stage
from k3ray.serve import openai_schema as oa
from k3ray.serve.app import start_serving, stop_serving
from k3ray.serve.drills import reference_model
from k3ray.serve.engine import Engine
from k3ray.serve.front_door import build_app, prompt_ids
from k3ray.model.sampling import SamplingParams
from k3ray.serve.grammar import GrammarError, Grammars, RequestLogits, request_grammar, tokenizer_info
from k3ray.serve.tool_calls import (ARGUMENT_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, ToolCallParser,
                                    merge, parse, render_calls)
from k3ray.tokenizer import load_tokenizer

SERVE = {"page_size": 8, "pages_per_rank": 200, "slots_per_rank": 8, "token_budget": 64, "max_waiting": 64,
         "max_tokens": 300}
WORD = {"type": "string", "pattern": "^[a-z]{1,8}$"}  # bounded: an untrained model's output ends
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "required": ["city", "unit"],
                                                           "properties": {"city": WORD, "unit": {
                                                               "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"]}}}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"name": WORD, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": WORD, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5,
                                                                                  "maximum": 5},
                                                                            "y": {"type": "boolean"}},
                                            "required": ["x", "y"]}}, "required": ["p"]},
    {"type": "object", "properties": {"v": {"type": "null"}}, "required": ["v"]},
    {"type": "object", "properties": {"k": {"const": "fixed"}}, "required": ["k"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[0-9]{3}-[A-Z]{2}$"}}, "required": ["id"]},
    {"type": "object", "properties": {"choice": {"anyOf": [{"type": "boolean"}, {"enum": ["yes", "no"]}]}},
     "required": ["choice"]},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, 2, 3]}}, "required": ["a", "b"]},
    {"type": "object", "properties": {"grid": {"type": "array", "items": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 1}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}},
     "required": ["grid"]},
    {"type": "object", "properties": {"level": {"type": "string", "enum": ["low", "mid", "high"]},
                                      "score": {"type": "integer", "minimum": 1, "maximum": 10}},
     "required": ["level", "score"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": WORD, "admin": {
        "type": "boolean"}}, "required": ["name", "admin"]}}, "required": ["user"]},
    {"type": "object", "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
     "required": ["flags"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                                      "n": {"type": "integer", "minimum": 100, "maximum": 999}},
     "required": ["code", "n"]},
    {"type": "object", "properties": {"x": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 3},
                                                      {"type": "null"}]}}, "required": ["x"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["id"]}, "maxItems": 2}},
     "required": ["items"]},
    {"type": "object", "properties": {"lang": {"enum": ["py", "rs", "go"]}, "stars": {"type": "integer",
                                                                                    "minimum": 0, "maximum": 5}},
     "required": ["lang"]},
    {"type": "object", "properties": {"when": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["when"]},
]
MESSAGES = [{"role": "system", "content": "use the tools"}, {"role": "user", "content": "weather in paris?"}]


# -- without Ray ------------------------------------------------------------------------------------------------------
def test_tool_call_parser_streams_what_it_parses_whole():
    calls = [{"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}},
             {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time",
                                                                              "arguments": '{"zone": 1}'}}]
    text = "let me look <|" + render_calls(calls)
    assert parse(text) == ("let me look <|", calls)
    parser, content, deltas = ToolCallParser(), "", []
    for ch in text:  # a character at a time: markers split anywhere
        c, d = parser.push(ch)
        content, deltas = content + c, deltas + d
    c, d = parser.push("", final=True)
    assert content + c == "let me look <|" and merge(deltas + d) == calls
    assert parse("no calls <|tool") == ("no calls <|tool", [])


def test_request_shapes_parts_tool_turns_and_errors():
    tok = load_tokenizer("bytes")
    body = {"model": "m", "user": "u1", "metadata": {"k": "v"}, "max_completion_tokens": 7, "tools": [WEATHER],
            "messages": [*MESSAGES[:1], {"role": "user", "content": [{"type": "text", "text": "weather "},
                                                                      {"type": "text", "text": "in paris?"}]},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "functions.get_weather:0", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]},
                         {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]}
    req = oa.ChatRequest.model_validate(body)
    assert req.wanted_tokens == 7 and req.calls_tools
    ids, stop = prompt_ids(tok, req, chat=True)
    text = bytes(ids).decode()
    assert text.startswith("### system\nuse the tools\n### tools\n[{\"type\": \"function\"")
    assert ("### user\nweather in paris?\n### assistant\n<|tool_calls_section_begin|><|tool_call_begin|>"
            "functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"paris\"}<|tool_call_end|>"
            "<|tool_calls_section_end|>\n### tool\n## Return of functions.get_weather:0\nsunny\n"
            "### assistant\n") in text
    bad = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
           {"messages": [{"role": "tool", "content": "x"}]},
           {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                     "function": {"name": "nope"}}},
           {"messages": MESSAGES, "tool_choice": "required"},
           {"messages": MESSAGES, "top_logprobs": 2}]
    for extra in bad:
        with pytest.raises(ValueError):
            oa.ChatRequest.model_validate({"model": "m", **extra})


def test_grammar_errors_name_the_field_and_slow_compiles_are_refused():
    with pytest.raises(GrammarError) as err:
        request_grammar({"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}, None, None, True)
    assert err.value.param == "response_format.json_schema" and "wat" in str(err.value)
    grammar = request_grammar({"type": "json_schema", "json_schema": {"schema": SCHEMAS[2]}}, None, None, True)
    with pytest.raises(GrammarError, match="did not compile within"):
        asyncio.run(Grammars(load_tokenizer("bytes"), 1e-9).compile(grammar))


class InProcessEngine:
    """The engine actor's handle as a front door calls it (`engine.method.remote(...)`, awaited or not, and the
    streaming `subscribe`), over an `Engine` in this process and event loop (submit, cancel and subscribe: its
    `subscribers`', as the ServingEngine actor's are)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def __getattr__(self, name):
        method = getattr(self.engine, name, None) or getattr(self.engine.subscribers, name)

        def done(value):
            future = asyncio.get_running_loop().create_future()
            future.set_result(value)
            return future

        async def refs(*args):
            async for item in method(*args):
                yield done(item)

        class Remote:
            @staticmethod
            def options(**_):
                return Remote

            @staticmethod
            def remote(*args):
                if inspect.isasyncgenfunction(method):
                    return refs(*args)
                if inspect.iscoroutinefunction(method):
                    return asyncio.ensure_future(method(*args))
                return done(method(*args))
        return Remote


def test_chat_needs_no_xgrammar_and_a_grammar_without_it_is_a_readable_501(monkeypatch):
    """A server where xgrammar is not installed (the GPU image): chat completions, streamed or not, with logprobs or
    not, are served (every chat request used to import xgrammar and got a bare 500, as did logprobs in the engine);
    response_format and tool_choice 'required' get a 501 naming the field; an error nothing answers (here raised in
    the engine) is a 500 naming it in one line. The front door's app over the engine in this process, no Ray."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ModuleNotFoundError
    cfg = load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 1, "model.max_seq_len": 512,
                                            **{f"serve.{k}": v for k, v in FAKE_SERVE.items()}})
    torch.manual_seed(0)
    engine = Engine(cfg, 0, FakeGrid(build_stage(cfg.model, range(cfg.model.n_layers), seed=3), sizes(cfg)))
    app = build_app(InProcessEngine(engine), engine.ready())
    chat = {"model": cfg.name, "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 4,
            "temperature": 0}

    async def main():
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://door", timeout=60) as http:
            whole = await http.post("/v1/chat/completions", json=chat)
            assert whole.status_code == 200, whole.text
            assert whole.json()["usage"]["completion_tokens"] > 0
            streamed = await http.post("/v1/chat/completions", json={**chat, "stream": True})
            assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
            logprobs = await http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 2})
            assert logprobs.status_code == 200, logprobs.text
            assert len(logprobs.json()["choices"][0]["logprobs"]["content"]) > 0
            schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}}
            for extra, param in [({"response_format": schema}, "response_format"),
                                 ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice")]:
                for stream in (False, True):
                    r = await http.post("/v1/chat/completions", json={**chat, **extra, "stream": stream})
                    err = r.json()["error"]
                    assert r.status_code == 501 and err["param"] == param, r.text
                    assert err["message"].startswith(f"{param}: ") and "xgrammar" in err["message"], err
                    assert "\n" not in err["message"]

            async def broken(*args):
                raise RuntimeError("the grid is on fire\n  and a traceback follows")
            engine.submit = broken
            r = await http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 500, r.text
            assert r.json()["error"]["message"] == "internal error: RuntimeError: the grid is on fire", r.text

    asyncio.run(main())


# -- a K3-style tokenizer: markers as special tokens, its own chat template (no Ray) --------------------------------
MARKERS = (SECTION_BEGIN, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END, SECTION_END)


@pytest.fixture(scope="module")
def k3_tokenizer(tmp_path_factory) -> str:
    """benchmarks/k3_style_tokenizer.py's tokenizer, 512 tokens trained on two of k3ray's files (~0.1 s)."""
    spec = importlib.util.spec_from_file_location("k3_style_tokenizer", REPO / "benchmarks" / "k3_style_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    folder = tmp_path_factory.mktemp("k3tok")
    texts = script.corpus_texts([str(REPO / "k3ray" / "serve" / f) for f in ("tool_calls.py", "grammar.py")])
    assert script.build(folder, 512, texts) == 512
    return str(folder)


def test_k3_style_template_renders_tools_calls_and_results_around_one_token_markers(k3_tokenizer):
    """Each marker is one token, which xgrammar reads as the marker's text (a grammar spelling it matches the
    token); the tokenizer's own template declares the tools and renders the calls and results (the byte template's
    words, Kimi K2's turns); jump-forward forces a call's opening as two marker tokens, and where the grammar's next
    text is a marker cut short (after a call, `<|tool_call` starts both the next call and the section's end) leaves
    it to sample rather than spelling it out."""
    tok = load_tokenizer(k3_tokenizer)
    info = tokenizer_info(tok)
    one = {m: tok.encode(m) for m in (*MARKERS, "<|im_end|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                                      "<|im_middle|>")}
    assert all(len(ids) == 1 and info.decoded_vocab[ids[0]] == m.encode() for m, ids in one.items()), one
    assert tok.vocab_size == 512 and tok.eos_id == one["<|im_end|>"][0] and tok.chat_stop == ()
    calls = [{"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]
    req = oa.ChatRequest.model_validate({"model": "m", "tools": [WEATHER], "messages": [
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]})
    ids, stop = prompt_ids(tok, req, chat=True)
    text = tok.decode(ids)
    head = "<|im_system|>tool_declare<|im_middle|>"
    assert text.startswith(head) and stop == ()
    assert json.loads(text[len(head):text.index("<|im_end|>")]) == req.tool_dicts()
    assert text.endswith("<|im_system|>system<|im_middle|>use the tools<|im_end|><|im_user|>user<|im_middle|>"
                         f"weather in paris?<|im_end|><|im_assistant|>assistant<|im_middle|>{render_calls(calls)}"
                         "<|im_end|><|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny"
                         "<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert [ids.count(one[m][0]) for m in MARKERS] == [1] * len(MARKERS)

    grammar = request_grammar(None, [WEATHER, TIME], "required", True)
    logits = RequestLogits(SamplingParams(max_tokens=100, grammar=grammar),
                           asyncio.run(Grammars(tok, 30).compile(grammar)))
    logits.jump_forward()
    out = logits.forced(tok, 100)
    assert out[:2] == one[SECTION_BEGIN] + one[CALL_BEGIN]  # with bytes: 47 tokens, 61 with "functions.get_"
    assert tok.decode(out) == f"{SECTION_BEGIN}{CALL_BEGIN}functions.get_"
    call = f'{SECTION_BEGIN}{CALL_BEGIN}functions.get_time:0{ARGUMENT_BEGIN}{{"zone": 1}}{CALL_END}'
    while len(tok.decode(out)) < len(call):  # the rest of one call: forced, else "sampled" from the call's tokens
        forced = logits.forced(tok, 100)
        if not forced:
            forced = tok.encode(call[len(tok.decode(out)):])[:1]
            logits.accept(forced[0])
        out += forced
    assert tok.decode(out) == call and out[-1] == one[CALL_END][0] and logits.matcher is not None
    assert logits.forced(tok, 100) == []  # not `<|tool_call` spelled out: the next marker is sampled whole


class Outputs:
    """An engine observer keeping each finished request's (prompt ids, output ids), in the order they finished."""
    expert_load_every = 10**9

    def __init__(self):
        self.done: list[tuple[list[int], list[int]]] = []

    def iteration(self, changed: list, sched, seconds: float) -> None:
        self.done += [(list(r.prompt), list(r.out)) for r in changed if r.done]

    def expert_load(self, *_) -> None:
        pass


def test_tool_calls_with_one_token_markers_and_the_tokenizers_own_template(k3_tokenizer, one_thread):
    """The tiny model (float64, seeded, untrained) with a K3-style tokenizer, served by the front door's app over
    the engine in this process (no Ray) to the `openai` client: tool_choice 'required' gives a well-formed call,
    whole and streamed (the id and name first); the call's markers are one token each (its opening, before the
    function's name, is 2 marker tokens and "functions.", where bytes take 57); a round trip (call -> tool result
    -> answer) renders through the tokenizer's own template, the markers again one token each."""
    tok = load_tokenizer(k3_tokenizer)
    ids = {m: tok.encode(m)[0] for m in MARKERS}
    cfg = load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 1, "model.max_seq_len": 1024,
                                            "model.dtype": "float64", "model.vocab_size": tok.vocab_size,
                                            "data.tokenizer": k3_tokenizer,
                                            **{f"serve.{k}": v for k, v in SERVE.items()}})
    outputs = Outputs()
    engine = Engine(cfg, 0, FakeGrid(build_stage(cfg.model, range(cfg.model.n_layers), seed=3), sizes(cfg)),
                    [outputs])
    app = build_app(InProcessEngine(engine), engine.ready())
    ask = dict(messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
               temperature=0, max_tokens=80)

    async def go():
        client = openai.AsyncOpenAI(base_url="http://door/v1", api_key="none", max_retries=0, http_client=
                                    httpx.AsyncClient(transport=httpx.ASGITransport(app), timeout=120))
        whole = await client.chat.completions.create(model=cfg.name, **ask)
        assert whole.choices[0].finish_reason == "tool_calls", whole.choices[0]
        prompt, out = outputs.done[-1]
        deltas = []
        async for chunk in await client.chat.completions.create(model=cfg.name, stream=True, **ask):
            deltas += [d.model_dump(exclude_none=True) for d in chunk.choices[0].delta.tool_calls or ()]
        calls = [c.model_dump() for c in whole.choices[0].message.tool_calls]
        turn = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21"}]
        answer = await client.chat.completions.create(model=cfg.name, messages=turn, tools=[WEATHER, TIME],
                                                      tool_choice="none", temperature=0, max_tokens=6)
        return whole, prompt, out, deltas, answer, outputs.done[-1][0]

    whole, prompt, out, deltas, answer, turn_prompt = asyncio.run(go())
    (call,) = calls = [c.model_dump() for c in whole.choices[0].message.tool_calls]
    name = call["function"]["name"]
    tool = {"get_weather": WEATHER, "get_time": TIME}[name]
    jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
    assert call["id"] == f"functions.{name}:0" and whole.usage.prompt_tokens == len(prompt)
    assert deltas[0]["id"] == call["id"] and deltas[0]["function"]["name"] == name and merge(deltas) == calls
    text = tok.decode(out)
    assert [out.count(ids[m]) for m in MARKERS] == [text.count(m) for m in MARKERS] == [1] * len(MARKERS)
    assert out[:2] == [ids[SECTION_BEGIN], ids[CALL_BEGIN]] and out[-1] == tok.eos_id
    before_name = next(n for n in range(len(out)) if tok.decode(out[:n]).endswith("functions."))
    assert before_name == 2 + len(tok.encode("functions.")) <= 5  # bytes: 57
    assert answer.choices[0].finish_reason in ("stop", "length") and isinstance(answer.choices[0].message.content,
                                                                                str)
    assert [turn_prompt.count(ids[m]) for m in MARKERS] == [1] * len(MARKERS)
    assert f"## Return of {call['id']}\nsunny, 21<|im_end|>" in tok.decode(turn_prompt)


# -- against the served tiny model ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(ray_cluster, tmp_path_factory) -> str:
    """The tiny model in float64 after one step, with a context of 1024 tokens: K3's tool-call markers alone take
    ~150 byte tokens (the session's serving checkpoint has 128)."""
    root = tmp_path_factory.mktemp("serve-openai") / "ckpt"
    cfg = load_config("configs/tiny.yaml", {"train.eval_every": 0, "model.dtype": "float64", "parallel.pp": 1,
                                            "parallel.ep": 1, "model.max_seq_len": 1024, "checkpoint.dir": str(root),
                                            "checkpoint.every_n_steps": 1, **SMALL_BATCH})
    run_job(cfg, 1)
    return str(root)


@pytest.fixture(scope="module")
def server(checkpoint):
    serving = start_serving(checkpoint, pp=1, ep=1, port=free_port(), serve_overrides=SERVE)
    try:
        yield serving
    finally:
        stop_serving(serving)


def api(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                              http_client=httpx.AsyncClient(timeout=300))


async def _chat(client, model, stream: bool, **kw):
    """(content, tool_calls as dicts, finish) of one choice, streamed or not."""
    if not stream:
        r = await client.chat.completions.create(model=model, **kw)
        m = r.choices[0].message
        return m.content, [c.model_dump() for c in m.tool_calls or ()], r.choices[0].finish_reason
    content, deltas, finish = "", [], None
    async for chunk in await client.chat.completions.create(model=model, stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        deltas += [d.model_dump(exclude_none=True) for d in delta.tool_calls or ()]
        finish = chunk.choices[0].finish_reason or finish
    return content or (None if deltas else content), merge(deltas), finish


def test_a_shared_system_prompt_reports_cached_tokens_and_changes_no_text(server):
    """The prefix cache through the HTTP path: a second chat with the same long system prompt reports the prompt
    tokens it reused (usage.prompt_tokens_details.cached_tokens, streamed usage too) and the same greedy reply; the
    engine's status shows the hit rate and the bytes held."""
    model = server.info["model"]
    system = {"role": "system", "content": "You answer in one short line and never use tools. " * 3}
    ask = {"role": "user", "content": "weather in paris?"}

    async def go():
        client = api(server)
        first = await client.chat.completions.create(model=model, messages=[system, ask], max_tokens=6,
                                                     temperature=0)
        second = await client.chat.completions.create(model=model, messages=[system, ask], max_tokens=6,
                                                      temperature=0)
        chunks = [c async for c in await client.chat.completions.create(
            model=model, messages=[system, {"role": "user", "content": "and rome?"}], max_tokens=4, temperature=0,
            stream=True, stream_options={"include_usage": True})]
        done = await client.completions.create(model=model, prompt=system["content"], max_tokens=2, temperature=0)
        return first, second, chunks[-1].usage, done.usage

    first, second, streamed, completion = asyncio.run(go())
    assert second.choices[0].message.content == first.choices[0].message.content
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the same prompt: as far as its deepest boundary (the first saved the state there); another user turn: the
    # boundary where the first's first prompt chunk (128 tokens, the CPU's token budget) ended
    assert cached == 192 < second.usage.prompt_tokens
    assert streamed.prompt_tokens_details.cached_tokens == 128
    assert completion.prompt_tokens_details.cached_tokens == 0  # another rendering: no shared first block
    status = httpx.get(f"{server.url}/v1/status", timeout=30).json()
    prefix = status["prefix_cache"]
    assert prefix["hit_rate"] > 0 and prefix["cached_bytes"] > 0 and prefix["state_bytes_per_token"] > 0


def test_tool_call_round_trip_streaming_and_not(server):
    model = server.info["model"]

    async def go():
        client = api(server)
        got = {}
        for stream in (False, True):
            content, calls, finish = await _chat(client, model, stream, messages=MESSAGES, tools=[WEATHER, TIME],
                                                 tool_choice="required", temperature=0, max_tokens=200)
            assert finish == "tool_calls" and calls, (content, calls)
            for call in calls:
                tool = {"get_weather": WEATHER, "get_time": TIME}[call["function"]["name"]]
                jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
                assert call["id"].startswith(f"functions.{call['function']['name']}:")
            turn = [*MESSAGES, {"role": "assistant", "content": content, "tool_calls": calls},
                    *({"role": "tool", "tool_call_id": c["id"], "content": "sunny, 21"} for c in calls)]
            answer, _, why = await _chat(client, model, stream, messages=turn, tools=[WEATHER, TIME],
                                         tool_choice="none", temperature=0, max_tokens=12)
            assert why in ("stop", "length") and isinstance(answer, str)
            got[stream] = (calls, answer)
        assert got[False] == got[True]  # greedy: the stream carries what the whole response holds

    asyncio.run(go())


def test_required_and_named_tool_choice_always_give_a_call(server):
    model = server.info["model"]
    choices = ["required", {"type": "function", "function": {"name": "get_time"}}]

    async def one(client, i):
        choice = choices[i % 2]
        _, calls, finish = await _chat(client, model, False, messages=MESSAGES, tools=[WEATHER, TIME],
                                       tool_choice=choice, temperature=1.0, seed=i, max_tokens=300,
                                       parallel_tool_calls=False)
        assert finish == "tool_calls" and len(calls) == 1, calls
        name = calls[0]["function"]["name"]
        assert name == "get_time" if i % 2 else name in ("get_weather", "get_time")
        tool = {"get_weather": WEATHER, "get_time": TIME}[name]
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), tool["function"]["parameters"])

    async def go():
        client = api(server)
        await asyncio.gather(*(one(client, i) for i in range(8)))

    asyncio.run(go())


def test_json_schema_outputs_validate(server):
    model = server.info["model"]

    async def one(client, i, schema):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "json please"}],
                                                 response_format=fmt, temperature=1.0, seed=i, max_tokens=160)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)

    async def go():
        client = api(server)
        await asyncio.gather(*(one(client, i, s) for i, s in enumerate(SCHEMAS)))
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=model, messages=MESSAGES, response_format={
                "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "wat"}}})
        assert err.value.body["param"] == "response_format.json_schema"

    asyncio.run(go())


def test_logprobs_are_the_log_softmax_of_the_model_logits(server, checkpoint):
    model_name, tok = server.info["model"], load_tokenizer("bytes")

    async def go():
        client = api(server)
        r = await client.completions.create(model=model_name, prompt="def f(", max_tokens=6, temperature=0,
                                            logprobs=3)
        s = [c async for c in await client.completions.create(model=model_name, prompt="def f(", max_tokens=6,
                                                              temperature=0, logprobs=3, stream=True)]
        c = await client.chat.completions.create(model=model_name, messages=MESSAGES[1:], max_tokens=4,
                                                 temperature=0.7, seed=5, logprobs=True, top_logprobs=2)
        g = await client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "def f("}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
        return r, s, c, g

    whole, chunks, chat, greedy = asyncio.run(go())
    lp = whole.choices[0].logprobs
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-9) and len(lp.tokens) == whole.usage.completion_tokens
    # keyed by token text: byte tokens that are part of a character share "\ufffd"
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    model = reference_model(checkpoint)
    def chat_ids(messages):
        return prompt_ids(tok, oa.ChatRequest.model_validate({"model": "m", "messages": messages}), True)[0]

    for prompt, content in ((chat_ids([{"role": "user", "content": "def f("}]), greedy.choices[0].logprobs.content),
                            (chat_ids(MESSAGES[1:]), chat.choices[0].logprobs.content)):
        out = [e.bytes[0] for e in content]  # byte tokens: each token's one byte
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([prompt + out]))[0, len(prompt) - 1:-1].double(), -1)
        for i, entry in enumerate(content):
            assert abs(entry.logprob - logp[i, out[i]].item()) < 1e-9
            top = logp[i].topk(len(entry.top_logprobs))
            assert [t.bytes[0] for t in entry.top_logprobs] == top.indices.tolist()
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-9)


def test_n_choices_bias_limits_and_content_parts(server):
    model = server.info["model"]

    async def go():
        client = api(server)
        r = await client.chat.completions.create(model=model, messages=MESSAGES, n=4, temperature=1.0, seed=3,
                                                 max_completion_tokens=5)
        assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens <= 20
        assert len({c.message.content for c in r.choices}) > 1  # each choice its own seed
        finishes = {}
        async for chunk in await client.completions.create(model=model, prompt="x", n=4, max_tokens=3,
                                                           temperature=1.0, stream=True):
            for c in chunk.choices:
                finishes[c.index] = c.finish_reason or finishes.get(c.index)
        assert sorted(finishes) == [0, 1, 2, 3] and all(finishes.values())
        biased = await client.completions.create(model=model, prompt="x", max_tokens=6, temperature=0,
                                                 logit_bias={str(ord("Q")): 100}, frequency_penalty=1.0,
                                                 presence_penalty=0.5)
        assert biased.choices[0].text == "QQQQQQ"
        parts = [{"role": "user", "content": [{"type": "text", "text": "weather "}, {"type": "text",
                                                                                     "text": "in paris?"}]}]
        a = await client.chat.completions.create(model=model, messages=parts, max_tokens=6, temperature=0,
                                                 user="u", metadata={"k": "v"})
        b = await client.chat.completions.create(model=model, messages=MESSAGES[1:], max_tokens=6, temperature=0)
        assert a.choices[0].message.content == b.choices[0].message.content

    asyncio.run(go())


def test_a_shared_prompt_still_hits_after_other_prompts_filled_the_cache(server):
    """Run after the tool-call, grammar and n tests filled the cache with prompts whose first block (the chat
    template's opening) is this one's: a new shared system prompt is cached and hits as the first one did (its
    cached blocks are never left without their first one)."""
    model = server.info["model"]
    system = {"role": "system", "content": "Answer in French, in one short line, and never call a tool. " * 3}
    ask = {"role": "user", "content": "weather in lyon?"}

    async def go():
        client = api(server)
        await client.chat.completions.create(model=model, messages=[system, ask], max_tokens=4, temperature=0)
        return await client.chat.completions.create(model=model, messages=[system, ask], max_tokens=4, temperature=0)

    assert asyncio.run(go()).usage.prompt_tokens_details.cached_tokens > 0
