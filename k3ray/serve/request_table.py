"""The scheduler's request table (Ray-free): every request it knows, by where it is (waiting in arrival order, or
running on a rank with a slot and pages), and the moves between those places, the caches following the request
(`CacheAllocator`): seated, released, preempted, requeued after the caches were lost, cancelled, failed. What runs
in each iteration is the scheduler's decision (k3ray.serve.scheduler); this table keeps the books."""
from __future__ import annotations

from k3ray.serve.cache_allocator import CacheAllocator
from k3ray.serve.prefix_cache import Hit
from k3ray.serve.scheduler_output import Request


class RequestTable:
    """caches: the pages and slots of every data-parallel rank, as handed out."""

    def __init__(self, caches: CacheAllocator):
        self.caches = caches
        self.waiting: list[Request] = []
        self.running: dict[int, Request] = {}
        self.requests: dict[int, Request] = {}  # every request not yet forgotten (`forget`)
        self.preemptions = 0

    def add(self, req: Request) -> None:
        """A new request: it waits, last in arrival order."""
        self.waiting.append(req)
        self.requests[req.id] = req

    def seat(self, req: Request, rank: int, tokens: int, hit: Hit) -> None:
        """The head of the queue runs on `rank`: a slot, its cached prefix `hit` and the pages of its next `tokens`
        positions."""
        self.waiting.pop(0)
        self.caches.admit(req, rank, tokens, hit)
        self.running[req.id] = req

    def on_rank(self, rank: int) -> list[Request]:
        return [r for r in self.running.values() if r.rank == rank]

    def cancel(self, rid: int) -> None:
        req = self.requests.get(rid)
        if req is None or req.done:
            return
        req.finish = "cancelled"
        if req in self.waiting:
            self.waiting.remove(req)
        elif req.in_flight == 0:  # else its caches are freed when the last iteration it is in completes
            self.release(req)

    def forget(self, rid: int) -> None:
        self.requests.pop(rid, None)

    def release(self, req: Request) -> None:
        """`req` ended and no iteration holds its caches: they go back."""
        self.caches.release(req)
        self.running.pop(req.id, None)

    def preempt(self, req: Request) -> None:
        """Give `req`'s pages and slot back (once no iteration in flight holds them) and requeue it, in arrival
        order, to be prefilled again from its prompt and confirmed output."""
        self.caches.give_back(req)
        self.running.pop(req.id, None)
        _forget_caches(req)
        req.epoch += 1
        self.preemptions += 1
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: r.arrival)

    def fail_all(self, message: str) -> list[Request]:
        """End every request with finish 'error' (an iteration failed: the caches may be inconsistent)."""
        failed = list(self.waiting) + [r for r in self.running.values() if not r.done]
        for req in failed:
            req.finish, req.error = "error", message
        for req in list(self.running.values()):  # also those that ended while an iteration held their caches
            self.release(req)
        self.caches.free_all_held()
        self.waiting = []
        return failed

    def requeue_all(self, caches: CacheAllocator) -> list[Request]:
        """The workers' caches are gone; `caches` are the new grid's: every unfinished running request goes back
        to the head of the queue, in arrival order (the iterations in flight are void). Returns the requeued."""
        requeued = sorted((r for r in self.running.values() if not r.done), key=lambda r: r.arrival)
        for req in requeued:
            _forget_caches(req)
        self.caches = caches
        self.running = {}
        self.waiting = requeued + [r for r in self.waiting if r not in requeued]
        self.waiting.sort(key=lambda r: r.arrival)
        return requeued


def _forget_caches(req: Request) -> None:
    req.rank, req.pages, req.slot = -1, [], -1
    req.cached = req.planned = req.unconfirmed = req.in_flight = req.blocks_offered = req.forced_end = 0
    req.shared_blocks = {}
