"""The front door's HTTP routes (FastAPI), one instance per front-door process (k3ray.serve.app starts
them), in front of the serving engine actor.

Routes: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent events, ending in
`data: [DONE]`), GET /v1/models, and the steering routes training jobs answer too (k3ray.steering.router over
`EngineSteering`): GET /health and /healthz, /v1/status (alias /v1/stats: the serving view), /v1/incidents,
/v1/placement (expert load, copies, balancedness), /v1/policies[/NAME], PUT /v1/policies/NAME (live policies,
applied at the next iteration), GET /v1/audit, and POST /v1/scale ({"ep": N}: the grid resized, no request dropped).

Limits, enforced here before the engine sees a request: max_tokens <= serve.max_tokens; prompt + max_tokens within
the model's context (max_seq_len); the engine's queue holds serve.max_waiting requests, beyond that 429 with
Retry-After. Bad input (malformed JSON, bytes that are not UTF-8, an unknown model, a field out of range, a prompt
longer than the context) is a 4xx whose message names the field; it never reaches the engine. A client that goes
away cancels its request (Starlette cancels the handler; the handler asks the engine to end it, which frees the
request's pages and slot). Each front door takes every request's tokens from the engine through one stream
(`EngineStreams`): one message per engine iteration for all of its requests, not one per request.

Authentication: with an API key (`--api-key-file F` or K3RAY_API_KEY) every route but /health and /healthz needs
`Authorization: Bearer <key>` (the `openai` client's api_key), else 401 with the body of k3ray.steering.auth (the
OpenAI error shape, code invalid_api_key). A server on a host other than loopback refuses to start without a key
unless told `--insecure` (`check_exposure`).

Availability: /health answers 200 while a grid serves and 503 with the reason (and Retry-After) while none does (the
engine recovers or relaunches it); a request that found no grid within serve.unavailable_wait_s gets 503 with
Retry-After.

Text: the training job's tokenizer (data.tokenizer, k3ray.tokenizer) encodes prompts; the engine returns final text
(decoded incrementally, stop strings met on the text). Chat: messages are rendered with the tokenizer's chat template
(tokenizer_config.json, jinja2, as Hugging Face does; it gets `tools` and the tool turns); for `bytes`,
"### role\\ncontent\\n" per message (tool turns in K3's format: k3ray.serve.tool_calls) with "\\n### " added to the
stop strings, so a reply ends where the next turn's header would begin.

Choices: `n` > 1 is n requests to the engine (it has no prefix sharing: each prefills the prompt), choice i seeded
with seed + i. Tool calls, logprobs and their streaming shapes: k3ray.serve.choices. Grammars (response_format,
tool_choice required or named): k3ray.serve.grammar; a schema that does not convert is a 400 naming
response_format.json_schema, one that compiles for longer than serve.grammar_compile_s a 400 naming response_format.
Only a request with a grammar imports xgrammar: a server without it serves completions and plain chat, and answers
a grammar with 501 naming the field. Whatever no route answers (a bug, an error raised in the engine actor) is a
500 whose message names the error in one line (`_internal_error`), never a bare "Internal Server Error".
"""
# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request) at runtime.

import asyncio
import dataclasses
import itertools
import json
import logging
import time
import uuid

from fastapi import Depends, FastAPI, Request
from jinja2.exceptions import TemplateError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from k3ray.serve import openai_schema as oa
from k3ray.serve.choices import Choice
from k3ray.serve.grammar import GrammarError
from k3ray.serve.steering import EngineSteering
from k3ray.steering.auth import BearerAuth
from k3ray.steering.router import steering_app
from k3ray.serve.tool_calls import byte_template_messages
from k3ray.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("k3ray.serve")
DEFAULT_MAX_TOKENS = 16


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(oa.error(message, kind, param, code), status_code=status, headers=headers)


class BadRequest(Exception):
    def __init__(self, response: JSONResponse):
        self.response = response


def _invalid(status: int, message: str, param: str | None) -> JSONResponse:
    """A request refused for a field: 400, or 501 for a grammar this server cannot apply (no xgrammar)."""
    if status == 501:
        return _error(501, message, param, kind="server_error", code="unsupported")
    return _error(400, message, param)


