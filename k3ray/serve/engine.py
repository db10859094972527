"""The serving engine on the worker grid: a Ray actor that owns the scheduler (k3ray.serve.scheduler) and drives
the same Worker actors as training (their stages, expert shards and EP exchange, with cache pools added).

Loading: the newest verified durable checkpoint, merged out of its grid (`serving_weights`), then restored onto
the serving grid's pp x ep like a resume (each worker keeps its stage's names and the experts homed on it).

Requests stream: `generate` is an async generator (a Ray streaming call); its first item says whether the request
was accepted, then one item per iteration in which it got tokens, the last one with the finish reason. Cancelling
the call (a client that went away) cancels the request and frees its pages and slot. The iteration loop runs while
there is work: schedule, every worker's `serve_step` (the last stage's answers are the sampled tokens), complete;
with serve.overlap two iterations are in flight (k3ray.serve.iterations).

Lost workers (k3ray.serve.grid): the grid is rebuilt from the weights the engine holds and every
unfinished request is prefilled again from its prompt and the tokens generated so far; its stream goes on from the
next token, none lost or repeated. Each loss is an incident (`incident_log`), with its phases and the serving gap
(the loss found -> the next token of any request). Serving never stays broken: a recovery that fails is tried
again, then the grid is relaunched until one serves (`_restore`); meanwhile `health` says why, new requests wait
(then get 'unavailable') and streams in flight end with an error past serve.unavailable_wait_s. Observers (metrics)
that fail, and the loop itself failing, never leave a stream waiting.

`Engine` is all of this without Ray (tests drive it on a fake grid); `ServingEngine` is the actor that loads the
checkpoint and launches the grid first.
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray

from k3ray.config import JobConfig
from k3ray.train.checkpointing import serving_weights
from k3ray.train.drills import clear, inject
from k3ray.serve.scheduler import Overloaded, Scheduler
from k3ray.serve.availability import Availability
from k3ray.serve.grid import ServingGrid
from k3ray.serve.iterations import IterationLoop
from k3ray.serve.live import LiveServing
from k3ray.grid.worker_group import WorkerLost
from k3ray.model.sampling import SamplingParams
from k3ray.parallel.serving import PoolSizes
from k3ray.tokenizer import load_tokenizer

log = logging.getLogger("k3ray.serve")
BROKEN_AFTER_FAILURES = 3  # grid calls failing in a row (no worker lost) before the grid is relaunched


def serving_config(train_config: dict, pp: int, ep: int, overrides: dict | None = None, spares: int = 0) -> JobConfig:
    """The training job's config on the serving grid (pp x ep, `spares` hot spares), with `serve.*` overrides (a
    `serve` section the checkpoint carries is the training job's default, not a serving choice: it is dropped; so
    are its spares)."""
    cfg = JobConfig.model_validate({k: v for k, v in train_config.items() if k != "serve"})
    par = cfg.parallel.model_copy(update={"pp": pp, "ep": ep})
    serve = cfg.serve.model_copy(update=overrides or {})
    ft = cfg.fault_tolerance.model_copy(update={"spares": spares})
    return JobConfig.model_validate({**cfg.model_dump(), "parallel": par.model_dump(), "serve": serve.model_dump(),
                                     "fault_tolerance": ft.model_dump()})


def overlap(cfg: JobConfig) -> bool:
    """serve.overlap, or its default: on where the workers hold the tokens they sampled (pp = 1)."""
    return cfg.serve.overlap if cfg.serve.overlap is not None else cfg.parallel.pp == 1


def resolve_serve(cfg: JobConfig) -> JobConfig:
    """cfg with serve.* resolved for its device and grid (`ServeConfig.resolved`), in place."""
    p = cfg.parallel
    cfg.serve = cfg.serve.resolved(p.device, p.ep)
    return cfg


def pool_sizes(cfg: JobConfig) -> PoolSizes:
    return PoolSizes(cfg.serve.pages_per_rank, cfg.serve.page_size, cfg.serve.slots_per_rank)


class Engine(Availability, LiveServing, IterationLoop):
    """The engine on a launched grid (a ServingGrid, or any object with its methods), without Ray: the
    ServingEngine actor below loads the checkpoint and launches the grid first."""

    def __init__(self, cfg: JobConfig, step: int, grid, observers: list | None = None):
        self.cfg, self.model_name, self.step = cfg, cfg.name, step
        resolve_serve(cfg)
        if cfg.serve.pages_per_rank is None:  # a GPU grid that did not measure its pools: the CPU's size
            cfg.serve = cfg.serve.resolved("cpu")
        self.sched = Scheduler(cfg.serve, cfg.model.max_seq_len, grid.ep, cfg.policies.guards,
                               load_tokenizer(cfg.data.tokenizer))
        self.grid = grid
        self.incidents: list[dict] = []
        self.gap_from: tuple[dict, float] | None = None  # (incident, when the loss was found) until the next token
        self.wake: asyncio.Event | None = None
        self.updates: dict[int, asyncio.Event] = {}
        self.loop_task: asyncio.Task | None = None
        self.iterations, self.tokens_out, self.started = 0, 0, time.time()
        # observers.iteration(changed requests, scheduler, seconds) after every iteration, .expert_load(workers'
        # counts) every .expert_load_every iterations: metrics (k3ray.serve.metrics)
        self.observers: list = observers or []
        self.outboxes: dict[str, Outbox] = {}  # subscriber (a front door) -> its requests' pending items
        self.down: dict | None = None  # while no grid serves: why, and since when (`health`)
        self.serving: asyncio.Event | None = None  # set while a grid serves
        self.spares_checked = time.monotonic()
        self.chores: set[str] = set()  # grid calls due between iterations: 'expert_load', 'placement'
        self.overlap = overlap(cfg)  # two iterations in flight (k3ray.serve.iterations)
        self.failures_in_row = 0  # grid calls that failed, no worker lost, since the last that did not
        # where the iterations' time went (seconds, summed): scheduling, waiting for the grid (of which the workers'
        # own time in the step: `worker`), completing (tokens to text, stops, guards) and waking the streams
        self.phase_s = dict.fromkeys(("schedule", "grid", "worker", "complete", "wake"), 0.0)
        self.live_serving_init(cfg)  # live policies, expert copies, resizes (k3ray.serve.live)

    def ready(self) -> dict:
        return {"model": self.model_name, "step": self.step, "pp": self.grid.pp, "ep": self.grid.ep,
                "max_seq_len": self.cfg.model.max_seq_len, "serve": self.cfg.serve.model_dump(),
                "tokenizer": self.cfg.data.tokenizer}

    def stats(self) -> dict:
        return {**self.sched.usage(), "iterations": self.iterations, "tokens_out": self.tokens_out,
                "uptime_s": time.time() - self.started, "pp": self.grid.pp, "ep": self.grid.ep,
                "incidents": len(self.incidents), "phase_seconds": dict(self.phase_s)}

    async def generate(self, prompt: list[int], params: dict):
        """Stream a request: {'accepted': id} or {'error': 'overloaded' | 'invalid', 'message'} or {'error':
        'unavailable', 'message', 'retry_after'} (no grid served within serve.unavailable_wait_s), then items
        {'text': new final text, 'tokens': the token ids it came from, 'finish': None | 'stop' | 'length'}, or
        {'error': 'internal', ...}. The text never ends inside a character nor in what a stop string may still cut
        (the request's detokenizer holds that back)."""
        sp = SamplingParams(**{**params, "stop": tuple(params.get("stop") or ())})
        if self.down is not None and not await self._until_serving():
            why = self.down["reason"] if self.down is not None else "the grid was being rebuilt"
            yield {"error": "unavailable", "message": f"no serving grid: {why}",
                   "retry_after": self.cfg.serve.retry_after_s}
            return
        try:
            req = self.sched.submit(prompt, sp)
        except Overloaded as err:
            yield {"error": "overloaded", "message": str(err)}
            return
        except ValueError as err:
            yield {"error": "invalid", "message": str(err)}
            return
        self._ensure_loop()
        event = self.updates[req.id] = asyncio.Event()
        sent, sent_text, interval = 0, 0, self.cfg.serve.stream_interval
        try:
            yield {"accepted": req.id}
            while True:
                await event.wait()
                event.clear()
                if req.finish == "error":
                    yield {"error": "internal", "message": req.error}
                    return
                upto = req.detok.tokens  # ids taken into the text: without end-of-text and what follows a stop
                grew = len(req.text) > sent_text
                if req.done or grew and (sent == 0 or upto - sent >= interval):
                    yield {"text": req.text[sent_text:], "tokens": req.out[sent:upto], "finish": req.finish}
                    sent, sent_text = upto, len(req.text)
                if req.done:
                    return
        finally:  # also when the caller cancels the stream: the request ends and its caches are freed
            self.sched.cancel(req.id)
            self.sched.forget(req.id)
            self.updates.pop(req.id, None)

    # -- many requests' streams over one (a front door's) ---------------------------------------------------------
    async def submit(self, prompt: list[int], params: dict, subscriber: str, key: int) -> dict:
        """Start a request whose items (those of `generate`) go to `subscriber`'s batched stream under `key`;
        returns its first item ({'accepted': id} or an error). A Ray streaming item per request and iteration
        would cost one RPC per token: at 64 streams the engine's event loop, not the GPU, would set the pace."""
        gen = self.generate(prompt, params)
        first = await gen.__anext__()
        if "accepted" not in first:
            await gen.aclose()
            return first
        box = self.outboxes.setdefault(subscriber, Outbox())
        box.tasks[key] = asyncio.get_running_loop().create_task(self._forward(gen, box, key))
        return first

    @staticmethod
    async def _forward(gen, box: "Outbox", key: int) -> None:
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

    def _ensure_loop(self) -> None:
        if self.wake is None:
            self.wake = asyncio.Event()
        self.wake.set()
        if self.loop_task is None or self.loop_task.done():
            self.loop_task = asyncio.get_running_loop().create_task(self._loop())
            self.loop_task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The iteration loop ended by an error (a bug): no stream may wait for it. Every request fails with the
        error; the next request starts the loop again."""
        if task.cancelled() or task.exception() is None:
            return
        err = task.exception()
        log.error("serving: the iteration loop failed", exc_info=err)
        changed = self.sched.fail_all(f"the engine loop failed: {type(err).__name__}: {err}")
        self._incident("loop_failed", action="failed every request", requests=len(changed),
                       why=f"{type(err).__name__}: {err}")
        for req in changed:
            if req.id in self.updates:
                self.updates[req.id].set()

    async def _on_grid(self, fn, *args):
        """fn(*args) off the event loop (requests keep arriving and leaving meanwhile). None when workers were lost:
        the grid is then rebuilt and every unfinished request requeued, to be prefilled again (no request fails)."""
        try:
            out = await asyncio.to_thread(fn, *args)
        except WorkerLost as lost:
            self.failures_in_row = 0
            await self._restore(lost)
            return None
        except Exception as err:
            # no worker lost, yet the grid fails (its process groups broken?): the caller fails what was running;
            # failing again and again, the grid is relaunched
            self.failures_in_row += 1
            if self.failures_in_row >= BROKEN_AFTER_FAILURES:
                self.failures_in_row = 0
                await self._restore(None, f"{BROKEN_AFTER_FAILURES} grid calls in a row failed, the last: "
                                          f"{type(err).__name__}: {err}")
            raise
        self.failures_in_row = 0
        return out

    def _incident(self, kind: str, **fields) -> dict:
        """Record an incident (`incident_log`: the front door's /v1/incidents, `k3ray incidents --serve`)."""
        incident = {"time": time.time(), "kind": kind, "iteration": self.iterations, **fields}
        self.incidents.append(incident)
        return incident

    def incident_log(self) -> list[dict]:
        return list(self.incidents)

    async def expert_load(self) -> list[dict]:
        """Every worker's expert load since the last call (off the event loop: requests keep streaming)."""
        return await asyncio.to_thread(self.grid.expert_load)

    async def drill(self, kind: str, workers: list[int] = (), layer: int | None = None,
                    token: int | None = None, seconds: float = 5.0) -> bool:
        """Inject a fault into the grid now (k3ray.train.drills.inject); kind 'clear' removes the NaN hooks.
        Off the event loop. During a recovery it reaches the grid being built: kill_worker kills those of `workers`
        that it has started so far. Whether anything was injected."""
        group = self.grid.group
        if kind == "clear":
            await asyncio.to_thread(clear, group)
            return True
        if kind == "kill_worker":
            workers = [r for r in workers if r < len(group.workers)]
            if not workers:
                return False
        await asyncio.to_thread(inject, group, kind, list(workers), layer, token, seconds)
        return True

    def shutdown(self) -> bool:
        self.grid.close()
        return True


class Outbox:
    """One subscriber's pending items by request key, and the tasks forwarding its requests' streams."""

    def __init__(self):
        self.items: dict[int, list[dict]] = {}
        self.ready = asyncio.Event()
        self.tasks: dict[int, asyncio.Task] = {}

    def put(self, key: int, item: dict) -> None:
        self.items.setdefault(key, []).append(item)
        self.ready.set()


@ray.remote
class ServingEngine(Engine):
    def __init__(self, checkpoint: str, pp: int, ep: int, serve_overrides: dict | None = None,
                 launch_timeout_s: float = 300.0, observers: list | None = None, spares: int = 0):
        weights = serving_weights(checkpoint)
        cfg = serving_config(weights.config, pp, ep, serve_overrides, spares)
        grid = ServingGrid(resolve_serve(cfg), weights.state, launch_timeout_s)
        grid.launch(ep)
        super().__init__(cfg, weights.step, grid, observers)
        log.info("serving %s step %d from %s on pp=%d x ep=%d", cfg.name, weights.step, weights.path, pp, ep)
