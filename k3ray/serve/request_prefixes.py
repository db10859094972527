"""The scheduler's books on the prefix cache (Ray-free): which of a request's blocks a rank's cache holds when it is
admitted (`lookup`), the KDA state checkpoints its rows save as they are scheduled (`checkpoint`), and, as its rows
complete, its newly full blocks and saved checkpoints offered to the cache (`offer`) or the checkpoints of a void row
freed again (`drop_saves`). The caches themselves (one per data-parallel rank, k3ray.serve.prefix_cache) are the
request table's (`RequestTable.caches`), replaced with the grid; so each call reads them there.

Shapes: P page size (tokens of a block), b a boundary in tokens (a multiple of `every`).
"""
from __future__ import annotations

from k3ray.model.cache import StateSave
from k3ray.serve.prefix_cache import ROOT, Hit, PrefixCache, block_key
from k3ray.serve.request_table import RequestTable
from k3ray.serve.scheduler_output import RankBatch, Request


def row_saves(start: int, n: int, every: int, last_chunk: bool, shared: int) -> list[int]:
    """The boundaries (multiples of `every`) where a row of n tokens from position `start` saves its KDA states: its
    end where that is a boundary (saved after the iteration, at no cost to it: every decode row crossing one), and
    inside the row only two, since each checkpoint costs memory that a cached prefix pays per token (every KDA
    layer's state: hundreds of times a token's latents): the deepest of a prompt's last chunk (`last_chunk`: where its
    next turn resumes should the reply stay short of the next boundary), and the deepest within the prefix it shares
    with cached blocks (`shared`: where another cached prompt and this one part, so a third prompt sharing that much
    hits there)."""
    end, out = start + n, set()
    deepest = end // every * every
    if deepest > start and (last_chunk or deepest == end):
        out.add(deepest)
    parted = min(shared, end) // every * every
    if parted > start:
        out.add(parted)
    return sorted(out)


class RequestPrefixes:
    """page_size: P; every: tokens between KDA state checkpoints (`PrefixSizes.every`); table: the scheduler's
    request table, holding each rank's cache."""

    def __init__(self, page_size: int, every: int, table: RequestTable):
        self.page_size, self.every, self.table = page_size, every, table

    def _cache(self, rank: int) -> PrefixCache:
        return self.table.caches.ranks[rank].prefix

    def _keys(self, req: Request, blocks: int) -> list[bytes]:
        """`req`'s block keys, extended to its first `blocks` full blocks (their tokens known)."""
        P, keys = self.page_size, req.keys
        for i in range(len(keys), blocks):
            keys.append(block_key(keys[-1] if keys else ROOT, req.tokens(i * P, P)))
        return keys

    def lookup(self, req: Request, rank: int) -> Hit:
        """The prefix of `req` that `rank`'s cache holds (at most its length - 1 tokens: one is computed, for its
        logits)."""
        return self._cache(rank).match(self._keys(req, (req.length - 1) // self.page_size), req.ids)

    def checkpoint(self, req: Request, n: int, batch: RankBatch, from_device: bool) -> None:
        """Checkpoint the KDA states at `row_saves`' boundaries of `req`'s row of n tokens from req.planned, where
        the cache holds none there yet and a checkpoint is free (the row is the batch's last)."""
        every, start, P = self.every, req.planned, self.page_size
        cache = self._cache(req.rank)
        for b in row_saves(start, n, every, start + n >= req.length, req.shared_prefix):
            if not from_device and cache.checkpoints.held_at(self._keys(req, b // P)[b // P - 1]):
                continue
            ckpt = cache.checkpoints.new()
            if ckpt < 0:
                return
            batch.plan.saves.append(StateSave(len(batch.plan.slots) - 1, b - start, ckpt))
            batch.saves.append((len(batch.plan.slots) - 1, b, ckpt))

    def offer(self, req: Request, row: int, batch: RankBatch) -> None:
        """After `req`'s row completed: its newly full pages and the checkpoints its row saved go to the cache."""
        P, cache = self.page_size, self._cache(req.rank)
        full = req.cached // P
        keys = self._keys(req, full)
        for i in range(req.blocks_offered, full):
            if i and not ((i - 1) in req.shared_blocks or cache.holds_page(req.pages[i - 1])):
                break  # it holds no cached block before this one: it caches nothing deeper
            if cache.offer_page(keys[i], keys[i - 1] if i else ROOT, req.tokens(i * P, P), req.pages[i]) == "shared":
                req.shared_blocks[i] = keys[i]
        req.blocks_offered = max(req.blocks_offered, full)
        for r, b, ckpt in batch.saves:
            if r == row:
                cache.checkpoints.offer(keys[b // P - 1], ckpt)

    def drop_saves(self, rank: int, row: int, batch: RankBatch) -> None:
        """The checkpoints a void or failed row was to save are free again."""
        cache = self._cache(rank)
        for r, _, ckpt in batch.saves:
            if r == row:
                cache.checkpoints.drop(ckpt)
