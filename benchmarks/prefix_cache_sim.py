"""Multi-turn chats through the prefix cache's books alone (k3ray.serve.prefix_cache, no model, no Ray): C chats of T
turns run together, each turn's prompt the conversation so far plus a new user turn (50-300 tokens), each reply
64-256 tokens; every full page of prompt and reply is offered, and KDA state checkpoints taken where the server
takes them while checkpoints last: in a prefill at `row_saves`' boundaries, in the reply at every `every` tokens. Prints the share of the shareable prompt tokens that hit (the conversation before the new user
turn, down to a checkpoint boundary) per concurrency and checkpoint budget: how far the default budget (one
checkpoint per state slot: 256 on a GPU) carries chats.

    python benchmarks/prefix_cache_sim.py [--chats 16 64] [--turns 6] [--checkpoints 256 1024 4096]
"""
from __future__ import annotations

import argparse
import random

from k3ray.serve.prefix_cache import ROOT, PrefixCache, PrefixSizes, block_key
from k3ray.serve.request_prefixes import row_saves


def keys_of(ids: list[int], P: int) -> list[bytes]:
    keys: list[bytes] = []
    for b in range(len(ids) // P):
        keys.append(block_key(keys[-1] if keys else ROOT, ids[b * P:(b + 1) * P]))
    return keys


def hit_share(chats: int, turns: int, checkpoints: int, every: int = 64, P: int = 16, pool_pages: int = 40_000,
              seed: int = 0) -> float:
    """Hit prompt tokens / shareable prompt tokens over every turn after the first."""
    rng = random.Random(seed)
    cache = PrefixCache(PrefixSizes(every, checkpoints, 1, 1), P, list(range(pool_pages)))
    history: list[list[int]] = [[] for _ in range(chats)]
    hit = shareable = 0
    for _ in range(turns):
        rows = []
        for i in rng.sample(range(chats), chats):  # every chat's turn admitted, then every one finishes
            prompt = history[i] + [rng.randrange(50_000) for _ in range(rng.randint(50, 300))]
            keys = keys_of(prompt, P)
            h = cache.match(keys[:(len(prompt) - 1) // P], prompt)
            cache.take(h, len(prompt))
            hit, shareable = hit + h.tokens, shareable + len(history[i]) // every * every
            rows.append((i, prompt + [rng.randrange(50_000) for _ in range(rng.randint(64, 256))], h, len(prompt)))
        for i, row, h, prompt_len in rows:
            keys, pages, shared = keys_of(row, P), list(h.pages), {}
            saves = set(row_saves(h.tokens, prompt_len - h.tokens, every, True, h.shared))  # the prefill's
            for b in range(len(h.pages), len(keys)):
                if not cache.free_pages:
                    cache.evict_one()
                pages.append(cache.free_pages.pop())
                if b and not ((b - 1) in shared or cache.holds_page(pages[b - 1])):
                    continue
                if cache.offer_page(keys[b], keys[b - 1] if b else ROOT, row[b * P:(b + 1) * P], pages[b]) == "shared":
                    shared[b] = keys[b]
                boundary = (b + 1) * P
                if (boundary in saves or boundary > prompt_len) and boundary % every == 0 \
                        and not cache.checkpoints.held_at(keys[b]):
                    checkpoint = cache.checkpoints.new()
                    if checkpoint >= 0:
                        cache.checkpoints.offer(keys[b], checkpoint)
            history[i] = row
            cache.release(pages, shared)
    return hit / max(shareable, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--checkpoints", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{args.turns} turns, checkpoints every 64 tokens, pages of 16, seed {args.seed}: hit / shareable tokens")
    print("| chats | " + " | ".join(f"{k} checkpoints" for k in args.checkpoints) + " |")
    print("|---|" + "---|" * len(args.checkpoints))
    for chats in args.chats:
        cells = [f"{100 * hit_share(chats, args.turns, k, seed=args.seed):.1f} %" for k in args.checkpoints]
        print(f"| {chats} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
