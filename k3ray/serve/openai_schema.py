"""OpenAI request and response shapes of `k3ray serve` (the subset it implements), as pydantic models.

Requests are validated here, at the boundary: an error names the field (`param`) and becomes a 4xx with OpenAI's
error body {"error": {"message", "type", "param", "code"}}. Unknown fields are ignored, as OpenAI's API does."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from k3ray.model.sampling import SamplingParams
from k3ray.serve.grammar import request_grammar


ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 16


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="max_tokens' newer name; it wins")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with the usage
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices, each its own request to the engine")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[int, float] | None = None  # token id (a JSON string) -> bias in [-100, 100]
    user: str | None = None  # accepted, not used
    metadata: dict[str, str] | None = None  # accepted, not used

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty stop strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, v):
        if v and any(not -100 <= b <= 100 for b in v.values()):
            raise ValueError("biases lie in [-100, 100]")
        return v

    @property
    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def top_logprobs_wanted(self) -> int | None:
        """How many top logprobs per token (None: no logprobs)."""
        raise NotImplementedError

    def grammar(self) -> str | None:
        return None

    def sampling(self, max_tokens: int, vocab: int, extra_stop: tuple[str, ...] = ()) -> SamplingParams:
        """What the engine samples with (what crosses the Ray hop to it); `vocab`: the tokenizer's size (a bias on a
        token past it is a ValueError)."""
        bias = tuple((self.logit_bias or {}).items())
        if any(not 0 <= t < vocab for t, _ in bias):
            raise ValueError(f"logit_bias: token ids lie in [0, {vocab})")
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                              stop=(*(self.stop or ()), *extra_stop), logprobs=self.top_logprobs_wanted,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              logit_bias=bias, grammar=self.grammar())


class CompletionRequest(_Request):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("one prompt per request")
            v = v[0]
        return v

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _shape(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only for an assistant turn with tool_calls)")
        return self

    def rendered(self) -> dict:
        """The message as chat templates take it: content as text, tool calls and ids kept."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(part.text for part in self.content)
        out = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: Function


class NamedTool(BaseModel):
    type: Literal["function"]
    function: dict[str, str]  # {"name": ...}


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema")
        return self


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _tools(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = {t.function.name for t in self.tools or ()}
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(self.tool_choice, NamedTool) and self.tool_choice.function.get("name") not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.get('name')!r}, not one of the tools")
        return self

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def calls_tools(self) -> bool:
        """Whether the output is parsed for tool calls (tools given, tool_choice not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def grammar(self) -> str | None:
        """The serialized grammar the output must follow (k3ray.serve.grammar; GrammarError for a bad one)."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedTool) else self.tool_choice
        fmt = None if self.response_format is None else self.response_format.model_dump(by_alias=True)
        return request_grammar(fmt, self.tool_dicts() if self.calls_tools else None, choice,
                               self.parallel_tool_calls, sum(len(m.tool_calls or ()) for m in self.messages))


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """cached_tokens: prompt tokens served from the prefix cache (the most of any choice)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": _now(), "model": model, "choices": choices,
            "usage": use}


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion_chunk(rid: str, model: str, choice: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": _now(), "model": model, "choices": [choice]}


def chat_completion(rid: str, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": _now(), "model": model, "choices": choices,
            "usage": use}


def chat_choice(index: int, content: str | None, tool_calls: list[dict], finish: str | None,
                logprobs: dict | None) -> dict:
    message = {"role": "assistant", "content": content} | ({"tool_calls": tool_calls} if tool_calls else {})
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish: str | None = None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": _now(), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, chat: bool, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": _now(),
            "model": model, "choices": [], "usage": use}


def model_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "k3ray"}]}


def error(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
