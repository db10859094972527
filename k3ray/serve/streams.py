"""How the serving engine's requests hear of their tokens: one event per request that the iteration loop (and the
availability's expiry) sets when the request changed (`RequestEvents`), and many requests' streams carried over
one stream per front door (`Subscribers`): a Ray streaming item per request and iteration would cost one RPC per
token, and at 64 streams the engine's event loop, not the GPU, would set the pace."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from k3ray.model.sampling import SamplingParams


class RequestEvents:
    """request id -> the event its stream waits on."""

    def __init__(self):
        self.events: dict[int, asyncio.Event] = {}

    def open(self, rid: int) -> asyncio.Event:
        event = self.events[rid] = asyncio.Event()
        return event

    def close(self, rid: int) -> None:
        self.events.pop(rid, None)

    def wake(self, changed: list) -> None:
        """Wake the streams of the changed requests (those still streaming)."""
        for req in changed:
            if req.id in self.events:
                self.events[req.id].set()


class Outbox:
    """One subscriber's pending items by request key, and the tasks forwarding its requests' streams."""

    def __init__(self):
        self.items: dict[int, list[dict]] = {}
        self.ready = asyncio.Event()
        self.tasks: dict[int, asyncio.Task] = {}

    def put(self, key: int, item: dict) -> None:
        self.items.setdefault(key, []).append(item)
        self.ready.set()


class Subscribers:
    """The front doors' batched streams over the engine's per-request streams (`generate(prompt, params)`, an async
    generator of items)."""

    def __init__(self, generate: Callable[[list[int], SamplingParams], AsyncIterator[dict]]):
        self.generate = generate
        self.outboxes: dict[str, Outbox] = {}  # subscriber (a front door) -> its requests' pending items

    async def submit(self, prompt: list[int], params: SamplingParams, subscriber: str, key: int) -> dict:
        """Start a request whose items go to `subscriber`'s batched stream under `key`; returns its first item
        ({'accepted': id} or an error)."""
        gen = self.generate(prompt, params)
        first = await gen.__anext__()
        if "accepted" not in first:
            await gen.aclose()
            return first
        box = self.outboxes.setdefault(subscriber, Outbox())
        box.tasks[key] = asyncio.get_running_loop().create_task(self._forward(gen, box, key))
        return first

    @staticmethod
    async def _forward(gen, box: Outbox, key: int) -> None:
        try:
            async for item in gen:
                box.put(key, item)
        finally:  # cancelled (`cancel`, or the subscriber went away): generate's own cleanup frees the request
            box.tasks.pop(key, None)
            await gen.aclose()

    def cancel(self, subscriber: str, key: int) -> None:
        """The client of `key` went away: end its request."""
        box = self.outboxes.get(subscriber)
        task = None if box is None else box.tasks.get(key)
        if task is not None:
            task.cancel()

    async def subscribe(self, subscriber: str):
        """The batched stream of a subscriber: one item per wake-up, {key: [items in order]} of every request it
        submitted that has news. Ends (and ends those requests) when the subscriber goes away."""
        box = self.outboxes.setdefault(subscriber, Outbox())
        try:
            while True:
                await box.ready.wait()
                box.ready.clear()
                batch, box.items = box.items, {}
                yield batch
        finally:
            for task in list(box.tasks.values()):
                task.cancel()
            self.outboxes.pop(subscriber, None)
