"""Tokenizers: `bytes` (UTF-8 bytes are the tokens, vocabulary 256, the embedded demo), a Hugging Face
`tokenizer.json` (the `tokenizers` library), or a tiktoken BPE file (lines "base64-token rank") with its special
tokens. One interface for data preparation, training checks and serving:

    tok = load_tokenizer("path/to/tokenizer.json")   # or a folder holding it, or "bytes"
    ids = tok.encode(text); text = tok.decode(ids); tok.eos_id; tok.vocab_size
    prompt = tok.chat_prompt([{"role": "user", "content": "hi"}])   # the chat template, as Hugging Face renders it
    detok = tok.detokenizer(stop=("\\n\\n",))   # per request: detok.push(new_ids) -> new text, never half a character

Special tokens and the chat template come from a `tokenizer_config.json` beside the tokenizer file (Hugging Face's
layout): `eos_token`, `bos_token`, `chat_template`, and for tiktoken files `added_tokens_decoder`. Bad input (missing
or unreadable file, no end-of-text token) is a ConfigError naming the file.
"""
from __future__ import annotations

import base64
import codecs
import hashlib
import json
from functools import cached_property, lru_cache
from pathlib import Path

from k3ray.config import ConfigError

BYTE_EOS = 0
"""The NUL byte: it separates files in the byte corpus and ends a generation."""
EOS_NAMES = ("<|endoftext|>", "</s>", "<|im_end|>", "<eos>", "[EOS]", "<|end_of_text|>")
# tiktoken's cl100k split pattern: the usual choice for a BPE file that does not name its own
TIKTOKEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


