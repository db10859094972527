"""The serving engine on the worker grid: a Ray actor that owns the scheduler (k3ray.controller.scheduler) and drives
the same Worker actors as training (their stages, expert shards and EP exchange, with cache pools added).

Loading: the newest verified durable checkpoint, merged out of its grid (`serving_weights`), then restored onto
the serving grid's pp x ep like a resume (each worker keeps its stage's names and the experts homed on it).

Requests stream: `generate` is an async generator (a Ray streaming call); its first item says whether the request
was accepted, then one item per iteration in which it got tokens, the last one with the finish reason. Cancelling
the call (a client that went away) cancels the request and frees its pages and slot. The iteration loop runs while
there is work: schedule, every worker's `serve_step` (the last stage's answers are the logits), complete.
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray

from k3ray.config import JobConfig
from k3ray.controller.checkpointing import serving_weights
from k3ray.controller.scheduler import EngineLimits, Overloaded, Scheduler
from k3ray.controller.worker_group import WorkerGroup
from k3ray.data import EOS
from k3ray.model.sampling import SamplingParams, visible_ids
from k3ray.parallel.serving import PoolSizes
from k3ray.policies import recovery

log = logging.getLogger("k3ray.serve")


def serving_config(train_config: dict, pp: int, ep: int, overrides: dict | None = None) -> JobConfig:
    """The training job's config on the serving grid (pp x ep), with `serve.*` overrides (a `serve` section the
    checkpoint carries is the training job's default, not a serving choice: it is dropped)."""
    cfg = JobConfig.model_validate({k: v for k, v in train_config.items() if k != "serve"})
    par = cfg.parallel.model_copy(update={"pp": pp, "ep": ep})
    serve = cfg.serve.model_copy(update=overrides or {})
    return JobConfig.model_validate({**cfg.model_dump(), "parallel": par.model_dump(), "serve": serve.model_dump()})


class GridExecutor:
    """One iteration on the grid: worker (p, e) gets rank e's plan; the logits come from the last stage."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def submit(self, plans: dict) -> dict[int, ray.ObjectRef]:
        g = self.group
        refs = [w.serve_step.remote(plans[r % g.ep]) for r, w in enumerate(g.workers)]
        return {e: refs[(g.pp - 1) * g.ep + e] for e in range(g.ep)}


@ray.remote
class ServingEngine:
    def __init__(self, checkpoint: str, pp: int, ep: int, serve_overrides: dict | None = None,
                 launch_timeout_s: float = 300.0, observers: list | None = None):
        weights = serving_weights(checkpoint)
        self.cfg = cfg = serving_config(weights.config, pp, ep, serve_overrides)
        self.model_name, self.step = cfg.name, weights.step
        sc = cfg.serve
        sizes = PoolSizes(sc.pages_per_rank, sc.page_size, sc.slots_per_rank)
        self.sched = Scheduler(EngineLimits(cfg.model.max_seq_len, ep, sc.token_budget, sc.max_waiting, sizes))
        self.group = WorkerGroup(cfg, ep, recovery.grow(cfg.model.n_experts, ep).tolist())
        ref = ray.put(weights.state)  # once: every worker reads its part of the same object
        self.group.launch(launch_timeout_s, restore={p: [ref] for p in range(pp)})
        self.group.call("serve_init", sizes.pages, sizes.page_size, sizes.slots)
        self.executor = GridExecutor(self.group)
        self.wake: asyncio.Event | None = None
        self.updates: dict[int, asyncio.Event] = {}
        self.loop_task: asyncio.Task | None = None
        self.iterations, self.tokens_out, self.started = 0, 0, time.time()
        # observers.iteration(changed requests, scheduler, seconds) after every iteration, .expert_load(workers'
        # counts) every .expert_load_every iterations: metrics (k3ray.control.serve_metrics)
        self.observers: list = observers or []
        log.info("serving %s step %d from %s on pp=%d x ep=%d", cfg.name, weights.step, weights.path, pp, ep)

    def ready(self) -> dict:
        return {"model": self.model_name, "step": self.step, "pp": self.group.pp, "ep": self.group.ep,
                "max_seq_len": self.cfg.model.max_seq_len, "serve": self.cfg.serve.model_dump()}

    def stats(self) -> dict:
        return {**self.sched.usage(), "iterations": self.iterations, "tokens_out": self.tokens_out,
                "uptime_s": time.time() - self.started}

    async def generate(self, prompt: list[int], params: dict):
        """Stream a request: {'accepted': id} or {'error': 'overloaded' | 'invalid', 'message'}, then items
        {'tokens': new visible token ids, 'finish': None | 'stop' | 'length'}, or {'error': 'internal', ...}."""
        sp = SamplingParams(**{**params, "stop": tuple(params.get("stop") or ())})
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
        sent = 0
        try:
            yield {"accepted": req.id}
            while True:
                await event.wait()
                event.clear()
                # hold back what a stop string might still cut, until the request ends
                ids = visible_ids(req.out, sp, EOS)
                hold = 0 if req.done else max((len(s.encode()) - 1 for s in sp.stop), default=0)
                upto = max(sent, len(ids) - hold)
                if req.finish == "error":
                    yield {"error": "internal", "message": req.error}
                    return
                if upto > sent or req.done:
                    yield {"tokens": ids[sent:upto], "finish": req.finish}
                    sent = upto
                if req.done:
                    return
        finally:  # also when the caller cancels the stream: the request ends and its caches are freed
            self.sched.cancel(req.id)
            self.sched.forget(req.id)
            self.updates.pop(req.id, None)

    def _ensure_loop(self) -> None:
        if self.wake is None:
            self.wake = asyncio.Event()
        self.wake.set()
        if self.loop_task is None or self.loop_task.done():
            self.loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            if not self.sched.has_work:
                self.wake.clear()
                await self.wake.wait()
                continue
            t0 = time.perf_counter()
            plans = self.sched.schedule()
            try:
                refs = self.executor.submit({r: p for r, (p, _) in plans.items()})
                logits = dict(zip(refs, await asyncio.gather(*refs.values())))
            except Exception as err:  # noqa: BLE001 - whatever failed, no request may wait forever
                log.exception("serving iteration failed")
                changed = self.sched.fail_all(f"the iteration failed: {type(err).__name__}: {err}")
            else:
                changed = self.sched.complete(plans, logits)
            self.iterations += 1
            self.tokens_out += sum(1 for r in changed if r.finish != "cancelled")
            for req in changed:
                if req.id in self.updates:
                    self.updates[req.id].set()
            for observer in self.observers:
                observer.iteration(changed, self.sched, time.perf_counter() - t0)
            if self.observers and self.iterations % self.observers[0].expert_load_every == 0:
                loads = await asyncio.gather(*(w.expert_load.remote() for w in self.group.workers))
                for observer in self.observers:
                    observer.expert_load(loads)

    def expert_load(self) -> list[dict]:
        return self.group.call("expert_load")

    def shutdown(self) -> bool:
        self.group.close()
        return True
