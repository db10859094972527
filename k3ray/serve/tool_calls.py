"""Tool calls in K3's output format (Kimi K2's), to and from OpenAI's `tool_calls`:

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json arguments}<|tool_call_end|>
    ...
    <|tool_calls_section_end|>

(without the line breaks). The call's id is the text between <|tool_call_begin|> and <|tool_call_argument_begin|>,
`functions.NAME:IDX` (IDX counts the calls of the conversation), as the model's chat template renders it back.

`ToolCallParser` splits generated text, as it streams, into content and tool-call deltas (OpenAI's `delta.tool_calls`:
the id and name first, then pieces of the arguments); `parse` does it for a whole text. `byte_template_messages`
renders tools and the conversation's tool turns for the byte chat template (tokenizers with their own chat template
render them themselves: `tools`, `assistant.tool_calls`, `role: tool`).
"""
from __future__ import annotations

import json

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def _held(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is the start of `marker` (it may still become the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def call_name(call_id: str) -> str:
    """NAME of `functions.NAME:IDX` (the id itself where it has another shape)."""
    name = call_id.split(".", 1)[1] if call_id.startswith("functions.") else call_id
    return name.rsplit(":", 1)[0] if ":" in name else name


class ToolCallParser:
    """One choice's generated text -> (content, tool-call deltas), as it streams."""

    def __init__(self):
        self.buf, self.mode, self.calls = "", "content", 0

    def push(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """The content and the `delta.tool_calls` entries that `text` completes; `final`: the text ended."""
        self.buf += text
        content, deltas = "", []
        while True:
            if self.mode == "content":
                at = self.buf.find(SECTION_BEGIN)
                if at < 0:
                    keep = 0 if final else _held(self.buf, SECTION_BEGIN)
                    content += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return content, deltas
                content += self.buf[:at]
                self.buf, self.mode = self.buf[at + len(SECTION_BEGIN):], "section"
            elif self.mode == "section":  # between calls
                self.buf = self.buf.lstrip()
                if self.buf.startswith(CALL_BEGIN):
                    self.buf, self.mode = self.buf[len(CALL_BEGIN):], "header"
                elif self.buf.startswith(SECTION_END):
                    self.buf, self.mode = self.buf[len(SECTION_END):], "after"
                elif not self.buf or (not final and (CALL_BEGIN.startswith(self.buf)
                                                      or SECTION_END.startswith(self.buf))):
                    return content, deltas
                else:  # text that starts no marker: not K3's format; dropped
                    self.buf = self.buf[1:]
            elif self.mode == "header":
                at = self.buf.find(ARGUMENT_BEGIN)
                if at < 0:
                    return content, deltas
                call_id = self.buf[:at].strip()
                deltas.append({"index": self.calls, "id": call_id, "type": "function",
                               "function": {"name": call_name(call_id), "arguments": ""}})
                self.calls += 1
                self.buf, self.mode = self.buf[at + len(ARGUMENT_BEGIN):], "arguments"
            elif self.mode == "arguments":
                at = self.buf.find(CALL_END)
                end = at if at >= 0 else len(self.buf) - (0 if final else _held(self.buf, CALL_END))
                if end > 0:
                    deltas.append({"index": self.calls - 1, "function": {"arguments": self.buf[:end]}})
                if at < 0:
                    self.buf = self.buf[end:]
                    return content, deltas
                self.buf, self.mode = self.buf[at + len(CALL_END):], "section"
            else:  # after the section: the reply is over
                self.buf = ""
                return content, deltas


def merge(deltas: list[dict]) -> list[dict]:
    """`delta.tool_calls` entries -> whole `message.tool_calls`."""
    calls: list[dict] = []
    for d in deltas:
        if "id" in d:
            calls.append({"id": d["id"], "type": "function", "function": dict(d["function"])})
        else:
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls


def parse(text: str) -> tuple[str, list[dict]]:
    """A whole generated text -> (content, `message.tool_calls`)."""
    content, deltas = ToolCallParser().push(text, final=True)
    return content, merge(deltas)


def render_calls(calls: list[dict]) -> str:
    """An assistant turn's `tool_calls` in K3's format."""
    return SECTION_BEGIN + "".join(f"{CALL_BEGIN}{c['id']}{ARGUMENT_BEGIN}{c['function']['arguments']}{CALL_END}"
                                   for c in calls) + SECTION_END


def byte_template_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages as the byte chat template takes them ({'role', 'content'} text): the tools' declarations as a
    `tools` turn after the system turns, assistant tool calls in K3's format after the turn's content, and tool
    results as `## Return of ID` sections (Kimi K2's template's words)."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            content += render_calls(m["tool_calls"])
        if m["role"] == "tool":
            content = f"## Return of {m.get('tool_call_id', '')}\n{content}"
        out.append({"role": m["role"], "content": content})
    if tools:
        at = next((i for i, m in enumerate(out) if m["role"] not in ("system", "developer")), len(out))
        out.insert(at, {"role": "tools", "content": json.dumps(tools, ensure_ascii=False)})
    return out
