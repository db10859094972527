"""Choosing the next token, and when a generation ends: the single-process reference and the serving engine share
these, so their outputs can be compared token for token.

Decoding is greedy at temperature 0, else sampling from softmax(logits / temperature) restricted to the top_p
nucleus. Sampling runs on the device that holds the logits, for a whole batch at once (`sample_tokens`: only token
ids leave the worker). Its randomness is counter-based: the noise of request r's n-th token is a hash of (r's seed,
n, vocabulary index), so the same seed gives the same text whatever other requests share the batch, and a request
prefilled again after a lost worker draws the same noise for its next token as it would have undisturbed.

Sampling from the nucleus is the Gumbel-max trick: argmax over kept tokens of log p + G, G ~ Gumbel(0, 1), draws
token v with probability p_v / sum of the kept p (the nucleus renormalised).

Before sampling, rows may have their logits adjusted (`LogitsRows`, built by the engine from a request's penalties and
logit_bias, with its grammar's bitmask filled by the last stage: `GrammarRow`; applied on the device:
`adjust_logits`), and ask for the log-probabilities of the model's own distribution (before any adjustment, as
OpenAI's and vLLM's logprobs are): `token_logprobs`.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from k3ray.model.transfer import to_device

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and the k likeliest tokens'
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0  # subtracted once per time the output holds the token
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token, added to its logit)
    grammar: str | None = None  # a grammar the output must follow (xgrammar's serialized Grammar, k3ray.serve.grammar)

    def __post_init__(self):
        # stop strings and biases may arrive as lists (JSON) or None: held as tuples, the params stay immutable
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias or ()))

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    def resolved_seed(self) -> int:
        """The request's seed: its own, or a random one (drawn once per request, then fixed)."""
        return self.seed if self.seed is not None else random.getrandbits(62)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) in int64 arithmetic: every product stays below 2^59,
    so it is exact and the same on every device."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def gumbel_noise(seed_N: torch.Tensor, counter_N: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] float32 Gumbel(0, 1) noise, a pure function of (seed, counter, vocabulary index)."""
    dev = seed_N.device
    s = seed_N.to(torch.int64)
    h = _mix32((s & _MASK32) ^ _mix32((s >> 32) & _MASK32) ^ 0x2545F491)
    h = _mix32(h ^ (counter_N.to(torch.int64) & _MASK32))[:, None]
    h = _mix32(h ^ torch.arange(vocab, device=dev, dtype=torch.int64)[None, :])
    u = ((h >> 8).to(torch.float64) + 0.5) / float(1 << 24)  # (0, 1), 24 bits
    return (-torch.log(-torch.log(u))).to(torch.float32)


def sample_tokens(logits_NV: torch.Tensor, temperature_N: torch.Tensor, top_p_N: torch.Tensor, seed_N: torch.Tensor,
                  counter_N: torch.Tensor) -> torch.Tensor:
    """The next token of N sequences [N] int64, on the logits' device, with no host sync (CUDA-graph safe).

    Row i: argmax at temperature_N[i] == 0, else a draw from softmax(logits / temperature) restricted to the
    smallest set of most likely tokens whose mass reaches top_p_N[i], with the noise of (seed_N[i], counter_N[i])."""
    logits = logits_NV.float()
    greedy = logits.argmax(-1)
    temp = temperature_N.float().clamp_min(1e-6)[:, None]
    logp = torch.log_softmax(logits / temp, dim=-1)
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_lp.exp()
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p_N.float()[:, None]  # the first token is always kept
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    scores = torch.where(keep, logp + gumbel_noise(seed_N, counter_N, logits.shape[-1]), -torch.inf)
    return torch.where(temperature_N.to(logits.device) == 0, greedy, scores.argmax(-1))


@dataclass
class GrammarRow:
    """A constrained row's grammar, for the last stage's matcher of its slot (k3ray.parallel.grammar_masks), which
    fills the row's bitmask: `key` names the compiled grammar; `replay`: the row is its request's first since the
    request was seated on its slot: a new matcher, which accepts these output tokens first (None: the slot's
    matcher goes on, with the token sampled at the slot's last constrained row). `compiled` (xgrammar's
    CompiledGrammar JSON) and `tokenizer` (TokenizerInfo JSON) come with the first row that needs them on a rank
    (`GRAMMARS_HELD` compiled grammars are kept there, least recently used dropped: the engine keeps the same books)."""
    key: str
    replay: list[int] | None = None
    compiled: str | None = None
    tokenizer: str | None = None


GRAMMARS_HELD = 64  # compiled grammars each rank's last stage keeps (and the engine's books of what it holds)


class HeldGrammars:
    """The last `limit` grammars used, by key, least recently used dropped: the engine's books of what a rank holds
    and that rank's last stage run this same code over the same rows in the same order, so they agree (and the
    engine's compiled grammars are held with it too)."""

    def __init__(self, limit: int = GRAMMARS_HELD):
        self.limit = limit
        self._items: OrderedDict[str, object] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def __iter__(self):
        """The keys held, least recently used first."""
        return iter(self._items)

    def use(self, key: str, make=None):
        """The value held for `key` (where it holds none: make(), or None without `make`), now the most recently
        used."""
        if self._items.get(key) is None:
            self._items[key] = None if make is None else make()
        self._items.move_to_end(key)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)
        return self._items[key]


