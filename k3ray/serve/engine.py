"""The serving engine on the worker grid: a Ray actor that owns the scheduler (k3ray.serve.scheduler) and drives
the same Worker actors as training (their stages, expert shards and EP exchange, with cache pools added).

Loading: the newest verified durable checkpoint, merged out of its grid (`serving_weights`), then restored onto
the serving grid's pp x ep like a resume (each worker keeps its stage's names and the experts homed on it). The
checkpoint is read beside the grid's start (k3ray.serve.launch.hold_weights): worker processes start meanwhile.
The actor starts its workers before it imports torch and the model code, so their imports and its own run side by
side: this module imports neither at its top (its parts are imported in `Engine`'s constructor).

Parts, each a class of its own, owned here and handed what they use in their constructors (as vLLM v1's EngineCore
owns a scheduler and an executor): the scheduler (k3ray.serve.scheduler), the iteration loop (schedule -> run on the
grid -> complete, k3ray.serve.iterations), the availability (every grid call, recoveries, `health`,
k3ray.serve.availability), the live placement (policies, expert copies, resizes, k3ray.serve.live), the
requests' admission (k3ray.serve.admission), their streams (k3ray.serve.streams) and the serving view of its status
(`stats`: k3ray.serve.record.ServingStatus); they share the incident log (k3ray.jobs.incidents) and the iterations'
counters (k3ray.serve.record). The engine's own methods are its Ray API, with the front doors' batched streams
(`submit`, `cancel`, `subscribe`) that only the actor carries.

Requests stream: `generate` is an async generator (a Ray streaming call); its first item says whether the request
was accepted, then one item per iteration in which it got tokens, the last one with the finish reason. Cancelling
the call (a client that went away) cancels the request and frees its pages and slot. The iteration loop runs while
there is work: schedule, every worker's `serve_step` (the last stage's answers are the sampled tokens), complete;
with serve.overlap two iterations are in flight.

Lost workers (k3ray.serve.grid): the grid is rebuilt from the weights the engine holds and every
unfinished request is prefilled again from its prompt and the tokens generated so far; its stream goes on from the
next token, none lost or repeated. Each loss is an incident (`incident_log`), with its phases and the serving gap
(the loss found -> the next token of any request). Serving never stays broken: a recovery that fails is tried
again, then the grid is relaunched until one serves (`Availability.restore`); meanwhile `health` says why, new
requests wait (then get 'unavailable') and streams in flight wait while the recovery progresses, then end with an
error past serve.unavailable_wait_s (k3ray.serve.availability).
Observers (metrics) that fail, and the loop itself failing, never leave a stream waiting.

`Engine` is all of this without Ray (tests drive it on a fake grid); `ServingEngine` is the actor that loads the
checkpoint and launches the grid first.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import ray

from k3ray.config import JobConfig, serving_config
from k3ray.faults import clear, inject, slow_recovery
from k3ray.io.checkpoint import CheckpointError
from k3ray.jobs.incidents import IncidentLog
from k3ray.serve.launch import hold_weights, serving_job_config, start_workers
from k3ray.serve.record import ServingStats, ServingStatus
from k3ray.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from k3ray.model.sampling import SamplingParams

log = logging.getLogger("k3ray.serve")


def overlap(cfg: JobConfig) -> bool:
    """serve.overlap, or its default: on where the workers hold the tokens they sampled (pp = 1)."""
    return cfg.serve.overlap if cfg.serve.overlap is not None else cfg.parallel.pp == 1


def resolve_serve(cfg: JobConfig) -> JobConfig:
    """cfg with serve.* resolved for its device and grid (`ServeConfig.resolved`), in place."""
    p = cfg.parallel
    cfg.serve = cfg.serve.resolved(p.device, p.ep)
    return cfg


class Engine:
    """The engine on a launched grid (a ServingGrid, or any object with its methods), without Ray: the
    ServingEngine actor below loads the checkpoint and launches the grid first. It owns its parts and answers for
    them: the scheduler, the availability (every grid call, recoveries, `health`), the live placement (policies,
    expert copies, resizes), the iteration loop and the requests' admission; each gets what it uses in its
    constructor."""

    def __init__(self, cfg: JobConfig, step: int, grid, observers: list | None = None):
        # the parts that import torch and the model code are imported here, not at the module's top: the
        # ServingEngine actor's process loads this module first (Ray sends the actor class by value, this base class
        # by reference) and starts its workers before it imports them
        from k3ray.serve.admission import Admission
        from k3ray.serve.availability import Availability
        from k3ray.serve.iterations import IterationLoop
        from k3ray.serve.live import BoundaryLock, LivePlacement
        from k3ray.serve.prefix_cache import prefix_sizes
        from k3ray.serve.scheduler import Scheduler
        from k3ray.serve.streams import RequestEvents, Subscribers

        self.cfg, self.model_name, self.step, self.grid = cfg, cfg.name, step, grid
        resolve_serve(cfg)
        if cfg.serve.pages_per_rank is None:  # a GPU grid that did not measure its pools: the CPU's size
            cfg.serve = cfg.serve.resolved("cpu")
        sc = cfg.serve
        self.sched = Scheduler(sc, cfg.model.max_seq_len, grid.ep, cfg.policies.guards,
                               load_tokenizer(cfg.data.tokenizer), prefix=prefix_sizes(sc, cfg.model))
        self.counts = ServingStats()
        self.incidents = IncidentLog(stamp=lambda: {"iteration": self.counts.iterations})
        self.events = RequestEvents()
        self.between_iterations = BoundaryLock()  # held by each iteration; a resize takes it to run between two
        self.availability = Availability(sc, grid, self.sched, self.incidents, self.events)
        self.live = LivePlacement(cfg, grid, self.sched, self.availability, self.incidents, self.counts,
                                  self.between_iterations)
        # observers.iteration(changed requests, scheduler, seconds) after every iteration, .expert_load(workers'
        # counts, homes, copies) every .expert_load_every iterations: metrics (k3ray.serve.metrics)
        self.loop = IterationLoop(grid, self.sched, self.availability, self.live, self.between_iterations,
                                  self.counts, self.incidents, self.events, observers or [], overlap(cfg))
        self.admission = Admission(sc, self.sched, self.availability, self.loop, self.events)
        self.subscribers = Subscribers(self.admission.stream)
        self.status = ServingStatus(grid, self.sched, self.counts, self.incidents)
        self.start_seconds: dict[str, float] = {}  # the ServingEngine's start in phases

    def ready(self) -> dict:
        """What the front doors and `k3ray serve` need: the model, its grid and limits, and the engine's start in
        phases (seconds; empty for an engine handed a launched grid)."""
        return {"model": self.model_name, "step": self.step, "pp": self.grid.pp, "ep": self.grid.ep,
                "max_seq_len": self.cfg.model.max_seq_len, "serve": self.cfg.serve.model_dump(),
                "tokenizer": self.cfg.data.tokenizer, "start_seconds": dict(self.start_seconds)}

    def stats(self) -> dict:
        """The serving view (`ServingStatus.view`): requests, pages, iterations, tokens, the grid and its standbys."""
        return self.status.view()

    def health(self) -> dict:
        """{'status': 'ok'}, or 'unavailable' with the reason and since when (the front door's /health: 503)."""
        return self.availability.health()

    async def generate(self, prompt: list[int], params: SamplingParams):
        """Stream a request (`Admission.stream`): {'accepted': id} or an error first, then its text as it comes.
        Cancelling the call (a client that went away) ends the request."""
        async with contextlib.aclosing(self.admission.stream(prompt, params)) as items:
            async for item in items:
                yield item

    # -- steering: k3ray.serve.live --------------------------------------------------------------------------------
    # a refusal is raised (k3ray.steering.protocol): KeyError, ValueError or Refused, answered by the front door
    def policies(self, name: str | None = None) -> dict:
        """The live policies (changes waiting for the next iteration on top); KeyError for an unknown name."""
        return self.live.policies(name)

    def set_policy(self, name: str, params: dict, source: str = "api") -> dict:
        """Change one policy at the next iteration (audited): {'policy', 'value', 'applies_at_step'}; KeyError for an
        unknown policy, ValueError naming the field for a bad value (nothing changes then)."""
        return self.live.set_policy(name, params, source)

    def policy_audit(self) -> list[dict]:
        return self.live.audit()

    def placement_view(self) -> dict:
        """`k3ray placement --serve`: per-expert load, homes, copies, rank loads, balancedness, moves."""
        return {**self.live.view(), "iteration": self.counts.iterations}

    def rebalance(self) -> bool:
        """Decide a placement move from the load after the next iteration instead of waiting for
        replication.every_n_steps (with replication enabled)."""
        self.live.rebalance()
        return True

    async def scale(self, ep: int) -> dict:
        """Resize the grid to pp x ep, no request dropped (`LivePlacement.scale`): the incident's fields; ValueError
        for an ep below 1, Refused(409) where the grid cannot take that size, Refused(500) where it failed."""
        try:
            return await self.live.scale(ep)
        finally:  # the requests requeued onto the new grid (or the relaunched one, after a failure) run on
            if self.sched.has_work:
                self.loop.ensure_running()

    def incident_log(self) -> list[dict]:
        """Lost workers, relaunches, resizes, guard trips, failed iterations (`k3ray incidents --serve`)."""
        return list(self.incidents)

    async def expert_load(self) -> list[dict]:
        """Every worker's expert load since the last call (off the event loop: requests keep streaming)."""
        return await asyncio.to_thread(self.grid.expert_load)

    async def drill(self, kind: str, workers: list[int] = (), layer: int | None = None,
                    token: int | None = None, seconds: float = 5.0) -> bool:
        """Inject a fault into the grid now (k3ray.faults.inject; slow_recovery: k3ray.faults.slow_recovery); kind
        'clear' removes the NaN hooks.
        Off the event loop. During a recovery it reaches the grid being built: kill_worker kills those of `workers`
        that it has started so far. Whether anything was injected."""
        group = self.grid.group
        if kind == "slow_recovery":
            slow_recovery(self.grid, seconds)
            return True
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


@ray.remote
class ServingEngine(Engine):
    """The engine as a Ray actor: it loads the checkpoint and launches the grid first, then serves as `Engine` does;
    and it carries the front doors' streams, many requests' over one per front door (k3ray.serve.streams), the
    transport between their processes and this one (the Ray-free engine's callers read `generate`)."""

    def __init__(self, checkpoint: str, pp: int, ep: int, serve_overrides: dict | None = None,
                 launch_timeout_s: float = 300.0, observers: list | None = None, spares: int = 0,
                 standbys: bool | str = "auto", reading: list | None = None):
        """reading: [about, weights], `hold_weights(checkpoint)` started by the caller before this actor (in a list,
        so that Ray passes the references, not the values they wait for); else started here."""
        t0, started = time.perf_counter(), time.time()
        # read beside the grid's start: its restore waits for them
        about, weights = reading if reading is not None else hold_weights(checkpoint)
        config = serving_job_config(checkpoint)
        if config is None:  # a released folder: its config comes with its weights
            config = ray.get(about)[0].config
        cfg = resolve_serve(serving_config(config, pp, ep, serve_overrides, spares, standbys))
        workers = start_workers(cfg, ep, launch_timeout_s)  # before torch: their imports run beside the engine's
        try:
            t_started = time.perf_counter()
            # torch and the model code, while the workers import theirs: the grid, and Engine's parts
            from k3ray.serve import admission, availability, iterations, live, scheduler, streams  # noqa: F401
            from k3ray.serve.grid import ServingGrid

            imports = time.perf_counter() - t_started
            grid = ServingGrid(cfg, weights, launch_timeout_s)
            phases = grid.launch(ep, started=workers)
            held, read = ray.get(about)
            if held.config["model"] != config["model"]:  # the newest step failed verification: an older one came
                raise CheckpointError(f"{held.path}: the newest step that verifies holds another model than the "
                                      f"newest step; serve it from a folder of its own")
        except BaseException:
            workers.close()
            raise
        super().__init__(cfg, held.step, grid, observers)
        # the weights are read beside the workers' start and process groups: when they were held, from the start
        held_at = read["started"] + read["read_weights"] + read["pack_weights"] - started
        self.start_seconds = {"read_weights": read["read_weights"], "pack_weights": read["pack_weights"],
                              "weights_held_at": held_at, "engine_imports": imports, **phases,
                              "total": time.perf_counter() - t0}
        log.info("serving %s step %d from %s on pp=%d x ep=%d, started in %s", cfg.name, held.step, held.path,
                 pp, ep, ", ".join(f"{k} {v:.1f} s" for k, v in self.start_seconds.items()))

    async def submit(self, prompt: list[int], params: SamplingParams, subscriber: str, key: int) -> dict:
        """Start a request whose items (those of `generate`) go to `subscriber`'s batched stream under `key`;
        returns its first item ({'accepted': id} or an error)."""
        return await self.subscribers.submit(prompt, params, subscriber, key)

    def cancel(self, subscriber: str, key: int) -> None:
        """The client of `key` went away: end its request."""
        self.subscribers.cancel(subscriber, key)

    async def subscribe(self, subscriber: str):
        """The batched stream of a subscriber: one item per wake-up, {key: [items in order]} of every request it
        submitted that has news. Ends (and ends those requests) when the subscriber goes away."""
        async with contextlib.aclosing(self.subscribers.subscribe(subscriber)) as batches:
            async for batch in batches:
                yield batch
