"""Constrained decoding for `k3ray serve`, through xgrammar: the grammar a request's output must follow
(response_format json_object / json_schema, and tool_choice required / a named function, whose calls take K3's
tool-call format: k3ray.serve.tool_calls), and, per request, what its next token's logits need (`RequestLogits`).

The front door builds a request's grammar (`request_grammar`: a bad schema is a GrammarError naming the field) and
sends it serialized; the engine compiles it against its tokenizer (`Grammars.compile`: cached, refused past
serve.grammar_compile_s). Each iteration the scheduler asks every sampling row of a
constrained or penalised request for its `LogitsRow` (the penalties' and logit_bias's biases, and the grammar's
`GrammarRow`: the rank's last stage keeps a matcher per slot and fills the bitmask where the token is sampled,
k3ray.parallel.grammar_masks, the engine keeping the books of what it holds: `GrammarBooks`); the last stage applies
them on the device before sampling. Penalties depend on the tokens sampled so far, so a penalised request's next row
waits for its last token to come back (no `from_device` rows for it: with serve.overlap it gets a row every other
iteration); a constrained one decodes every iteration. The engine also follows each constrained output with a
matcher of its own, to find what the grammar forces next (`RequestLogits.forced`: jump-forward decoding).
"""
from __future__ import annotations

import asyncio
import copy
import hashlib
import json
from collections import Counter
from collections.abc import Callable
from functools import lru_cache

from k3ray.model.sampling import GrammarRow, HeldGrammars, LogitsRow, SamplingParams
from k3ray.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

TOOL_CALL_FORMAT = "kimi"  # xgrammar's name for the Kimi K2 tool-call format K3 is served with (tool_calls.py)
COMPILED_HELD = 256  # compiled grammars the engine keeps at hand (agents resend the same tools and schemas)


