"""The serving engine's fakes, without Ray: `FakeGrid`, ServingGrid's interface on one process (the tiny model run by
`LocalExecutor`) that loses workers, fails recoveries and relaunches on command; the pools a grid launches
(`sizes`); and a few requests with their reference tokens (`PROMPTS`, `params`, `reference`, `collect`, `tokens`)
under the serving settings `SERVE`."""
from __future__ import annotations

import asyncio
import time

from k3ray.data import EOS, encode
from k3ray.grid.calls import TopologyError, WorkerLost
from k3ray.model.sampling import SamplingParams, visible_ids
from k3ray.parallel.reference import generate_reference
from k3ray.parallel.serving import LocalExecutor, PoolSizes
from k3ray.serve.engine import Engine
from k3ray.serve.prefix_cache import prefix_sizes

PROMPTS = ["def ", "import os\n", "class A:\n    def f(self", "x = "]
SERVE = {"page_size": 4, "pages_per_rank": 64, "slots_per_rank": 6, "token_budget": 16, "max_tokens": 32,
         "recovery_attempts": 2, "recovery_backoff_s": 0.01, "unavailable_wait_s": 20.0, "retry_after_s": 3}


class FakeGrid:
    """ServingGrid's interface on one process: `lose_at` iterations raise WorkerLost; the first `recover_fails`
    recoveries and `relaunch_fails` relaunches raise TopologyError, after the phases they report (PHASES); a
    relaunch waits for `gate` (when set). Every grid rebuilt has new, empty caches."""
    PHASES = ("replan", "place_and_start_workers", "process_groups", "restore")
    pp, ep = 1, 1

    def __init__(self, model, sizes: PoolSizes, lose_at=(), recover_fails=0, relaunch_fails=0):
        self.model, self.sizes = model, sizes
        self.executor = LocalExecutor(model, sizes)
        self.lose_at, self.recover_fails, self.relaunch_fails = set(lose_at), recover_fails, relaunch_fails
        self.iterations, self.calls, self.gate, self.fail_at = 0, [], None, set()
        self.group = type("Group", (), {"workers": [None], "home": [0] * model.cfg.n_experts, "generation": 1})()
        self.group.resources = self  # the group's held resources (`top_up_spares`): this fake plays them itself

    def run(self, plans):
        self.iterations += 1
        if self.iterations in self.lose_at:
            raise WorkerLost({0}, "ActorDiedError in serve_step")
        if self.iterations in self.fail_at:
            raise RuntimeError("gloo: connection closed by peer")
        return self.executor.run(plans)

    def submit(self, plans):
        return plans  # run at `collect`: iterations are collected in the order submitted, as the workers run them

    def collect(self, plans):
        return self.run(plans)

    def recover(self, lost, progress):
        self.calls.append("recover")
        for phase in self.PHASES:
            progress(phase)
        if self.calls.count("recover") <= self.recover_fails:
            raise TopologyError(f"{lost}: the alive nodes hold no 1-stage grid")
        self.executor = LocalExecutor(self.model, self.sizes)
        return {"ep": [1, 1], "action": "restart"}

    def relaunch(self, progress):
        self.calls.append("relaunch")
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.calls.count("relaunch") <= self.relaunch_fails:
            raise TopologyError("the alive nodes hold no 1-stage grid (0 workers)")
        self.executor = LocalExecutor(self.model, self.sizes)
        return {"ep": [1, 1], "action": "relaunch"}

    def expert_load(self):
        time.sleep(0.5)
        return []

    def top_up_spares(self):
        return 0

    def close(self):
        pass


def sizes(cfg) -> PoolSizes:
    """The workers' pools as a grid launches them (the prefix cache's checkpoints included)."""
    prefix = prefix_sizes(cfg.serve.resolved("cpu"), cfg.model)
    return PoolSizes(cfg.serve.pages_per_rank, cfg.serve.page_size, cfg.serve.slots_per_rank,
                     0 if prefix is None else prefix.checkpoints)


def params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=12 + 2 * i, temperature=0.0 if i % 2 else 0.7, seed=11 + i)


def reference(model, i: int) -> list[int]:
    sp = params(i)
    return visible_ids(generate_reference(model, encode(PROMPTS[i]), sp)[0], sp, EOS)


async def collect(engine: Engine, i: int, timeout_s: float = 60.0) -> list[dict]:
    """One request's stream items; a stream that hangs fails the test."""
    async def run():
        return [item async for item in engine.generate(encode(PROMPTS[i]), params(i))]
    return await asyncio.wait_for(run(), timeout_s)


def tokens(items: list[dict]) -> list[int]:
    return [t for item in items for t in item.get("tokens", ())]
