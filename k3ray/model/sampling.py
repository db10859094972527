"""Choosing the next token, and when a generation ends: the single-process reference and the serving engine share
these, so their outputs can be compared token for token.

Decoding is greedy at temperature 0, else sampling from softmax(logits / temperature) restricted to the top_p
nucleus. Each request draws from its own torch.Generator seeded by its seed, one draw per token, so the same seed
gives the same text whatever other requests share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)

    def generator(self) -> torch.Generator | None:
        """The request's own random stream (None for greedy decoding); without a seed, a random one."""
        if self.temperature == 0:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return g


def next_token(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.temperature == 0:
        return int(torch.argmax(logits_V))
    probs = torch.softmax(logits_V.detach().double().cpu() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p  # the smallest prefix whose mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def finish_reason(output_ids: list[int], params: SamplingParams, eos: int, context_left: int,
                  stopped: bool | None = None) -> str | None:
    """'stop' (end-of-text token or a stop string in the output), 'length' (max_tokens or the context is full), or
    None while the generation goes on. `stopped`: whether the request's detokenizer (k3ray.tokenizer) met a stop
    string in the text; None: search the output as bytes (byte tokens, the single-process reference)."""
    if output_ids and output_ids[-1] == eos:
        return "stop"
    if stopped if stopped is not None else (params.stop and stop_index(output_ids, params.stop) is not None):
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
