"""The KV pages and KDA state slots of every data-parallel rank, as the scheduler hands them out: free lists per
rank, each rank's prefix cache (k3ray.serve.prefix_cache: pages that requests share, evictable ones taken back as
free pages run out), and the caches of preempted incarnations that iterations in flight still hold (they return once
the last of those iterations completes). Ray-free; the scheduler (k3ray.serve.scheduler) decides who gets what."""
from __future__ import annotations

from dataclasses import dataclass

from k3ray.config import ServeConfig
from k3ray.serve.prefix_cache import Hit, PrefixCache, PrefixSizes
from k3ray.serve.scheduler_output import Request


@dataclass
class HeldCaches:
    """The pages, shared blocks and slot of a preempted incarnation that iterations in flight still hold."""
    rank: int
    pages: list[int]
    shared_blocks: dict[int, bytes]
    slot: int
    in_flight: int


class RankPool:
    """One rank's free pages and slots, and its prefix cache (None: off)."""

    def __init__(self, pages: int, slots: int, page_size: int, prefix: PrefixSizes | None):
        self.free_pages = list(range(pages))
        self.free_slots = list(range(slots))
        self.held_pages = 0  # pages of preempted incarnations that return once their iterations complete
        self.prefix = None if prefix is None else PrefixCache(prefix, page_size, self.free_pages)

    def available_pages(self) -> int:
        """Free pages and cached pages nobody holds (evicted when taken)."""
        return len(self.free_pages) + (len(self.prefix.evictable) if self.prefix is not None else 0)

    def take_pages(self, n: int) -> list[int]:
        """n pages from the end of the free list (O(n) whatever the pool's size: tens of thousands of pages on a
        GPU), evicting cached pages nobody holds where the free ones run short."""
        if n <= 0:
            return []
        while len(self.free_pages) < n and self.prefix is not None and self.prefix.evict_one():
            pass
        taken = self.free_pages[-n:]
        del self.free_pages[-n:]
        return taken

    def give(self, pages: list[int], shared_blocks: dict[int, bytes], slot: int) -> None:
        """A request's pages, the cached blocks it shares (position -> key) and its slot come back."""
        if self.prefix is None:
            self.free_pages += pages
        else:
            self.prefix.release(pages, shared_blocks)
        self.free_slots.append(slot)


class CacheAllocator:
    """serve: sizes per rank (resolved); dp: data-parallel ranks; prefix: the prefix cache's sizes (None: off)."""

    def __init__(self, serve: ServeConfig, dp: int, prefix: PrefixSizes | None = None):
        self.serve = serve
        self.ranks = [RankPool(serve.pages_per_rank, serve.slots_per_rank, serve.page_size, prefix)
                      for _ in range(dp)]
        self.held: dict[tuple[int, int], HeldCaches] = {}  # (request, epoch) -> caches of a preempted incarnation

    def pages(self, tokens: int) -> int:
        """Pages that `tokens` positions take."""
        return -(-tokens // self.serve.page_size)

    def free_slots(self) -> int:
        return sum(len(p.free_slots) for p in self.ranks)

    def admit(self, req: Request, rank: int, tokens: int, hit: Hit) -> None:
        """Seat `req` on `rank`: a slot, the cached pages of its prefix `hit` and pages for its next `tokens`
        positions; its caches start past the hit."""
        pool = self.ranks[rank]
        req.rank, req.slot = rank, pool.free_slots.pop(0)
        req.grammar_seated = False  # a new slot: its first constrained row brings the grammar's matcher there
        if pool.prefix is not None:
            pool.prefix.take(hit, len(req.prompt) if req.cached_prompt is None else 0)  # first admissions count
        req.cached = req.planned = hit.tokens
        req.shared_prefix = hit.shared
        req.blocks_offered = len(hit.pages)
        req.pages = list(hit.pages) + pool.take_pages(self.pages(hit.tokens + tokens) - len(hit.pages))
        if req.cached_prompt is None:
            req.cached_prompt = min(hit.tokens, len(req.prompt))

    def release(self, req: Request) -> None:
        """`req` ended and no iteration holds its caches: they go back."""
        self.ranks[req.rank].give(req.pages, req.shared_blocks, req.slot)
        req.pages, req.slot, req.in_flight, req.unconfirmed, req.shared_blocks = [], -1, 0, 0, {}

    def give_back(self, req: Request) -> None:
        """`req` is preempted: its caches go back now, or once the iterations in flight that hold them complete."""
        pool = self.ranks[req.rank]
        if req.in_flight:
            self.held[(req.id, req.epoch)] = HeldCaches(req.rank, req.pages, req.shared_blocks, req.slot,
                                                        req.in_flight)
            pool.held_pages += len(req.pages)
        else:
            pool.give(req.pages, req.shared_blocks, req.slot)

    def row_done(self, request_id: int, epoch: int) -> None:
        """An iteration holding a preempted incarnation's caches completed: the last one gives them back."""
        held = self.held.get((request_id, epoch))
        if held is not None:
            held.in_flight -= 1
            if held.in_flight == 0:
                self._free_held((request_id, epoch))

    def free_all_held(self) -> None:
        for key in list(self.held):
            self._free_held(key)

    def _free_held(self, key: tuple[int, int]) -> None:
        held = self.held.pop(key)
        pool = self.ranks[held.rank]
        pool.give(held.pages, held.shared_blocks, held.slot)
        pool.held_pages -= len(held.pages)

    def usage(self) -> dict:
        """Pages held by requests (cached pages nobody holds are not counted), slots; the prefix caches' totals."""
        s, dp = self.serve, len(self.ranks)
        out = {"pages_used": sum(s.pages_per_rank - p.available_pages() for p in self.ranks),
               "pages_total": s.pages_per_rank * dp,
               "slots_used": sum(s.slots_per_rank - len(p.free_slots) for p in self.ranks)}
        caches = [p.prefix.usage() for p in self.ranks if p.prefix is not None]
        if caches:
            prefix = {k: sum(c[k] for c in caches) for k in caches[0]}
            prefix["hit_rate"] = prefix["hit_tokens"] / prefix["lookup_tokens"] if prefix["lookup_tokens"] else 0.0
            sizes = self.ranks[0].prefix.sizes
            prefix |= {"state_every": sizes.every, "state_bytes_per_token": sizes.state_bytes_per_token}
            out["prefix_cache"] = prefix
        return out
