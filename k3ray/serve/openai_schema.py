"""OpenAI request and response shapes of `k3ray serve` (the subset it implements), as pydantic models.

Requests are validated here, at the boundary: an error names the field (`param`) and becomes a 4xx with OpenAI's
error body {"error": {"message", "type", "param", "code"}}. Unknown fields are ignored, as OpenAI's API does."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from k3ray.data import CHAT_ROLES
from k3ray.model.sampling import SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with the usage
    n: int = Field(1, ge=1, le=1, description="one choice per request")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty stop strings")
        return stops

    def sampling(self, max_tokens: int, extra_stop: tuple[str, ...] = ()) -> SamplingParams:
        """What the engine samples with (what crosses the Ray hop to it)."""
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                              stop=(*(self.stop or ()), *extra_stop))


class CompletionRequest(_Request):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("one prompt per request")
            v = v[0]
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: str


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, text: str, finish: str | None, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": _now(), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": use}


def completion_chunk(rid: str, model: str, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": _now(), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_completion(rid: str, model: str, text: str, finish: str | None, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": _now(), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}], "usage": use}


def chat_chunk(rid: str, model: str, text: str | None, finish: str | None, first: bool = False) -> dict:
    delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
    return {"id": rid, "object": "chat.completion.chunk", "created": _now(), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, chat: bool, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": _now(),
            "model": model, "choices": [], "usage": use}


def model_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "k3ray"}]}


def error(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