async def _internal_error(request: Request, err: Exception) -> JSONResponse:
    """What no route answered (a bug, the engine actor's error): a 500 with one readable line, never Starlette's bare
    text. The engine's own error is named, not Ray's wrapping; the traceback goes to the server's log (Starlette
    raises the error on after this answer)."""
    cause = getattr(err, "cause", None) or err  # ray.exceptions.RayTaskError: what the engine actor raised
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return _error(500, f"internal error: {type(cause).__name__}" + (f": {lines[0]}" if lines else ""),
                  kind="server_error", code="internal_error")


def prompt_ids(tok: Tokenizer, req, chat: bool) -> tuple[list[int], tuple[str, ...]]:
    """A request's prompt token ids (chat: its messages through the tokenizer's chat template) and the stop strings
    the template adds."""
    if not chat:
        return tok.encode(req.prompt), ()
    messages, tools = [m.rendered() for m in req.messages], req.tool_dicts()
    if tok.chat_template is None:
        messages, tools = byte_template_messages(messages, tools), None
    return tok.encode(tok.chat_prompt(messages, tools)), tok.chat_stop


class EngineStreams:
    """A front door's one stream from the engine (`subscribe`): every request this front door submitted gets its
    items through it, fanned out here to a queue per request. The engine's stream ending (the engine gone) ends every
    open request with an error item; the next request opens a new stream."""

    def __init__(self, engine):
        self.engine, self.id = engine, uuid.uuid4().hex
        self.queues: dict[int, asyncio.Queue] = {}
        self.keys = itertools.count()
        self.pump: asyncio.Task | None = None

    def open(self) -> tuple[int, asyncio.Queue]:
        if self.pump is None or self.pump.done():
            self.pump = asyncio.get_running_loop().create_task(self._pump())
        key = next(self.keys)
        queue = self.queues[key] = asyncio.Queue()
        return key, queue

    def close(self, key: int, cancel: bool = False) -> None:
        self.queues.pop(key, None)
        if cancel:  # fire and forget: the engine ends the request and frees its caches
            self.engine.cancel.remote(self.id, key)

    async def _pump(self) -> None:
        why = "the engine's stream ended"
        try:
            async for ref in self.engine.subscribe.options(num_returns="streaming").remote(self.id):
                for key, items in (await ref).items():
                    queue = self.queues.get(key)
                    for item in items if queue is not None else ():
                        queue.put_nowait(item)
        except Exception as err:  # noqa: BLE001 - whatever ended it, no request may wait forever
            why = f"the engine is unavailable: {type(err).__name__}"
        for queue in self.queues.values():
            queue.put_nowait({"error": "internal", "message": why})

    @staticmethod
    async def next(queue: asyncio.Queue) -> tuple[str, list[int], list, str | None, int | None, str | None]:
        """(text, token ids, their logprobs, finish, cached prompt tokens (the last item's), error) of every item
        waiting, at least one: a client that fell behind gets what accumulated in one event. The text is final (the
        engine's detokenizer never ends it inside a character)."""
        items = [await queue.get()]
        while not queue.empty():
            items.append(queue.get_nowait())
        text, ids, logprobs, finish, cached = "", [], [], None, None
        for item in items:
            if "error" in item:
                return text, ids, logprobs, finish, cached, item["message"]
            text += item["text"]
            ids += item["tokens"]
            logprobs += item.get("logprobs", [])
            finish = item["finish"]
            cached = item.get("cached_tokens", cached)
        return text, ids, logprobs, finish, cached, None


