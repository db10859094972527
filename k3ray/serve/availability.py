"""Serving never stays broken: the serving engine's `Availability` runs every call on the grid (`call`), rebuilds
the grid after a loss and says, meanwhile, why nothing serves.

A recovery is tried serve.recovery_attempts times, then the grid is relaunched from the held weights until one
serves, with a doubling backoff. While no grid serves: `health` answers why and since when (the front door's /health:
503), new requests wait up to serve.unavailable_wait_s (then 'unavailable'), and the requests in flight wait for the
recovery: as long as it progresses (each phase it ends: replanned, workers placed, process groups, weights
restored) they wait serve.unavailable_wait_s past the latest phase; once an attempt fails, serve.unavailable_wait_s
past the loss at most (at once if that is past), then they end with an error that says why, never a hang.
Afterwards every unfinished request is prefilled again from its prompt and output. The serving gap of a loss (the
loss found -> the next token of any request) goes into its incident.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

from k3ray.config import ServeConfig
from k3ray.grid.calls import WorkerLost
from k3ray.jobs.incidents import IncidentLog
from k3ray.policies import retry
from k3ray.serve.scheduler import Scheduler
from k3ray.serve.streams import RequestEvents

log = logging.getLogger("k3ray.serve")
MAX_BACKOFF_S = 30.0  # between attempts to serve again after a loss
MAX_FAILURES_KEPT = 10  # failed attempts an incident lists (the newest)
BROKEN_AFTER_FAILURES = 3  # grid calls failing in a row (no worker lost) before the grid is relaunched


class GridLost(Exception):
    """A grid call found workers lost (`Availability.call`): the grid has been rebuilt and every unfinished request
    requeued, to be prefilled again; what the call was for (an iteration, a placement switch, a chore) is void."""


class Availability:
    def __init__(self, serve: ServeConfig, grid, sched: Scheduler, incidents: IncidentLog, events: RequestEvents):
        self.serve, self.grid, self.sched, self.incidents, self.events = serve, grid, sched, incidents, events
        self.down: dict | None = None  # while no grid serves: why, and since when (`health`)
        self.serving: asyncio.Event | None = None  # set while a grid serves
        self.failures_in_row = 0  # grid calls that failed, no worker lost, since the last that did not
        self.gap_from: tuple[dict, float] | None = None  # (incident, when the loss was found) until the next token

    async def call(self, fn, *args):
        """fn(*args) off the event loop (requests keep arriving and leaving meanwhile). Workers lost: the grid is
        rebuilt and every unfinished request requeued, to be prefilled again (no request fails), then GridLost."""
        try:
            out = await asyncio.to_thread(fn, *args)
        except WorkerLost as lost:
            self.failures_in_row = 0
            await self.restore(lost)
            raise GridLost(str(lost)) from lost
        except Exception as err:
            # no worker lost, yet the grid fails (its process groups broken?): the caller fails what was running;
            # failing again and again, the grid is relaunched
            self.failures_in_row += 1
            if self.failures_in_row >= BROKEN_AFTER_FAILURES:
                self.failures_in_row = 0
                await self.restore(None, f"{BROKEN_AFTER_FAILURES} grid calls in a row failed, the last: "
                                         f"{type(err).__name__}: {err}")
            raise
        self.failures_in_row = 0
        return out

    async def restore(self, lost: WorkerLost | None, broken: str = "") -> None:
        """Serve again after losing workers, whatever it takes: the recovery (`ServingGrid.recover`) up to
        serve.recovery_attempts times, then relaunches of the whole grid from the held weights until one serves,
        waiting serve.recovery_backoff_s before the second attempt and twice as long before each next (at most
        MAX_BACKOFF_S). Meanwhile `health` says why nothing serves and the recovery's last phase, new requests wait
        (`unavailable`), and the requests in flight end with an error (`_expire_in_flight`) serve.unavailable_wait_s
        past the loss or past the latest phase an attempt ended, whichever is later: an attempt that fails takes
        the extension back (the next one's phases extend it again). Then every unfinished request is requeued, to
        be prefilled again. No worker lost (`broken` says what failed): relaunches only."""
        t0 = time.perf_counter()
        if lost is None:
            incident = self.incidents.record("grid_broken", requests=len(self.sched.table.running), why=broken)
        else:
            incident = self.incidents.record("worker_lost", requests=len(self.sched.table.running),
                                             ranks=sorted(lost.ranks))
        self._go_down(f"recovering from {lost}" if lost is not None else f"relaunching the grid: {broken}")
        progress = self._progress_from_thread()
        for attempt in itertools.count(1):
            relaunch = lost is None or attempt > self.serve.recovery_attempts
            try:
                fields = await asyncio.to_thread(*((self.grid.relaunch, progress) if relaunch
                                                   else (self.grid.recover, lost, progress)))
                break
            except WorkerLost as again:  # lost while the new grid was being built: recover from that grid
                lost, err = again, again
            except Exception as e:  # noqa: BLE001 - the grid could not be rebuilt (yet): try again, then relaunch
                err = e
            what = f"{'relaunch' if relaunch else 'recovery'} {attempt} failed: {type(err).__name__}: {err}"
            log.warning("serving: %s", what)
            failed = incident.setdefault("failed_attempts", [])
            failed[:] = [*failed[-(MAX_FAILURES_KEPT - 1):], what]
            self.down["reason"] = what
            self._arm_expiry(self.down["t0"] + self.serve.unavailable_wait_s)  # a failure extends no wait
            await asyncio.sleep(retry.backoff_s(attempt, self.serve.recovery_backoff_s, MAX_BACKOFF_S))
        incident.update(fields)
        incident["attempts"] = attempt
        incident.setdefault("seconds", {})["total"] = time.perf_counter() - t0  # the failed attempts included
        incident["requeued"] = len(self.sched.reset(self.grid.ep))
        if self.sched.prefix is not None:
            incident["prefix_cache"] = "cold: the new grid's caches start empty"
        self.gap_from = (incident, t0)
        self._go_up()
        log.warning("serving: %s on pp=%d x ep=%d in %.2fs, %d requests to prefill again",
                    "relaunched" if fields.get("action") == "relaunch" else "recovered", self.grid.pp, self.grid.ep,
                    time.perf_counter() - t0, incident["requeued"])

    def tokens_arrived(self) -> None:
        """Some request got a token: a serving gap open since a loss ends here."""
        if self.gap_from is not None:
            incident, t_found = self.gap_from
            incident["seconds"]["to_next_token"] = time.perf_counter() - t_found
            self.gap_from = None

    def _go_down(self, reason: str) -> None:
        t0 = asyncio.get_running_loop().time()
        self.down = {"reason": reason, "since": time.time(), "t0": t0, "expiry": None, "phase": None}
        self._arm_expiry(t0 + self.serve.unavailable_wait_s)
        if self.serving is not None:
            self.serving.clear()

    def _arm_expiry(self, at: float) -> None:
        """The requests in flight end at `at` (the event loop's clock; at once if past) unless a grid serves first."""
        if self.down["expiry"] is not None:
            self.down["expiry"].cancel()
        self.down["expiry"] = asyncio.get_running_loop().call_at(at, self._expire_in_flight)

    def _progress_from_thread(self):
        """progress(phase) for the recovery's thread: each phase it ends extends the wait of the requests in flight
        to serve.unavailable_wait_s past now (on the event loop)."""
        loop = asyncio.get_running_loop()

        def phase_ended(phase: str) -> None:
            if self.down is not None:
                self.down["phase"] = phase
                self._arm_expiry(loop.time() + self.serve.unavailable_wait_s)
        return lambda phase: loop.call_soon_threadsafe(phase_ended, phase)

    def _go_up(self) -> None:
        self.down["expiry"].cancel()
        self.down = None
        if self.serving is not None:
            self.serving.set()

    async def unavailable(self) -> str | None:
        """None once a grid serves (waiting serve.unavailable_wait_s at most while none does), else why none does."""
        if self.down is None:
            return None
        if self.serving is None:
            self.serving = asyncio.Event()
        try:
            await asyncio.wait_for(self.serving.wait(), self.serve.unavailable_wait_s)
        except asyncio.TimeoutError:
            return self.down["reason"] if self.down is not None else "the grid was being rebuilt"
        return None

    def _expire_in_flight(self) -> None:
        """No grid for serve.unavailable_wait_s, and the recovery past its last phase as long or failed: the requests
        accepted before end with an error, not a hang (new ones wait, then are refused: `unavailable`)."""
        waited = asyncio.get_running_loop().time() - self.down["t0"]
        self.events.wake(self.sched.table.fail_all(f"no serving grid for {waited:.1f}s: {self.down['reason']}"))

    def health(self) -> dict:
        """{'status': 'ok'}, or 'unavailable' with the reason and since when (the front door's /health: 503)."""
        if self.down is None:
            return {"status": "ok", "pp": self.grid.pp, "ep": self.grid.ep}
        return {"status": "unavailable", "reason": self.down["reason"], "since": self.down["since"],
                "recovery_phase": self.down["phase"], "retry_after": self.serve.retry_after_s}
