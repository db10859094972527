"""Serving never stays broken: the serving engine's part (a mixin of `Engine`, k3ray.serve.engine, on its
state: cfg, sched, grid, updates, incidents) that rebuilds the grid after a loss and says, meanwhile, why nothing
serves.

A recovery is tried serve.recovery_attempts times, then the grid is relaunched from the held weights until one
serves, with a doubling backoff. While no grid serves: `health` answers why and since when (the front door's /health:
503), new requests wait up to serve.unavailable_wait_s (then 'unavailable'), and past that the requests in flight
end with an error, never a hang. Afterwards every unfinished request is prefilled again from its prompt and output.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time

from k3ray.grid.worker_group import WorkerLost

log = logging.getLogger("k3ray.serve")
MAX_BACKOFF_S = 30.0  # between attempts to serve again after a loss
MAX_FAILURES_KEPT = 10  # failed attempts an incident lists (the newest)


class Availability:
    async def _restore(self, lost: WorkerLost | None, broken: str = "") -> None:
        """Serve again after losing workers, whatever it takes: the recovery (`ServingGrid.recover`) up to
        serve.recovery_attempts times, then relaunches of the whole grid from the held weights until one serves,
        waiting serve.recovery_backoff_s before the second attempt and twice as long before each next (at most
        MAX_BACKOFF_S). Meanwhile `health` says why nothing serves, new requests wait (`_until_serving`), and past
        serve.unavailable_wait_s the requests in flight end with an error (`_expire_in_flight`). Then every
        unfinished request is requeued, to be prefilled again. No worker lost (`broken` says what failed): relaunches
        only."""
        t0 = time.perf_counter()
        sc = self.cfg.serve
        if lost is None:
            incident = self._incident("grid_broken", requests=len(self.sched.running), why=broken)
        else:
            incident = self._incident("worker_lost", requests=len(self.sched.running), ranks=sorted(lost.ranks))
        self._go_down(f"recovering from {lost}" if lost is not None else f"relaunching the grid: {broken}")
        for attempt in itertools.count(1):
            relaunch = lost is None or attempt > sc.recovery_attempts
            try:
                fields = await asyncio.to_thread(*((self.grid.relaunch,) if relaunch else (self.grid.recover, lost)))
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
            await asyncio.sleep(min(MAX_BACKOFF_S, sc.recovery_backoff_s * 2 ** (attempt - 1)))
        incident.update(fields)
        incident["attempts"] = attempt
        incident.setdefault("seconds", {})["total"] = time.perf_counter() - t0  # the failed attempts included
        incident["requeued"] = len(self.sched.reset(self.grid.ep))
        self.gap_from = (incident, t0)
        self._go_up()
        log.warning("serving: %s on pp=%d x ep=%d in %.2fs, %d requests to prefill again",
                    "relaunched" if fields.get("action") == "relaunch" else "recovered", self.grid.pp, self.grid.ep,
                    time.perf_counter() - t0, incident["requeued"])

    # -- availability --------------------------------------------------------------------------------------------
    def _go_down(self, reason: str) -> None:
        expiry = asyncio.get_running_loop().call_later(self.cfg.serve.unavailable_wait_s, self._expire_in_flight)
        self.down = {"reason": reason, "since": time.time(), "expiry": expiry}
        if self.serving is not None:
            self.serving.clear()

    def _go_up(self) -> None:
        self.down["expiry"].cancel()
        self.down = None
        if self.serving is not None:
            self.serving.set()

    async def _until_serving(self) -> bool:
        """Wait for a grid to serve, serve.unavailable_wait_s at most; whether one does."""
        if self.serving is None:
            self.serving = asyncio.Event()
        if self.down is None:
            self.serving.set()
            return True
        try:
            await asyncio.wait_for(self.serving.wait(), self.cfg.serve.unavailable_wait_s)
        except asyncio.TimeoutError:
            return False
        return True

    def _expire_in_flight(self) -> None:
        """No grid for serve.unavailable_wait_s: the requests accepted before end with an error, not a hang (new
        ones wait, then are refused: `_until_serving`)."""
        failed = self.sched.fail_all(f"no serving grid for {self.cfg.serve.unavailable_wait_s:g}s: "
                                     f"{self.down['reason']}")
        for req in failed:
            if req.id in self.updates:
                self.updates[req.id].set()

    def health(self) -> dict:
        """{'status': 'ok'}, or 'unavailable' with the reason and since when (the front door's /health: 503)."""
        if self.down is None:
            return {"status": "ok", "pp": self.grid.pp, "ep": self.grid.ep}
        return {"status": "unavailable", "reason": self.down["reason"], "since": self.down["since"],
                "retry_after": self.cfg.serve.retry_after_s}