class FrontDoor:
    """The OpenAI routes of one front-door process (`build_app` mounts them), in front of the engine actor."""

    def __init__(self, engine, info: dict):
        self.engine, self.info = engine, info
        self.streams = EngineStreams(engine)
        self.model, self.created = info["model"], int(time.time())
        self.max_seq_len, self.limits = info["max_seq_len"], info["serve"]
        self.tokenizer = load_tokenizer(info["tokenizer"])

    async def models(self):
        return oa.model_list(self.model, self.created)

    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    # -- one request -------------------------------------------------------------------------------------------------
    async def _serve(self, request: Request, chat: bool):
        try:
            req, ids, sampling = self._validate(await request.body(), chat)
        except BadRequest as bad:
            return bad.response
        opened = [self.streams.open() for _ in range(req.n)]
        seeds = [None if sampling.seed is None else sampling.seed + i for i in range(req.n)]
        try:
            firsts = await asyncio.gather(*(
                self.engine.submit.remote(ids, dataclasses.replace(sampling, seed=seed), self.streams.id, key)
                for (key, _), seed in zip(opened, seeds)))
        except BaseException:
            for key, _ in opened:
                self.streams.close(key, cancel=True)
            raise
        refused = next((f for f in firsts if "error" in f), None)
        if refused is not None:
            for (key, _), first in zip(opened, firsts):
                self.streams.close(key, cancel="error" not in first)
            return self._refused(refused)
        rid = oa.new_id("chatcmpl" if chat else "cmpl")
        choices = [Choice(i, chat, self.tokenizer, chat and req.calls_tools, sampling.logprobs is not None)
                   for i in range(req.n)]
        if req.stream:
            with_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._events(opened, choices, rid, chat, len(ids) if with_usage else None),
                                     media_type="text/event-stream")
        return await self._whole(opened, choices, rid, chat, len(ids))

    def _refused(self, first: dict) -> JSONResponse:
        if first["error"] == "overloaded":
            return _error(429, f"overloaded: {first['message']}; retry later", kind="rate_limit_error",
                          code="overloaded", headers={"Retry-After": str(self.limits["retry_after_s"])})
        if first["error"] == "unavailable":
            return _error(503, first["message"], kind="server_error", code="unavailable",
                          headers={"Retry-After": str(first["retry_after"])})
        return _invalid(first.get("status", 400), first["message"], first.get("param", "prompt"))

    def _validate(self, body: bytes, chat: bool):
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadRequest(_error(400, f"body: not UTF-8 (invalid byte at offset {err.start})", "body"))
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise BadRequest(_error(400, f"body: malformed JSON ({err.msg} at line {err.lineno} column "
                                         f"{err.colno})", "body"))
        try:
            req = (oa.ChatRequest if chat else oa.CompletionRequest).model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            param = ".".join(str(x) for x in first["loc"]) or "body"
            raise BadRequest(_error(400, f"{param}: {first['msg']}", param))
        if req.model != self.model:
            raise BadRequest(_error(404, f"model: unknown model {req.model!r}; this server serves {self.model!r}",
                                    "model", code="model_not_found"))
        try:
            ids, stop = prompt_ids(self.tokenizer, req, chat)
        except TemplateError as err:
            raise BadRequest(_error(400, f"messages: the chat template refused them ({err})", "messages"))
        field = "messages" if chat else "prompt"
        max_tokens = req.wanted_tokens or min(DEFAULT_MAX_TOKENS, self.max_seq_len - len(ids))
        if not ids:
            raise BadRequest(_error(400, f"{field}: empty", field))
        if len(ids) >= self.max_seq_len:
            raise BadRequest(_error(400, f"{field}: {len(ids)} tokens; the context is {self.max_seq_len} tokens, "
                                         f"prompt and completion together", field, code="context_length_exceeded"))
        if max_tokens > self.limits["max_tokens"]:
            raise BadRequest(_error(400, f"max_tokens: {max_tokens} exceeds this server's limit of "
                                         f"{self.limits['max_tokens']}", "max_tokens"))
        if len(ids) + max_tokens > self.max_seq_len:
            raise BadRequest(_error(400, f"max_tokens: {len(ids)} prompt tokens + max_tokens {max_tokens} exceed "
                                         f"the context of {self.max_seq_len} tokens", "max_tokens",
                                    code="context_length_exceeded"))
        try:
            return req, ids, req.sampling(max_tokens, self.tokenizer.vocab_size, stop)
        except GrammarError as err:
            raise BadRequest(_invalid(err.status, str(err), err.param))
        except ValueError as err:
            raise BadRequest(_error(400, str(err), str(err).split(":")[0]))

    async def _whole(self, opened: list, choices: list[Choice], rid: str, chat: bool, prompt_tokens: int):
        async def one(key: int, queue: asyncio.Queue, choice: Choice) -> str | None:
            try:
                while choice.finish is None:
                    text, ids, logprobs, finish, cached, error = await self.streams.next(queue)
                    choice.take(text, ids, logprobs, finish)
                    choice.cached_tokens = cached if cached is not None else choice.cached_tokens
                    if error is not None:
                        return error
            finally:  # the client went away (the handler is cancelled): stop generating, free the caches
                self.streams.close(key, cancel=choice.finish is None)
            return None

        errors = await asyncio.gather(*(one(key, queue, c) for (key, queue), c in zip(opened, choices)))
        if any(errors):
            return _error(500, next(e for e in errors if e), kind="server_error")
        use = oa.usage(prompt_tokens, sum(len(c.ids) for c in choices), max(c.cached_tokens for c in choices))
        build = oa.chat_completion if chat else oa.completion
        return JSONResponse(build(rid, self.model, [c.whole() for c in choices], use))

    async def _events(self, opened: list, choices: list[Choice], rid: str, chat: bool,
                      usage_prompt_tokens: int | None):
        """The choices' chunks as they come, interleaved (one task per choice feeds a queue)."""
        chunks: asyncio.Queue = asyncio.Queue()

        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def feed(key: int, queue: asyncio.Queue, choice: Choice) -> None:
            try:
                while choice.finish is None:
                    text, ids, logprobs, finish, cached, error = await self.streams.next(queue)
                    choice.cached_tokens = cached if cached is not None else choice.cached_tokens
                    chunk = choice.chunk(rid, self.model, text, ids, logprobs, finish)
                    if chunk is not None:
                        chunks.put_nowait(chunk)
                    if error is not None:
                        chunks.put_nowait(oa.error(error, "server_error"))
                        break
            finally:
                self.streams.close(key, cancel=choice.finish is None)
                chunks.put_nowait(None)

        tasks = []
        try:
            if chat:
                for c in choices:
                    yield sse(oa.chat_chunk(rid, self.model, c.index, {"role": "assistant", "content": ""}))
            tasks = [asyncio.get_running_loop().create_task(feed(key, queue, c))
                     for (key, queue), c in zip(opened, choices)]
            running = len(tasks)
            while running:
                chunk = await chunks.get()
                if chunk is None:
                    running -= 1
                else:
                    yield sse(chunk)
            if usage_prompt_tokens is not None:
                use = oa.usage(usage_prompt_tokens, sum(len(c.ids) for c in choices),
                               max(c.cached_tokens for c in choices))
                yield sse(oa.usage_chunk(rid, self.model, chat, use))
            yield "data: [DONE]\n\n"
        finally:  # the client went away: every choice's request ends
            for task in tasks:
                task.cancel()
            for (key, _), c in zip(opened, choices):
                self.streams.close(key, cancel=c.finish is None)


def build_app(engine, info: dict, api_key: str | None = None) -> FastAPI:
    """A front door's app: the steering routes over the engine (k3ray.steering.router; a bad body there is a 400,
    as everywhere here) and the OpenAI routes, every route but /health and /healthz behind `api_key` (None: open).
    No OpenAPI pages: no open routes but the health ones."""
    auth, door = BearerAuth(api_key), FrontDoor(engine, info)
    app = steering_app(EngineSteering(engine, info), auth, "k3ray serve", docs=False, invalid_status=400)
    app.add_exception_handler(Exception, _internal_error)
    guarded = [Depends(auth)]
    app.add_api_route("/v1/models", door.models, methods=["GET"], dependencies=guarded)
    app.add_api_route("/v1/completions", door.completions, methods=["POST"], dependencies=guarded)
    app.add_api_route("/v1/chat/completions", door.chat_completions, methods=["POST"], dependencies=guarded)
    return app