class GrammarError(ValueError):
    """A grammar that cannot be built or compiled; `param` names the request field. `status`: the front door's
    answer, 400 (the request's grammar is wrong) or 501 (this server has no xgrammar: `xgrammar`)."""

    def __init__(self, message: str, param: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def xgrammar(param: str):
    """The xgrammar module, imported only where a request needs a grammar (plain chat never does); where it is not
    installed, a GrammarError naming `param` (the field that asked for a grammar) with status 501."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise GrammarError(f"{param}: this server cannot constrain the output (the xgrammar package is not installed "
                           f"where it runs); send the request without {param}, or install xgrammar>=0.2.9 there",
                           param, status=501) from None
    return xgr


def request_grammar(response_format: dict | None, tools: list[dict] | None, tool_choice, parallel_tool_calls: bool,
                    first_index: int = 0) -> str | None:
    """The serialized grammar (xgrammar's Grammar.serialize_json) a request's output must follow, or None:
    tool_choice 'required' or {'type': 'function', ...} constrains the output to tool calls in K3's format
    (`first_index`: the index its first call takes, the calls of the conversation so far); else
    response_format {'type': 'json_object'} to a JSON object, {'type': 'json_schema', 'json_schema': {'schema'}} to
    that schema (as strict: properties the schema does not name are not generated). xgrammar is imported only
    for a request that has a grammar. Built once per distinct request fields (building a tool grammar costs ~1.6
    ms, and an agent sends the same tools every turn)."""
    if tools and (tool_choice == "required" or isinstance(tool_choice, dict)):
        return _tool_grammar(json.dumps(tools), json.dumps(tool_choice), parallel_tool_calls, first_index)
    if (response_format or {}).get("type", "text") in ("json_object", "json_schema"):
        return _format_grammar(json.dumps(response_format))
    return None


# Built grammars by the request fields as JSON, keys kept in their order (a schema's properties come out in it)
@lru_cache(maxsize=1024)
def _tool_grammar(tools: str, tool_choice: str, parallel_tool_calls: bool, first_index: int) -> str:
    xgr = xgrammar("tool_choice")
    try:
        tag = xgr.get_model_structural_tag(TOOL_CALL_FORMAT, tools=json.loads(tools),
                                           tool_choice=json.loads(tool_choice), reasoning="disabled",
                                           parallel_tool_calls=parallel_tool_calls, max_whitespace_cnt=1)
        tag = numbered_calls(tag.model_dump(), first_index)
        return xgr.Grammar.from_structural_tag(json.dumps(tag)).serialize_json()
    except (RuntimeError, ValueError) as err:
        raise GrammarError(f"tools: {_first_line(err)}", "tools") from None


@lru_cache(maxsize=1024)
def _format_grammar(response_format: str) -> str:
    response_format = json.loads(response_format)
    xgr = xgrammar("response_format")
    if response_format["type"] == "json_object":
        return xgr.Grammar.builtin_json_grammar().serialize_json()
    schema = (response_format.get("json_schema") or {}).get("schema", {})
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    except (RuntimeError, ValueError, TypeError) as err:
        raise GrammarError(f"response_format.json_schema: {_first_line(err)}", "response_format.json_schema") \
            from None
    return grammar.serialize_json()


def numbered_calls(tag: dict, first_index: int) -> dict:
    """xgrammar's structural tag for K3's tool calls (a dict) with the calls numbered as K3's chat template numbers
    them (`functions.NAME:IDX`, IDX counting the conversation's calls): the first call of the reply takes
    `first_index` exactly, later ones (parallel calls) an integer without leading zeros, where xgrammar allows any
    digits. With the index fixed, what follows a call's name up to its arguments is forced: the call's id and name
    jump forward with its first letter (`RequestLogits.forced`)."""
    def is_call(node) -> bool:
        return isinstance(node, dict) and node.get("type") == "tag" and node.get("begin", "").startswith(
            "<|tool_call_begin|>")

    def index(node, pattern: str | None):
        """node with every call's index regex made the literal `pattern` (None: an integer without leading zeros)."""
        node = copy.deepcopy(node)
        for call in [node] if is_call(node) else node["tags"]:
            elements = call["content"]["elements"]
            at = next(i for i, e in enumerate(elements) if e.get("type") == "regex")
            elements[at] = {"type": "regex", "pattern": "0|[1-9][0-9]*"} if pattern is None else \
                {"type": "const_string", "value": pattern}
        return node

    def walk(node):
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        if is_call(node):  # a named function: one call
            return index(node, str(first_index))
        if node.get("type") == "tags_with_separator" and node["tags"] and all(is_call(t) for t in node["tags"]):
            first = {**index(node, str(first_index)), "stop_after_first": True}
            if node.get("stop_after_first"):
                return first
            return {"type": "sequence", "elements": [first, {**index(node, None), "at_least_one": False}]}
        return {k: walk(v) for k, v in node.items()}

    return walk(tag)


def _first_line(err: Exception) -> str:
    """xgrammar's message without its source location prefix."""
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line


def tokenizer_info(tok: Tokenizer):
    """xgrammar's view of a k3ray tokenizer: each token's bytes and the end-of-text token."""
    import xgrammar as xgr

    if isinstance(tok, HFTokenizer):
        from transformers import PreTrainedTokenizerFast

        return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok.hf),
                                                  vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_id])
    vocab = [tok.token_bytes(i) or b"" for i in range(tok.vocab_size)]
    if not isinstance(tok, ByteTokenizer):  # tiktoken: its special tokens are text, not bytes of the output
        vocab[tok.eos_id] = b""
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_id])


class Grammars:
    """The engine's grammar compiler for its tokenizer, and the last COMPILED_HELD grammars it compiled."""

    def __init__(self, tok: Tokenizer, timeout_s: float):
        self.tok, self.timeout_s = tok, timeout_s
        self.held = HeldGrammars(COMPILED_HELD)  # serialized grammar -> compiled

    @property
    def compiler(self):
        return _compiler(self.tok)

    async def compile(self, grammar: str):
        """The compiled grammar: one held is returned at once (a thread's round trip through a busy engine process
        costs milliseconds of a request's first token); a new one compiles off the event loop, GrammarError when it
        takes longer than serve.grammar_compile_s (the compile finishes in its thread and xgrammar caches it; this
        request is refused)."""
        if grammar in self.held:
            return self.held.use(grammar)
        import xgrammar as xgr  # a grammar was built (request_grammar): xgrammar is installed

        def build():
            return self.compiler.compile_grammar(xgr.Grammar.deserialize_json(grammar))

        try:
            compiled = await asyncio.wait_for(asyncio.to_thread(build), self.timeout_s)
        except TimeoutError:
            raise GrammarError(f"response_format: the grammar did not compile within {self.timeout_s:g} s; "
                               f"simplify the schema", "response_format") from None
        return self.held.use(grammar, lambda: compiled)


@lru_cache(maxsize=2)
def _compiler(tok: Tokenizer):
    import xgrammar as xgr

    return xgr.GrammarCompiler(tokenizer_info(tok), max_threads=1)


def needs_logits(params: SamplingParams) -> bool:
    """Whether a request's rows carry a `LogitsRow`: a grammar, penalties, logit_bias or logprobs."""
    return bool(params.grammar or params.penalised or params.logit_bias or params.logprobs is not None)