class Tokenizer:
    """Common interface. Subclasses set name, vocab_size, eos_id, fingerprint and implement encode/decode."""
    name: str
    vocab_size: int
    eos_id: int
    fingerprint: str  # sha256 of the tokenizer's files: prepared shards record it, training checks it
    chat_template: str | None = None
    special: dict[str, str] = {}
    specials: tuple[str, ...] = ()  # texts that encode() takes whole, one id each (added / special tokens)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes | None:
        """The bytes a token stands for, where tokens are byte sequences (bytes, tiktoken); None otherwise."""
        return None

    def partial_special(self, text: str) -> int:
        """Length of the longest tail of `text` that starts a special token's text without completing it (its
        tokens would spell out what one token of its own stands for, once continued)."""
        starts, longest = self._special_starts
        for n in range(min(len(text), longest), 0, -1):
            if text[-n:] in starts:
                return n
        return 0

    @cached_property
    def _special_starts(self) -> tuple[frozenset[str], int]:
        """Every proper prefix of the special tokens' texts, and the longest one's length."""
        starts = frozenset(s[:n] for s in self.specials for n in range(1, len(s)))
        return starts, max(map(len, starts), default=0)

    # -- chat ----------------------------------------------------------------------------------------------------
    @property
    def chat_stop(self) -> tuple[str, ...]:
        """Stop strings a chat reply ends at (besides end-of-text): the byte template's next header."""
        return () if self.chat_template else ("\n### ",)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt for chat messages [{'role', 'content'}, with 'tool_calls' and 'tool_call_id' where OpenAI's
        have them]: the tokenizer's own template (jinja2, rendered as Hugging Face's apply_chat_template with
        add_generation_prompt=True, `tools` given to it), else the byte template (text content only: its tools and
        tool turns rendered beforehand, k3ray.serve.tool_calls.byte_template_messages)

            ### system\\n{content}\\n### user\\n{content}\\n### assistant\\n

        which a byte-level model trained on source code can continue; "\\n### " (chat_stop) ends the reply."""
        if self.chat_template is None:
            return "".join(f"### {m['role']}\n{m['content']}\n" for m in messages) + "### assistant\n"
        return _compiled_template(self.chat_template).render(messages=messages, tools=tools,
                                                             add_generation_prompt=True, **self.special)

    def detokenizer(self, stop: tuple[str, ...] = ()) -> Detokenizer:
        return Detokenizer(self, stop)


class ByteTokenizer(Tokenizer):
    name, vocab_size, eos_id, fingerprint = "bytes", 256, BYTE_EOS, "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Byte sequences that are not UTF-8 (a character cut by max_tokens, stray bytes) become U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return bytes((token,))


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _HF

        try:
            self.hf = _HF.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the library raises a bare Exception for bad files
            raise ConfigError(f"{path}: not a readable tokenizer.json ({str(err).splitlines()[0][:120]})") from None
        config = _tokenizer_config(path)
        self.name, self.vocab_size = str(path), self.hf.get_vocab_size(with_added_tokens=True)
        self.fingerprint = _sha256(path)
        self.special = {k: _token_text(config.get(k)) or "" for k in ("bos_token", "eos_token")}
        self.eos_id = _eos_id(path, self.special["eos_token"], self.hf.token_to_id)
        self.special["eos_token"] = self.hf.id_to_token(self.eos_id)
        self.chat_template = _template(config)
        self.specials = tuple(t.content for t in self.hf.get_added_tokens_decoder().values() if len(t.content) > 1)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    def __init__(self, path: Path):
        import tiktoken

        ranks = {}
        try:
            for n, line in enumerate(path.read_bytes().splitlines()):
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (OSError, ValueError) as err:
            raise ConfigError(f"{path}: not a tiktoken BPE file (line {n + 1}: {err})") from None
        config = _tokenizer_config(path)
        added = {int(i): _token_text(t) for i, t in (config.get("added_tokens_decoder") or {}).items()}
        specials = {text: i for i, text in added.items()} or {"<|endoftext|>": len(ranks)}
        self.enc = tiktoken.Encoding(path.name, pat_str=config.get("pat_str", TIKTOKEN_PATTERN),
                                     mergeable_ranks=ranks, special_tokens=specials)
        self.name, self.fingerprint = str(path), _sha256(path)
        self.vocab_size = max([*ranks.values(), *specials.values()]) + 1
        self.special = {k: _token_text(config.get(k)) or "" for k in ("bos_token", "eos_token")}
        self.eos_id = _eos_id(path, self.special["eos_token"], specials.get)
        self.special["eos_token"] = self.enc.decode_single_token_bytes(self.eos_id).decode("utf-8", "replace")
        self.chat_template = _template(config)
        self.specials = tuple(t for t in specials if len(t) > 1)

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_batch(texts, allowed_special="all", num_threads=1)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids, errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return self.enc.decode_single_token_bytes(token)


class Detokenizer:
    """One request's output as text, token by token: push(new ids) returns the text they add that is final: never
    half a UTF-8 character, never what a stop string might still cut. When a stop string appears the text ends
    before it and `stopped` is set; end-of-text sets `ended`; `tokens` counts the ids taken until then (without
end-of-text). push(..., final=True) flushes."""

    def __init__(self, tok: Tokenizer, stop: tuple[str, ...] = ()):
        self.tok, self.stop = tok, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text, self.sent, self.searched, self.tokens = "", 0, 0, 0
        self.stopped = self.ended = False  # a stop string appeared / end-of-text came
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.bytewise = tok.token_bytes(tok.eos_id) is not None
        # tokenizers without token bytes decode a window: ids[prefix:read] is text already out, ids[read:] is not
        self.prefix = self.read = 0

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.stopped or self.ended:
            return ""
        for token in ids:
            if token == self.tok.eos_id:
                final = self.ended = True
                break
            self.tokens += 1
            self.text += self._decode_one(token)
            if self._find_stop():
                break
        if final and not self.stopped:
            self.text += self._flush()
            self._find_stop()
        upto = len(self.text) if (final or self.stopped) else len(self.text) - self._held_back()
        out, self.sent = self.text[self.sent:upto], max(self.sent, upto)
        return out

    def feed(self, output_ids: list[int]) -> bool:
        """The stop check of k3ray.model.sampling.finish_reason: the output's tokens have been pushed already, so
        whether a stop string has appeared."""
        return self.stopped

    def _decode_one(self, token: int) -> str:
        if self.bytewise:
            return self.utf8.decode(self.tok.token_bytes(token))
        # as vLLM and TGI: decoding a window with one token of context keeps spaces that some decoders strip at the
        # start; wait while the text ends inside a character
        self.ids.append(token)
        return self._window(final=False)

    def _window(self, final: bool) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def _flush(self) -> str:
        return self.utf8.decode(b"", final=True) if self.bytewise else self._window(final=True)

    def _find_stop(self) -> bool:
        if not self.stop:
            return False
        longest = max(len(s) for s in self.stop)
        start = max(0, self.searched - longest + 1)  # only the tail the last tokens could complete
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        self.searched = len(self.text)
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
        return self.stopped

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is the start of a stop string."""
        for n in range(min(len(self.text) - self.sent, max((len(s) for s in self.stop), default=0)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0


# -- loading ------------------------------------------------------------------------------------------------------
def load_tokenizer(spec: str) -> Tokenizer:
    """`bytes`, a tokenizer.json, a tiktoken BPE file, or a folder holding one of them."""
    return _load(str(spec))


@lru_cache(maxsize=8)
def _load(spec: str) -> Tokenizer:
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        found = [p for p in (path / "tokenizer.json", path / "tiktoken.model", *sorted(path.glob("*.tiktoken")))
                 if p.is_file()]
        if not found:
            raise ConfigError(f"{path}: no tokenizer.json, tiktoken.model or *.tiktoken in this folder")
        path = found[0]
    if not path.is_file():
        raise ConfigError(f"{path}: tokenizer file not found (data.tokenizer is 'bytes' or a tokenizer file)")
    try:
        with path.open("rb") as f:
            head = f.read(64).lstrip()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the tokenizer ({err.strerror})") from None
    return HFTokenizer(path) if head.startswith(b"{") else TiktokenTokenizer(path)


def _tokenizer_config(path: Path) -> dict:
    file = path.parent / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{file}: unreadable ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: top level must be an object")
    return config


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _template(config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _eos_id(path: Path, eos_text: str, lookup) -> int:
    for name in ([eos_text] if eos_text else []) + list(EOS_NAMES):
        token = lookup(name)
        if token is not None:
            return token
    raise ConfigError(f"{path}: no end-of-text token (set eos_token in tokenizer_config.json beside it)")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes())
    config = path.parent / "tokenizer_config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    return digest.hexdigest()


@lru_cache(maxsize=4)
def _compiled_template(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    # Hugging Face's settings (transformers' chat template rendering)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
