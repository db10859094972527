"""The serving engine on the worker grid: a Ray actor that owns the scheduler (k3ray.controller.scheduler) and drives
the same Worker actors as training (their stages, expert shards and EP exchange, with cache pools added).

Loading: the newest verified durable checkpoint, merged out of its grid (`serving_weights`), then restored onto
the serving grid's pp x ep like a resume (each worker keeps its stage's names and the experts homed on it).

Requests stream: `generate` is an async generator (a Ray streaming call); its first item says whether the request
was accepted, then one item per iteration in which it got tokens, the last one with the finish reason. Cancelling
the call (a client that went away) cancels the request and frees its pages and slot. The iteration loop runs while
there is work: schedule, every worker's `serve_step` (the last stage's answers are the logits), complete.

Lost workers (k3ray.controller.serve_grid): the grid is rebuilt from the weights the engine holds and every
unfinished request is prefilled again from its prompt and the tokens generated so far; its stream goes on from the
next token, none lost or repeated. Each loss is an incident (`incident_log`), with its phases and the serving gap
(the loss found -> the next token of any request).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time

import ray

from k3ray.config import JobConfig
from k3ray.controller.checkpointing import serving_weights
from k3ray.controller.drills import clear, inject
from k3ray.controller.scheduler import EngineLimits, Overloaded, Scheduler
from k3ray.controller.serve_grid import ServingGrid
from k3ray.controller.worker_group import WorkerLost
from k3ray.model.sampling import SamplingParams
from k3ray.parallel.serving import PoolSizes
from k3ray.tokenizer import load_tokenizer

log = logging.getLogger("k3ray.serve")


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


@ray.remote
class ServingEngine:
    def __init__(self, checkpoint: str, pp: int, ep: int, serve_overrides: dict | None = None,
                 launch_timeout_s: float = 300.0, observers: list | None = None, spares: int = 0):
        weights = serving_weights(checkpoint)
        self.cfg = cfg = serving_config(weights.config, pp, ep, serve_overrides, spares)
        self.model_name, self.step = cfg.name, weights.step
        sc = cfg.serve
        sizes = PoolSizes(sc.pages_per_rank, sc.page_size, sc.slots_per_rank)
        self.sched = Scheduler(EngineLimits(cfg.model.max_seq_len, ep, sc.token_budget, sc.max_waiting, sizes,
                                            cfg.policies.guards, load_tokenizer(cfg.data.tokenizer)))
        self.grid = ServingGrid(cfg, weights.state, sizes, launch_timeout_s)
        self.grid.launch(ep)
        self.incidents: list[dict] = []
        self.gap_from: tuple[dict, float] | None = None  # (incident, when the loss was found) until the next token
        self.wake: asyncio.Event | None = None
        self.updates: dict[int, asyncio.Event] = {}
        self.loop_task: asyncio.Task | None = None
        self.iterations, self.tokens_out, self.started = 0, 0, time.time()
        # observers.iteration(changed requests, scheduler, seconds) after every iteration, .expert_load(workers'
        # counts) every .expert_load_every iterations: metrics (k3ray.control.serve_metrics)
        self.observers: list = observers or []
        log.info("serving %s step %d from %s on pp=%d x ep=%d", cfg.name, weights.step, weights.path, pp, ep)

    def ready(self) -> dict:
        return {"model": self.model_name, "step": self.step, "pp": self.grid.pp, "ep": self.grid.ep,
                "max_seq_len": self.cfg.model.max_seq_len, "serve": self.cfg.serve.model_dump(),
                "tokenizer": self.cfg.data.tokenizer}

    def stats(self) -> dict:
        return {**self.sched.usage(), "iterations": self.iterations, "tokens_out": self.tokens_out,
                "uptime_s": time.time() - self.started, "pp": self.grid.pp, "ep": self.grid.ep,
                "incidents": len(self.incidents)}

    async def generate(self, prompt: list[int], params: dict):
        """Stream a request: {'accepted': id} or {'error': 'overloaded' | 'invalid', 'message'}, then items
        {'text': new final text, 'tokens': the token ids it came from, 'finish': None | 'stop' | 'length'}, or
        {'error': 'internal', ...}. The text never ends inside a character nor in what a stop string may still cut
        (the request's detokenizer holds that back)."""
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
        sent, sent_text = 0, 0
        try:
            yield {"accepted": req.id}
            while True:
                await event.wait()
                event.clear()
                if req.finish == "error":
                    yield {"error": "internal", "message": req.error}
                    return
                upto = req.detok.tokens  # ids taken into the text: without end-of-text and what follows a stop
                if len(req.text) > sent_text or req.done:
                    yield {"text": req.text[sent_text:], "tokens": req.out[sent:upto], "finish": req.finish}
                    sent, sent_text = upto, len(req.text)
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
                outputs = await self._on_grid(self.grid.run, {r: p for r, (p, _) in plans.items()})
            except Exception as err:  # noqa: BLE001 - whatever failed, no request may wait forever
                log.exception("serving iteration failed")
                changed = self.sched.fail_all(f"the iteration failed: {type(err).__name__}: {err}")
                self._incident("iteration_failed", action="failed every request", requests=len(changed),
                               why=f"{type(err).__name__}: {err}")
            else:
                changed = [] if outputs is None else self.sched.complete(plans, outputs)
            for req in changed:
                if req.trip is not None:
                    log.warning("serving: request %d stopped by the guards (%s %s: %g)", req.id, req.trip.rule,
                                req.trip.detail, req.trip.value)
                    value = req.trip.value if math.isfinite(req.trip.value) else str(req.trip.value)  # JSON-able
                    self._incident("blowup", action="failed the request", request=req.id, rule=req.trip.rule,
                                   value=value, detail=req.trip.detail)
            self.iterations += 1
            got_token = [r for r in changed if r.finish not in ("cancelled", "error")]
            self.tokens_out += len(got_token)
            if got_token and self.gap_from is not None:  # the serving gap: the loss found -> the next token
                incident, t_found = self.gap_from
                incident["seconds"]["to_next_token"] = time.perf_counter() - t_found
                self.gap_from = None
            for req in changed:
                if req.id in self.updates:
                    self.updates[req.id].set()
            for observer in self.observers:
                observer.iteration(changed, self.sched, time.perf_counter() - t0)
            if self.observers and self.iterations % self.observers[0].expert_load_every == 0:
                try:
                    loads = await self._on_grid(self.grid.expert_load)
                except Exception:  # noqa: BLE001 - a failed recovery: the next iteration fails what is running
                    log.exception("collecting the expert load failed")
                    loads = None
                for observer in self.observers if loads is not None else ():
                    observer.expert_load(loads)

    async def _on_grid(self, fn, *args):
        """fn(*args) off the event loop (requests keep arriving and leaving meanwhile). None when workers were lost:
        the grid is then rebuilt and every unfinished request requeued, to be prefilled again (no request fails)."""
        try:
            return await asyncio.to_thread(fn, *args)
        except WorkerLost as lost:
            t0 = time.perf_counter()
            incident = self._incident("worker_lost", requests=len(self.sched.running), ranks=sorted(lost.ranks))
            try:
                incident.update(await asyncio.to_thread(self.grid.recover, lost))
            except Exception as err:
                incident["outcome"] = f"not recovered: {type(err).__name__}: {err}"
                raise
            incident["requeued"] = len(self.sched.reset(self.grid.ep))
            self.gap_from = (incident, t0)
            log.warning("serving: recovered on pp=%d x ep=%d in %.2fs, %d requests to prefill again", self.grid.pp,
                        self.grid.ep, time.perf_counter() - t0, incident["requeued"])
            return None

    def _incident(self, kind: str, **fields) -> dict:
        """Record an incident (`incident_log`: the front door's /v1/incidents, `k3ray incidents --serve`)."""
        incident = {"time": time.time(), "kind": kind, "iteration": self.iterations, **fields}
        self.incidents.append(incident)
        return incident

    def incident_log(self) -> list[dict]:
        return list(self.incidents)

    def expert_load(self) -> list[dict]:
        return self.grid.expert_load()

    def drill(self, kind: str, workers: list[int] = (), layer: int | None = None, token: int | None = None) -> bool:
        """Inject a fault into the grid now (k3ray.controller.drills.inject); kind 'clear' removes the NaN hooks."""
        if kind == "clear":
            clear(self.grid.group)
        else:
            inject(self.grid.group, kind, list(workers), layer, token)
        return True

    def shutdown(self) -> bool:
        self.grid.close()
        return True