class RequestLogits:
    """One request's host-side logits state: its compiled grammar (whose matcher that masks the logits lives on the
    last stage: k3ray.parallel.grammar_masks), its output's token counts (penalties), and, where the request jumps
    forward (`jump_forward`), a matcher here that follows the output to find what the grammar forces next."""

    def __init__(self, params: SamplingParams, compiled=None):
        self.params, self.compiled = params, compiled
        self.grammar_key = None if compiled is None else hashlib.sha1(params.grammar.encode()).hexdigest()
        self.counts: Counter[int] = Counter()
        self.matcher = None  # the output so far accepted (jump-forward only)

    @property
    def stateful(self) -> bool:
        """Whether the next row needs the last token back first (penalties; a grammar's matcher takes it where it
        is sampled)."""
        return self.params.penalised

    def jump_forward(self) -> None:
        """Follow the output with a matcher here from now on (before the first token), so that `forced` can say
        what the grammar forces next. Not where a token must carry its logprobs."""
        if self.compiled is not None and self.params.logprobs is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.compiled)

    def accept(self, token: int) -> None:
        """A token of the output, confirmed (in order)."""
        if self.params.penalised:
            self.counts[token] += 1
        if self.matcher is not None and not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            self.matcher = None  # not what the grammar allows (cannot happen under its mask): jump no further

    def forced(self, tok: Tokenizer, limit: int, usable: Callable[[list[int]], int] | None = None) -> list[int]:
        """The tokens the grammar allows no alternative to next (a tool call's markers and name, a JSON schema's
        keys and punctuation), at most `limit`, taken as the output's (accepted and counted): the request feeds
        them to the model without sampling them (the scheduler's `_jump_forward`). The forced text is tokenized as
        the tokenizer would; a token the grammar does not accept ends them. `usable`: how many of the leading ids
        may be taken (a stop string's last token is left to decode, which ends the request as decoding all of them
        would)."""
        m = self.matcher
        if m is None or limit <= 0 or m.is_terminated():
            return []
        text = m.find_jump_forward_string()
        # where a special token's text is cut short (`<|tool_call`, shared by <|tool_call_begin|> and
        # <|tool_calls_section_end|>), forced it would become tokens that spell out the marker the model writes as
        # one token: it is left to sample
        text = text[:len(text) - tok.partial_special(text)]
        ids = tok.encode(text)[:limit] if text else []
        if usable is not None and ids:
            ids = ids[:usable(ids)]
        out: list[int] = []
        for token in ids:
            if not m.accept_token(token):
                break
            out.append(token)
            if self.params.penalised:
                self.counts[token] += 1
        return out

    def compiled_json(self) -> str:
        """The compiled grammar as xgrammar's JSON (made once per grammar: requests share schemas)."""
        return _compiled_json(self.grammar_key, self.compiled)

    def row(self, row: int, grammar: GrammarRow | None = None) -> LogitsRow:
        """What row `row` of an iteration needs of its logits for this request's next token (`grammar`: its
        grammar's part, from the rank's `GrammarBooks`)."""
        p = self.params
        bias = dict(p.logit_bias)
        for token, n in self.counts.items() if p.penalised else ():
            bias[token] = bias.get(token, 0.0) - p.presence_penalty - p.frequency_penalty * n
        return LogitsRow(row, None, list(bias), list(bias.values()), p.logprobs, grammar)


_JSON = HeldGrammars()  # key -> compiled grammar JSON


def _compiled_json(key: str, compiled) -> str:
    return _JSON.use(key, compiled.serialize_json)


class GrammarBooks:
    """What one rank's last stage holds of the grammars (k3ray.parallel.grammar_masks keeps the same books from the
    same rows in the same order: `HeldGrammars`): the tokenizer's description, and the compiled grammars."""

    def __init__(self):
        self.tokenizer_sent = False
        self.held = HeldGrammars()

    def row(self, logits: RequestLogits, replay: list[int] | None) -> GrammarRow:
        """The grammar part of a constrained row of `logits`' request; replay: its output so far, where this is its
        first row since it was seated (None otherwise)."""
        key, tokenizer = logits.grammar_key, None
        compiled = None if key in self.held else logits.compiled_json()
        self.held.use(key)
        if not self.tokenizer_sent:
            tokenizer, self.tokenizer_sent = logits.compiled.tokenizer_info.serialize_json(), True
        return GrammarRow(key, replay, compiled, tokenizer)
