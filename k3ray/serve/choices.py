"""One choice of a request at the front door: the engine's items for it in (text, token ids, logprobs, finish), its
OpenAI shapes out, whole (`Choice.whole`) or as stream chunks (`Choice.chunk`). Chat choices of a request with tools
have their text split into content and tool calls (k3ray.serve.tool_calls); a reply that called a tool ends with
finish_reason 'tool_calls'."""
from __future__ import annotations

from k3ray.serve import openai_schema as oa
from k3ray.serve.tool_calls import ToolCallParser, merge
from k3ray.tokenizer import Tokenizer


def _token_text(tok: Tokenizer, token: int) -> tuple[str, list[int]]:
    """A token's text (U+FFFD where it holds part of a character) and bytes."""
    raw = tok.token_bytes(token)
    text = tok.decode([token]) if raw is None else raw.decode("utf-8", errors="replace")
    return text, list(raw if raw is not None else text.encode("utf-8"))


def chat_logprobs(tok: Tokenizer, ids: list[int], entries: list) -> dict:
    """OpenAI chat's `logprobs` ({'content': [...]}) of tokens `ids` with their `token_logprobs` entries."""
    content = []
    for token, (lp, top_ids, top_lps) in zip(ids, entries):
        text, raw = _token_text(tok, token)
        top = [dict(zip(("token", "bytes"), _token_text(tok, t)), logprob=v) for t, v in zip(top_ids, top_lps)]
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(tok: Tokenizer, ids: list[int], entries: list, offset: int) -> dict:
    """The completions API's `logprobs` (tokens, token_logprobs, top_logprobs, text_offset) from text offset
    `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, (lp, top_ids, top_lps) in zip(ids, entries):
        text = _token_text(tok, token)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({_token_text(tok, t)[0]: v for t, v in zip(top_ids, top_lps)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


class Choice:
    """index: the choice's place in `choices`; tools: parse tool calls out of a chat reply; logprobs: return them."""

    def __init__(self, index: int, chat: bool, tok: Tokenizer, tools: bool, logprobs: bool):
        self.index, self.chat, self.tok, self.logprobs = index, chat, tok, logprobs
        self.parser = ToolCallParser() if chat and tools else None
        self.text, self.ids, self.entries, self.calls = "", [], [], []
        self.finish: str | None = None
        self.cached_tokens = 0  # prompt tokens its request took from the prefix cache (known once it ends)
        self.offset = 0  # text offset of the next chunk's first token (completions' logprobs)

    def take(self, text: str, ids: list[int], entries: list, finish: str | None) -> tuple[str, list[dict]]:
        """An item's worth of output: the content and tool-call deltas it completes."""
        self.ids += ids
        self.entries += entries
        self.finish = finish
        if self.parser is None:
            self.text += text
            return text, []
        content, deltas = self.parser.push(text, final=finish is not None)
        self.text += content
        self.calls += deltas
        return content, deltas

    @property
    def finish_reason(self) -> str | None:
        return "tool_calls" if self.calls and self.finish == "stop" else self.finish

    def _logprobs(self, ids: list[int], entries: list) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.tok, ids, entries)
        out = completion_logprobs(self.tok, ids, entries, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out

    def whole(self) -> dict:
        logprobs = self._logprobs(self.ids, self.entries)
        if not self.chat:
            return oa.completion_choice(self.index, self.text, self.finish, logprobs)
        content = None if self.calls and not self.text.strip() else self.text
        return oa.chat_choice(self.index, content, merge(self.calls), self.finish_reason, logprobs)

    def chunk(self, rid: str, model: str, text: str, ids: list[int], entries: list, finish: str | None
              ) -> dict | None:
        """The stream chunk of an item (None: nothing to send yet)."""
        content, deltas = self.take(text, ids, entries, finish)
        if not (content or deltas or finish is not None or (self.logprobs and ids)):
            return None
        logprobs = self._logprobs(ids, entries)
        if not self.chat:
            return oa.completion_chunk(rid, model, oa.completion_choice(self.index, content, finish, logprobs))
        delta = ({"content": content} if content else {}) | ({"tool_calls": deltas} if deltas else {})
        return oa.chat_chunk(rid, model, self.index, delta, self.finish_reason, logprobs)
