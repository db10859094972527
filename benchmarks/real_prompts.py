"""Real-length prompts for the serving benchmarks (no Ray): slices of Python's own standard library source, drawn
per request from a seed, so every level, run and benchmark serves the same requests.

    span("200:1200") -> (200, 1200)
    draws(tokenizer, n, "200:1200", "32:256", seed) -> [(prompt token ids, max_tokens)] * n
"""
from __future__ import annotations

import os
import random


def span(text: str) -> tuple[int, int]:
    """'LO:HI' or 'N' -> (LO, HI)."""
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def stdlib_tokens(tokenizer, want: int) -> list[int]:
    """At least `want` tokens of Python's standard library source (files in name order, from disk)."""
    root, ids = os.path.dirname(os.__file__), []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                ids += tokenizer.encode(f.read())
            if len(ids) >= want:
                break
    return ids


def draws(tokenizer, n: int, prompt_tokens: str, max_tokens: str, seed: int) -> list[tuple[list[int], int]]:
    """n requests (prompt ids, max_tokens); request i's drawn by Random((seed, i)): the same whatever n."""
    (lo, hi), (lo_m, hi_m) = span(prompt_tokens), span(max_tokens)
    corpus = stdlib_tokens(tokenizer, 64 * hi)
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}/{i}")
        length = rng.randint(lo, hi)
        start = rng.randrange(len(corpus) - length)
        out.append((corpus[start:start + length], rng.randint(lo_m, hi_m)))
    return out
