"""The serving engine's iteration loop (`IterationLoop`), sequential or overlapped: schedule -> run on the grid ->
complete, while the scheduler has work.

Sequential: schedule, run on the grid, complete, one iteration at a time. Overlapped (serve.overlap, pp = 1): up to
two iterations in flight, so that the engine's host work of an iteration (scheduling, Ray's hop, completing: tokens
to text, stops, guards, waking streams) runs while the workers run the one before, instead of between the two:

    submit n | schedule n+1, submit n+1 | wait n, complete n | schedule n+2, submit n+2 | wait n+1, complete n+1 ...

Rows of n+1 whose token n samples take it on the device (`Scheduler.schedule`, `RankPlan.from_device`). The grid runs
iterations in the order submitted (`grid.submit` -> handle, `grid.collect(handle)` -> answers). A stretch of
overlapped iterations holds `between_iterations` and ends with nothing in flight whenever something must happen
between two iterations: someone waits for the lock (a resize), the live placement wants a boundary
(`LivePlacement.boundary_due`), the expert load or hot spares are due, and at least every BOUNDARY_EVERY iterations. A
failure with two in flight takes the sequential path's way out: a lost worker voids both (the grid is rebuilt and
every unfinished request prefilled again from its confirmed tokens), any other failure fails every request.

Every grid call goes through `Availability.call` (a lost worker: the grid rebuilt, then GridLost); the iterations
whose call was lost or failed end in one place (`_iterations`), and their seconds go into no phase (a recovery's are
in its incident). Observers (metrics) are told after every iteration (`iteration(changed requests, scheduler,
seconds)`) and every `expert_load_every` iterations (`expert_load(workers' counts, homes, copies)`); one that fails is
logged, never the end of the loop. The loop itself failing (a bug) fails every request, and the next request starts
it again.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time

from k3ray.jobs.incidents import IncidentLog
from k3ray.serve.availability import Availability, GridLost
from k3ray.serve.live import BoundaryLock, LivePlacement
from k3ray.serve.record import ServingStats
from k3ray.serve.scheduler import Scheduler
from k3ray.serve.streams import RequestEvents

log = logging.getLogger("k3ray.serve")
BOUNDARY_EVERY = 32  # overlapped iterations at most between two boundaries (policies, placement moves)
SPARES_CHECK_S = 5.0  # how often missing hot spares are looked for room


def _observe(observer, method: str, *args) -> None:
    """Tell an observer (metrics) what happened: one that fails is logged, never the end of the loop."""
    try:
        getattr(observer, method)(*args)
    except Exception:  # noqa: BLE001 - metrics must not stop serving
        log.exception("serving observer %s.%s failed", type(observer).__name__, method)


class GridCallFailed(Exception):
    """An iteration's grid call failed, no worker lost (its `__cause__`): every request fails. `beside`: the
    iteration (plans, handle) submitted beside the one that failed, if any: waited for, its answers void."""

    def __init__(self, beside=None):
        super().__init__("an iteration's grid call failed")
        self.beside = beside


class IterationLoop:
    def __init__(self, grid, sched: Scheduler, availability: Availability, live: LivePlacement,
                 between_iterations: BoundaryLock, stats: ServingStats, incidents: IncidentLog, events: RequestEvents,
                 observers: list, overlap: bool):
        self.grid, self.sched, self.availability, self.live = grid, sched, availability, live
        self.between_iterations, self.stats, self.incidents, self.events = between_iterations, stats, incidents, events
        self.observers = observers
        self.overlap = overlap  # two iterations in flight
        self.wake: asyncio.Event | None = None  # set when work arrives
        self.task: asyncio.Task | None = None
        self.chores: set[str] = set()  # grid calls due between iterations: 'expert_load', 'placement'
        self.spares_checked = time.monotonic()
        self.iteration_t0 = 0.0  # when the iteration under way began (perf_counter): its observers get its seconds

    def ensure_running(self) -> None:
        """Work arrived: wake the loop, or start it (on the running event loop) where it is not running."""
        if self.wake is None:
            self.wake = asyncio.Event()
        self.wake.set()
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())
            self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        """The loop ended by an error (a bug): no stream may wait for it. Every request fails with the error; the
        next request starts the loop again."""
        if task.cancelled() or task.exception() is None:
            return
        err = task.exception()
        log.error("serving: the iteration loop failed", exc_info=err)
        changed = self.sched.table.fail_all(f"the engine loop failed: {type(err).__name__}: {err}")
        self.incidents.record("loop_failed", action="failed every request", requests=len(changed),
                              why=f"{type(err).__name__}: {err}")
        self.events.wake(changed)

    async def _run(self) -> None:
        while True:
            if not self.sched.has_work:
                self.wake.clear()
                await self.wake.wait()
                continue
            async with self.between_iterations:
                await self.live.at_boundary()
                await self._iterations()
            await self._grid_chores()

    async def _iterations(self) -> None:
        """One iteration, or a stretch of overlapped ones; a grid call that fails ends them here, with whatever is
        in flight: a lost grid voids them (rebuilt, every unfinished request requeued), any other failure fails
        every request."""
        try:
            if self.overlap:
                await self._overlapped_stretch()
            else:
                await self._sequential_iteration()
        except GridLost:
            self._iteration_done([], self.iteration_t0)
        except GridCallFailed as failed:
            await self._discard(failed.beside)
            self._iteration_done(self._iteration_failed(failed.__cause__), self.iteration_t0)

    async def _on_grid(self, fn, *args, beside=None):
        """fn(*args) through `Availability.call`: GridLost passes; any other failure is the iteration's
        (GridCallFailed, with `beside`: the iteration submitted beside the one that failed, if any)."""
        try:
            return await self.availability.call(fn, *args)
        except GridLost:
            raise
        except Exception as err:  # noqa: BLE001 - whatever failed, no request may wait forever
            raise GridCallFailed(beside) from err

    async def _sequential_iteration(self) -> None:
        t0 = self.iteration_t0 = time.perf_counter()
        plans = self.sched.schedule()
        t1 = time.perf_counter()
        outputs = await self._on_grid(self.grid.run, plans.plans())
        t2 = time.perf_counter()
        changed = self.sched.complete(plans, outputs)
        self._time_phases(t1 - t0, t2 - t1, time.perf_counter() - t2, outputs)
        self._iteration_done(changed, t0)

    async def _overlapped_stretch(self) -> None:
        """Overlapped iterations until a boundary is due or the work ends; returns with nothing in flight."""
        ahead = None  # (plans, handle): the iteration submitted and not yet completed
        for count in range(BOUNDARY_EVERY):
            t0 = self.iteration_t0 = time.perf_counter()
            submitted, t1, submit_s = None, t0, 0.0
            if self.sched.has_work and (count == 0 or not self._boundary_due()):
                plans = self.sched.schedule()
                if ahead is None or not plans.empty:
                    t1 = time.perf_counter()
                    handle = await self._on_grid(self.grid.submit, plans.plans(), beside=ahead)
                    submitted, submit_s = (plans, handle), time.perf_counter() - t1
            if ahead is None:
                if submitted is None:
                    return
                ahead = submitted
                continue
            t2 = time.perf_counter()
            outputs = await self._on_grid(self.grid.collect, ahead[1], beside=submitted)
            t3 = time.perf_counter()
            changed = self.sched.complete(ahead[0], outputs)
            self._time_phases(t1 - t0, submit_s + t3 - t2, time.perf_counter() - t3, outputs)
            self._iteration_done(changed, t0)
            ahead = submitted
            if ahead is None:
                return
        if ahead is not None:  # the stretch's last iteration (not reached when it ends early)
            await self._drain(ahead)

    async def _drain(self, ahead) -> None:
        t0 = self.iteration_t0 = time.perf_counter()
        outputs = await self._on_grid(self.grid.collect, ahead[1])
        t1 = time.perf_counter()
        changed = self.sched.complete(ahead[0], outputs)
        self._time_phases(0.0, t1 - t0, time.perf_counter() - t1, outputs)
        self._iteration_done(changed, t0)

    async def _discard(self, submitted) -> None:
        """Wait for an iteration whose results no longer count (the grid answers iterations in order)."""
        if submitted is None:
            return
        try:
            await self.availability.call(self.grid.collect, submitted[1])
        except Exception:  # noqa: BLE001 - its requests have failed already (a lost grid among them: rebuilt)
            log.debug("an iteration after a failed one failed too", exc_info=True)

    def _boundary_due(self) -> bool:
        """Whether the stretch should end after the iteration in flight: something waits for a boundary."""
        return bool(self.between_iterations.waiting or self.live.boundary_due() or self.chores
                    or time.monotonic() - self.spares_checked > SPARES_CHECK_S)

    def _iteration_failed(self, err: Exception) -> list:
        log.error("serving iteration failed", exc_info=err)
        changed = self.sched.table.fail_all(f"the iteration failed: {type(err).__name__}: {err}")
        self.sched.forget_grammars()
        self.incidents.record("iteration_failed", action="failed every request", requests=len(changed),
                              why=f"{type(err).__name__}: {err}")
        return changed

    def _iteration_done(self, changed: list, t0: float) -> None:
        """An iteration's requests: guard trips recorded, tokens counted, streams woken, observers told."""
        for req in changed:
            if req.trip is not None:
                log.warning("serving: request %d stopped by the guards (%s %s: %g)", req.id, req.trip.rule,
                            req.trip.detail, req.trip.value)
                value = req.trip.value if math.isfinite(req.trip.value) else str(req.trip.value)  # JSON-able
                self.incidents.record("blowup", action="failed the request", request=req.id, rule=req.trip.rule,
                                      value=value, detail=req.trip.detail)
        stats = self.stats
        stats.iterations += 1
        if self.live.load_due(stats.iterations):
            self.chores.add("placement")
        if self.observers and stats.iterations % self.observers[0].expert_load_every == 0:
            self.chores.add("expert_load")
        got_token = [r for r in changed if r.finish not in ("cancelled", "error")]
        stats.tokens_out += len(got_token)
        if got_token:
            self.availability.tokens_arrived()
        t3 = time.perf_counter()
        self.events.wake(changed)
        stats.phase_s["wake"] += time.perf_counter() - t3
        for observer in self.observers:
            _observe(observer, "iteration", changed, self.sched, time.perf_counter() - t0)

    def _time_phases(self, schedule_s: float, grid_s: float, complete_s: float, outputs: dict) -> None:
        p = self.stats.phase_s
        p["schedule"] += schedule_s
        p["grid"] += grid_s
        p["complete"] += complete_s
        if outputs:
            slowest = max(outputs.values(), key=lambda o: o.seconds)
            p["worker"] += slowest.seconds
            path = self.stats.worker_paths.setdefault(slowest.path, [0, 0.0])
            path[0] += 1
            path[1] += slowest.seconds

    async def _grid_chores(self) -> None:
        """Between iterations, nothing in flight: every so often the workers' expert load (observers, placement);
        missing hot spares are started where there is room. An observer that fails is logged, never the end of the
        loop."""
        chores, self.chores = self.chores, set()
        if chores:
            try:
                loads = await self.availability.call(self.grid.expert_load)
            except GridLost:  # the counts went with the lost grid
                loads = None
            except Exception:  # noqa: BLE001 - not a lost worker (those are recovered): the next iteration shows
                log.exception("collecting the expert load failed")
                loads = None
            for observer in self.observers if loads is not None else ():
                _observe(observer, "expert_load", loads, list(self.grid.group.home), self.live.view()["copies"])
            if loads is not None and "placement" in chores:
                self.live.observe_load(loads)
        if time.monotonic() - self.spares_checked > SPARES_CHECK_S:
            self.spares_checked = time.monotonic()
            try:
                await self.availability.call(self.grid.group.resources.top_up_spares)
            except GridLost:  # the rebuilt grid's spares are topped up at the next check
                pass
            except Exception:  # noqa: BLE001 - a spare is an optimisation: serving goes on without it
                log.exception("starting hot spares failed")