@dataclass
class LogitsRow:
    """What one row of an iteration asks of its logits before its token is sampled: a token bitmask (int32 words,
    bit v % 32 of word v // 32 set where token v is allowed; xgrammar's layout) or the grammar the last stage fills
    one from, additive biases on some tokens, and how many top log-probabilities to return beside the sampled
    token's (None: no logprobs)."""
    row: int
    mask: torch.Tensor | None = None  # [ceil(V / 32)] int32, on the host
    bias_ids: list[int] = field(default_factory=list)
    bias: list[float] = field(default_factory=list)
    logprobs: int | None = None
    grammar: GrammarRow | None = None


def adjust_logits(logits_NV: torch.Tensor, rows: list[LogitsRow]) -> torch.Tensor:
    """The logits with the rows' biases added and the tokens their masks forbid at -inf (a new tensor; a few copies
    to the device, no host sync). Plain torch rather than xgrammar's kernels: it takes any dtype (float64 serving
    included)."""
    out, dev = logits_NV.clone(), logits_NV.device
    biased = [(r.row, t, b) for r in rows for t, b in zip(r.bias_ids, r.bias)]
    if biased:
        at, tok, val = zip(*biased)
        at_d, tok_d = to_device([at, tok], torch.int64, dev).unbind(0)
        out.index_put_((at_d, tok_d), to_device(list(val), out.dtype, dev), accumulate=True)
    masked = [r for r in rows if r.mask is not None]
    if masked:
        at = to_device([r.row for r in masked], torch.int64, dev)
        words = torch.stack([r.mask for r in masked])
        out[at] = mask_logits(out[at], to_device(words, words.dtype, dev))
    return out


def mask_logits(logits_NV: torch.Tensor, words_NW: torch.Tensor) -> torch.Tensor:
    """The logits with the tokens each row's bitmask forbids at -inf: words [N, W] int32 (xgrammar's layout, bit
    v % 32 of word v // 32 set where token v is allowed; every bit set: nothing forbidden). Tokens past the
    words (a model vocabulary wider than the tokenizer's) are forbidden. Device ops only, no host sync."""
    V, W = logits_NV.shape[-1], words_NW.shape[-1]
    vocab = torch.arange(V, device=logits_NV.device)
    bits = (words_NW[:, (vocab // 32).clamp_max(W - 1)] >> (vocab % 32)) & 1
    allowed = (bits == 1) & (vocab < W * 32)
    return torch.where(allowed, logits_NV, -torch.inf)


def token_logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor, rows: list[LogitsRow]
                   ) -> dict[int, tuple[float, list[int], list[float]]]:
    """row -> (log p of its sampled token, the k likeliest tokens, their log p) under the model's distribution
    (log-softmax of the raw logits in float64), for the rows that ask (`LogitsRow.logprobs`); one host copy."""
    asked = [r for r in rows if r.logprobs is not None]
    if not asked:
        return {}
    at = to_device([r.row for r in asked], torch.int64, logits_NV.device)
    logp = torch.log_softmax(logits_NV[at].double(), dim=-1)
    chosen = logp.gather(-1, tokens_N[at][:, None]).squeeze(-1)
    k = max(r.logprobs for r in asked)
    top_lp, top_id = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    host = torch.cat([chosen[:, None], top_lp, top_id.double()], dim=-1).cpu()
    return {r.row: (float(h[0]), h[1 + k:1 + k + r.logprobs].long().tolist(), h[1:1 + r.logprobs].tolist())
            for r, h in zip(asked, host)}


def next_token(logits_V: torch.Tensor, params: SamplingParams, seed: int, counter: int) -> int:
    """One sequence's next token (the reference's path through `sample_tokens`)."""
    dev = logits_V.device
    return int(sample_tokens(logits_V[None], torch.tensor([params.temperature], device=dev),
                             torch.tensor([params.top_p], device=dev), torch.tensor([seed], device=dev),
                             torch.tensor([counter], device=dev))[0])


def finish_reason(output_ids: list[int], params: SamplingParams, eos: int, context_left: int,
                  stops=None) -> str | None:
    """'stop' (end-of-text token or a stop string in the output), 'length' (max_tokens or the context is full), or
    None while the generation goes on. `stops`: the request's k3ray.tokenizer.Detokenizer, which meets stop strings
    on the text as tokens arrive; without one (the reference), the output's bytes are searched whole."""
    if output_ids and output_ids[-1] == eos:
        return "stop"
    if params.stop and (stops.feed(output_ids) if stops is not None else stop_index(output_ids, params.stop)
                        is not None):
        return "stop"
    if len(output_ids) >= params.max_tokens or context_left <= 0:
        return "length"
    return None


def stop_index(output_ids: list[int], stop: tuple[str, ...]) -> int | None:
    """Where the first stop string starts in the output bytes (the returned text ends there), or None."""
    data = bytes(output_ids)
    hits = [i for i in (data.find(s.encode("utf-8")) for s in stop) if i >= 0]
    return min(hits) if hits else None


def visible_ids(output_ids: list[int], params: SamplingParams, eos: int) -> list[int]:
    """The output the client sees: without the end-of-text token, cut before a stop string."""
    ids = output_ids[:-1] if output_ids and output_ids[-1] == eos else output_ids
    cut = stop_index(ids, params.stop) if params.stop else None
    return ids if cut is None else ids[:cut]
