"""The KV pages and KDA state slots of every data-parallel rank, as the scheduler hands them out: free lists per
rank, and the caches of preempted incarnations that iterations in flight still hold (they return once the last of
those iterations completes). Ray-free; the scheduler (k3ray.serve.scheduler) decides who gets what."""
from __future__ import annotations

from dataclasses import dataclass

from k3ray.config import ServeConfig
from k3ray.serve.scheduler_output import Request


@dataclass
class HeldCaches:
    """The pages and slot of a preempted incarnation that iterations in flight still hold."""
    rank: int
    pages: list[int]
    slot: int
    in_flight: int


class RankPool:
    """One rank's free pages and slots."""

    def __init__(self, pages: int, slots: int):
        self.free_pages = list(range(pages))
        self.free_slots = list(range(slots))
        self.held_pages = 0  # pages of preempted incarnations that return once their iterations complete

    def take_pages(self, n: int) -> list[int]:
        """n free pages, from the end of the free list: O(n) whatever the pool's size (tens of thousands of pages
        on a GPU), where slicing from the front copied the whole list per allocation."""
        if n <= 0:
            return []
        taken = self.free_pages[-n:]
        del self.free_pages[-n:]
        return taken

    def give(self, pages: list[int], slot: int) -> None:
        self.free_pages += pages
        self.free_slots.append(slot)


class CacheAllocator:
    """serve: sizes per rank (resolved); dp: data-parallel ranks."""

    def __init__(self, serve: ServeConfig, dp: int):
        self.serve = serve
        self.ranks = [RankPool(serve.pages_per_rank, serve.slots_per_rank) for _ in range(dp)]
        self.held: dict[tuple[int, int], HeldCaches] = {}  # (request, epoch) -> caches of a preempted incarnation

    def pages(self, tokens: int) -> int:
        """Pages that `tokens` positions take."""
        return -(-tokens // self.serve.page_size)

    def free_slots(self) -> int:
        return sum(len(p.free_slots) for p in self.ranks)

    def admit(self, req: Request, rank: int, tokens: int) -> None:
        """Seat `req` on `rank`: a slot and the pages of its first `tokens` positions."""
        pool = self.ranks[rank]
        req.rank, req.slot = rank, pool.free_slots.pop(0)
        req.pages = pool.take_pages(self.pages(tokens))

    def release(self, req: Request) -> None:
        """`req` ended and no iteration holds its caches: they go back."""
        self.ranks[req.rank].give(req.pages, req.slot)
        req.pages, req.slot, req.in_flight, req.unconfirmed = [], -1, 0, 0

    def give_back(self, req: Request) -> None:
        """`req` is preempted: its caches go back now, or once the iterations in flight that hold them complete."""
        pool = self.ranks[req.rank]
        if req.in_flight:
            self.held[(req.id, req.epoch)] = HeldCaches(req.rank, req.pages, req.slot, req.in_flight)
            pool.held_pages += len(req.pages)
        else:
            pool.give(req.pages, req.slot)

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
        pool.give(held.pages, held.slot)
        pool.held_pages -= len(held.pages)

    def usage(self) -> dict:
        s, dp = self.serve, len(self.ranks)
        return {"pages_used": sum(s.pages_per_rank - len(p.free_pages) for p in self.ranks),
                "pages_total": s.pages_per_rank * dp,
                "slots_used": sum(s.slots_per_rank - len(p.free_slots) for p in self.ranks)}
