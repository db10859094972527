"""What of the serving engine changes while it serves, between two iterations (`LivePlacement`): the live policies
(validated, audited, applied at the next iteration), the expert placement (read-only copies of hot experts moved in
the background, k3ray.serve.placement) and the grid's size (`scale`: a new grid launched beside the serving one,
then adopted).

The iteration loop holds `between_iterations` (a `BoundaryLock`) around each iteration (around each stretch of
overlapped ones: nothing is in flight while it is free), asks `boundary_due` whether a stretch should end, calls
`at_boundary` at its start, and hands over the workers' expert load when `load_due` said it was wanted.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from k3ray.config import JobConfig
from k3ray.grid.calls import TopologyError
from k3ray.jobs.incidents import IncidentLog
from k3ray.jobs.live_policies import LivePolicies
from k3ray.serve.availability import Availability, GridLost
from k3ray.serve.placement import ServePlacement
from k3ray.serve.record import ServingStats
from k3ray.serve.scheduler import Scheduler
from k3ray.steering.protocol import Refused

log = logging.getLogger("k3ray.serve")


class BoundaryLock(asyncio.Lock):
    """An asyncio.Lock that counts who waits for it: an overlapped stretch holding it drains and lets them in."""

    def __init__(self):
        super().__init__()
        self.waiting = 0

    async def acquire(self) -> bool:
        self.waiting += 1
        try:
            return await super().acquire()
        finally:
            self.waiting -= 1


class LivePlacement:
    def __init__(self, cfg: JobConfig, grid, sched: Scheduler, availability: Availability, incidents: IncidentLog,
                 stats: ServingStats, between_iterations: BoundaryLock):
        self.policy_cfg = cfg.policies  # the live values: a change taken at a boundary is set on it
        self.live = LivePolicies(cfg.policies)  # changes through the front door, applied between iterations
        self.placement = ServePlacement(cfg.model.n_experts)  # read-only copies of hot experts, moved live
        self.grid, self.sched, self.availability = grid, sched, availability
        self.incidents, self.stats, self.between_iterations = incidents, stats, between_iterations

    async def at_boundary(self) -> None:
        """Between two iterations: queued policy changes take effect, a placement move is decided (its copies are
        fetched in the background), and a move whose fetches all ended switches every worker to its table."""
        try:
            changed = self.live.take_pending(self.stats.iterations)
            if changed & {"moonep", "scheduling"}:
                with contextlib.suppress(GridLost):  # a rebuilt grid's workers start from the live values
                    await self.availability.call(self.grid.group.call, "set_policies", self.policy_cfg.model_dump())
            if "replication" in changed or self.placement.decide_next:
                self.placement.start(self.grid, self.policy_cfg.replication)
            record = self.placement.ready(self.grid)
            if record is not None:
                await self.availability.call(self.grid.use_copies, record["copies"])
                self.placement.switched(record, self.stats.iterations)
                log.info("serving placement: switched to copies %s (balancedness %s -> %s, %d bytes fetched)",
                         record["copies"], record["balancedness_before"], record["balancedness_after"],
                         record["bytes_moved"])
        except GridLost:  # the switch is void with the grid it was for; the loss is an incident of its own
            pass
        except Exception as err:  # noqa: BLE001 - placement and policies are optimisations: serving goes on
            log.exception("serving: applying policies or a placement move failed")
            self.incidents.record("placement_failed", action="kept the placement", why=f"{type(err).__name__}: {err}")

    def boundary_due(self) -> bool:
        """Whether a boundary is wanted: a policy change is queued, a placement move is to be decided or its copies
        arrived."""
        return bool(self.live.pending or self.placement.decide_next or self.placement.fetched)

    def load_due(self, iteration: int) -> bool:
        """Whether the workers' expert load should be collected after `iteration` (for `observe_load`)."""
        return self.placement.due(iteration, self.policy_cfg.replication)

    def observe_load(self, loads: list[dict]) -> None:
        """The workers' routed-token counts since the last call: a placement move is decided from them next."""
        self.placement.observe(loads, self.policy_cfg.replication)

    def view(self) -> dict:
        """Per-expert load, homes, copies, rank loads, balancedness, moves (k3ray.serve.placement)."""
        return self.placement.view(self.grid)

    def policies(self, name: str | None = None) -> dict:
        """The live policies (changes waiting for the next iteration on top); KeyError for an unknown name."""
        return self.live.get(name)

    def set_policy(self, name: str, params: dict, source: str) -> dict:
        """Validate a change to one policy and apply it at the next iteration (audited): {'policy', 'value',
        'applies_at_step'}; KeyError for an unknown policy, ValueError naming the field for a bad value (nothing
        changes then)."""
        return self.live.set(name, params, source, self.stats.iterations)

    def audit(self) -> list[dict]:
        return self.live.audit_log()

    def rebalance(self) -> None:
        """Decide a placement move from the load after the next iteration instead of waiting for
        replication.every_n_steps (with replication enabled)."""
        self.placement.ask()

    async def scale(self, ep: int) -> dict:
        """Resize the grid to pp x ep: launched beside the serving grid from the held weights while iterations go on
        (`ServingGrid.launch_beside`), then adopted between two iterations; where both do not fit, the grid is
        relaunched at the new size (serving pauses meanwhile). Every unfinished request is prefilled again on the
        new grid, as after a loss: none dropped, outputs unchanged. The incident's fields; ValueError for an ep below
        1, Refused(409) where the grid cannot take that size (nothing changes), Refused(500) where the launch failed
        (a relaunch that fails goes the failure path, `Availability.restore`, before the refusal)."""
        if not isinstance(ep, int) or ep < 1:
            raise ValueError(f"ep: must be a whole number >= 1, got {ep!r}")
        if ep == self.grid.ep:
            return {"ep": [ep, ep], "action": "none"}
        t0 = time.perf_counter()
        try:
            beside = await asyncio.to_thread(self.grid.launch_beside, ep)
        except TopologyError as err:
            raise Refused(409, str(err)) from None
        except Exception as err:  # noqa: BLE001 - the serving grid is untouched: say why and serve on
            raise Refused(500, f"launching ep={ep} failed: {type(err).__name__}: {err}") from None
        async with self.between_iterations:
            if beside is not None:
                fields = self.grid.adopt(*beside)
            else:
                try:
                    fields = await asyncio.to_thread(self.grid.resize, ep)
                except Exception as err:  # noqa: BLE001 - the old grid is gone: serve again, whatever it takes
                    await self.availability.restore(None, f"scaling to ep={ep} failed: {type(err).__name__}: {err}")
                    raise Refused(500, f"scaling to ep={ep} failed ({type(err).__name__}: {err}); serving on ep="
                                       f"{self.grid.ep}") from None
            fields["requeued"] = len(self.sched.reset(self.grid.ep))
            if self.sched.prefix is not None:
                fields["prefix_cache"] = "cold: the new grid's caches start empty"
            fields["seconds"]["total"] = time.perf_counter() - t0
            self.incidents.record("scaled", **fields)
            log.warning("serving: scaled to pp=%d x ep=%d (%s) in %.2fs, %d requests to prefill again", self.grid.pp,
                        self.grid.ep, fields["action"], fields["seconds"]["total"], fields["requeued"])
        return fields
