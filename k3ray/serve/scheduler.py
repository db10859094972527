"""The serving engine's scheduler (Ray-free): the request table, iteration-level continuous batching with chunked
prefill under a token budget, and the allocation of KV pages and KDA state slots.

Every iteration, per data-parallel rank: first one token for each running request that is decoding, then the next
prompt chunk of requests still prefilling, then new requests admitted in arrival order, while the rank's token
budget lasts. A request is admitted onto the rank with the most free pages once that rank has a free state slot and
pages for its whole possible length (prompt + max_tokens, capped by the context): it then never waits for memory
mid-generation, and nothing is ever preempted. A request lives on one rank until it finishes; its pages and slot
return to the rank's free lists when it finishes or is cancelled.

Overlap (serve.overlap): the engine may schedule iteration n+1 while n runs. A request whose row in n samples a token
decodes on in n+1 with that token, unknown on the host: its row is flagged `from_device` (the workers take the token
their last stage sampled for the slot). Per request, `planned` counts the positions whose cache entries are scheduled
and `unconfirmed` the sampled tokens not yet back; `complete` of n confirms. A request never gets a row past what it
may generate (max_tokens, the context: known on the host); one that ends in n (end-of-text, stop string, guard trip,
cancel) while in n+1 has n+1's token dropped, and its slot and pages are freed once n+1 completes.

A request's state is its prompt and the tokens generated so far (`Request.ids`: confirmed tokens only); the caches
on the workers can be rebuilt from it by prefilling again (`reset`, after the grid holding them was lost, with any
iterations in flight: they are void): the next token then comes from the same logits, so greedy and seeded outputs
are those of an undisturbed run.

Prefill batching (`prefill_hold_s` > 0): while requests are decoding, prompt chunks are scheduled at most once per
hold, all that the budget takes then. A decode-only iteration replays a CUDA graph; one with any prompt chunk runs
eagerly, several times slower, so under a steady stream of arrivals (a new request nearly every iteration at high
concurrency) batching them keeps most iterations graphed, for a first token later by half the hold on average.
Without decoding requests, prompts start at once.

Stepwise prefill (`stepwise_prefill_max` > 0): a request whose prompt (with any output to prefill again) has at most
that many tokens is fed one token per iteration, as a decode row whose sampled token is dropped until the last one.
Every iteration of such requests is decode-shaped, so it replays a CUDA graph (a few ms at any batch) instead of
running eagerly; a short prompt's first token comes after as many iterations as it has tokens. The caches hold what
a chunk would leave (the same recurrence and attention, one position at a time: in float64 the outputs are the
reference's; in bf16 the rounding differs from a chunk's, as it does between chunks of other sizes).

Interface: `submit`, `cancel`, `schedule` -> plans by rank, `complete(plans, answers by rank)`; `step` runs both
with a synchronous executor (tests, the single-process engine).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace

from k3ray.config import GuardPolicy
from k3ray.model.cache import SeqAdmit
from k3ray.model.sampling import SamplingParams, finish_reason
from k3ray.parallel.serving import PoolSizes, RankPlan, StageOutput
from k3ray.policies import guards
from k3ray.tokenizer import ByteTokenizer, Detokenizer, Tokenizer


class Overloaded(RuntimeError):
    """The waiting queue is full; try again later."""


@dataclass
class EngineLimits:
    max_seq_len: int  # context length: prompt + generated tokens
    dp: int = 1  # data-parallel ranks (requests are spread over them)
    token_budget: int = 64  # tokens per iteration and rank (decode tokens + prefill chunks)
    max_waiting: int = 64  # queued requests (beyond those a free slot will take) past which submit is Overloaded
    pools: PoolSizes = field(default_factory=lambda: PoolSizes(pages=64, page_size=16, slots=16))
    guards: GuardPolicy = field(default_factory=GuardPolicy)  # a sequence that trips them fails alone
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)  # end-of-text, and the text stop strings are met in
    prefill_hold_s: float = 0.0  # while requests decode, prompt work waits up to this long to be batched (see doc)
    stepwise_prefill_max: int = 0  # prompts of at most this many tokens are fed one token per iteration (see doc)


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    arrival: float
    out: list[int] = field(default_factory=list)
    rank: int = -1
    pages: list[int] = field(default_factory=list)
    slot: int = -1
    cached: int = 0  # tokens of `ids` whose cache entries the workers hold
    planned: int = 0  # positions whose cache entries are scheduled: `cached` and those of iterations in flight
    unconfirmed: int = 0  # tokens sampled by iterations in flight, not yet appended to `out`
    in_flight: int = 0  # iterations in flight with a row of this request (its slot and pages stay taken)
    finish: str | None = None  # 'stop', 'length', 'cancelled', 'error'
    error: str = ""
    trip: guards.Trip | None = None  # the guard that stopped it (finish 'error')
    token_times: list[float] = field(default_factory=list)  # wall time of each generated token
    seed: int = 0  # the sampling noise's seed (the request's own, or drawn at submit)
    detok: Detokenizer | None = None  # the output as text, token by token: stop strings are checked on it
    text: str = ""  # the output text so far that is final (no half character, nothing a stop string may still cut)

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.out

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.out)

    def tokens(self, start: int, n: int) -> list[int]:
        """ids[start:start + n] without building ids (decode steps ask for the last token only)."""
        p = len(self.prompt)
        if start >= p:
            return self.out[start - p:start - p + n]
        return (self.prompt[start:start + n] + self.out[:max(0, start + n - p)])[:n]

    @property
    def done(self) -> bool:
        return self.finish is not None


class _RankPool:
    def __init__(self, sizes: PoolSizes):
        self.free_pages = list(range(sizes.pages))
        self.free_slots = list(range(sizes.slots))


class Scheduler:
    def __init__(self, limits: EngineLimits, clock=time.monotonic):
        self.limits, self.clock = limits, clock
        self.ranks = [_RankPool(limits.pools) for _ in range(limits.dp)]
        self.waiting: list[Request] = []
        self.running: dict[int, Request] = {}
        self.requests: dict[int, Request] = {}  # every request not yet forgotten (`forget`)
        self._ids = itertools.count()
        self.rank_tokens = [0] * limits.dp  # tokens each rank has run (prefill and decode), since the start
        self.last_prefill = -float("inf")  # when an iteration last took prompt work (`prefill_hold_s`)

    # -- requests ------------------------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams) -> Request:
        L = self.limits
        if not prompt:
            raise ValueError("prompt: empty")
        if len(prompt) >= L.max_seq_len:
            raise ValueError(f"prompt: {len(prompt)} tokens leave no room to generate in the context of "
                             f"{L.max_seq_len} tokens")
        if self._pages_for(len(prompt), params) > L.pools.pages:
            raise ValueError(f"max_tokens: prompt + max_tokens needs more KV pages than a rank has ({L.pools.pages})")
        free_slots = sum(len(p.free_slots) for p in self.ranks)  # admitted at the next iteration: not queued
        if len(self.waiting) >= L.max_waiting + free_slots:
            raise Overloaded(f"{len(self.waiting) - free_slots} requests waiting (limit {L.max_waiting})")
        req = Request(next(self._ids), list(prompt), params, self.clock(), seed=params.resolved_seed(),
                      detok=L.tokenizer.detokenizer(params.stop))
        self.waiting.append(req)
        self.requests[req.id] = req
        return req

    def cancel(self, rid: int) -> None:
        req = self.requests.get(rid)
        if req is None or req.done:
            return
        req.finish = "cancelled"
        if req in self.waiting:
            self.waiting.remove(req)
        elif req.in_flight == 0:  # else its caches are freed when the last iteration it is in completes
            self._release(req)

    def fail_all(self, message: str) -> list[Request]:
        """End every request with finish 'error' (an iteration failed: the caches may be inconsistent)."""
        failed = list(self.waiting) + [r for r in self.running.values() if not r.done]
        for req in failed:
            req.finish, req.error = "error", message
        for req in list(self.running.values()):  # also those that ended while an iteration held their caches
            self._release(req)
        self.waiting = []
        return failed

    def reset(self, dp: int) -> list[Request]:
        """The workers' caches are gone (a new grid of `dp` data-parallel ranks): every unfinished admitted request
        goes back to the head of the queue, in arrival order, to be prefilled again from its prompt and the tokens
        generated so far; its output so far stands. Returns the requeued requests."""
        requeued = sorted((r for r in self.running.values() if not r.done), key=lambda r: r.arrival)
        for req in requeued:
            req.rank, req.pages, req.slot = -1, [], -1
            req.cached = req.planned = req.unconfirmed = req.in_flight = 0  # the iterations in flight are void
        self.limits = replace(self.limits, dp=dp)
        self.ranks = [_RankPool(self.limits.pools) for _ in range(dp)]
        self.rank_tokens = (self.rank_tokens + [0] * dp)[:dp]
        self.running = {}
        self.waiting = requeued + self.waiting
        return requeued

    def forget(self, rid: int) -> None:
        self.requests.pop(rid, None)

    def _pages_for(self, prompt_len: int, params: SamplingParams) -> int:
        tokens = min(prompt_len + params.max_tokens, self.limits.max_seq_len)
        return -(-tokens // self.limits.pools.page_size)

    def _release(self, req: Request) -> None:
        pool = self.ranks[req.rank]
        pool.free_pages += req.pages
        pool.free_slots.append(req.slot)
        req.pages, req.slot, req.in_flight, req.unconfirmed = [], -1, 0, 0
        self.running.pop(req.id, None)

    # -- iterations ----------------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> dict[int, tuple[RankPlan, list[Request]]]:
        """This iteration's plan of every rank (also ranks with nothing to do: they join the EP exchanges). With an
        iteration in flight (overlap), its sampled tokens are taken on the workers (`RankPlan.from_device`)."""
        budget = [self.limits.token_budget] * self.limits.dp
        plans = {r: (RankPlan(), []) for r in range(self.limits.dp)}

        def add(req: Request, n: int) -> None:
            plan, reqs = plans[req.rank]
            from_device = req.planned >= req.length  # the token an iteration in flight samples for it
            plan.tokens += [0] if from_device else req.tokens(req.planned, n)
            plan.from_device.append(from_device)
            plan.slots.append(req.slot)
            plan.starts.append(req.planned)
            plan.counts.append(n)
            plan.counters.append(len(req.out) + req.unconfirmed)
            reqs.append(req)
            budget[req.rank] -= n
            self.rank_tokens[req.rank] += n
            req.planned += n
            req.in_flight += 1
            if req.planned == req.length + req.unconfirmed:  # the row reaches the end: it samples the next token
                req.unconfirmed += 1

        running = sorted((r for r in self.running.values() if self._may_continue(r)),
                         key=lambda r: (r.planned < len(r.prompt), r.arrival))
        now = self.clock()
        prefill = (now - self.last_prefill >= self.limits.prefill_hold_s
                   or not any(r.length + r.unconfirmed - r.planned == 1 for r in running))
        eager = False  # whether this iteration holds a prompt chunk (more than one token of a request)
        for req in running:  # decoding first (one token each), then prompt chunks
            n = min(req.length + req.unconfirmed - req.planned, budget[req.rank])
            if n > 1 and self._stepwise(req):
                n = 1
            if n == 1 or n > 1 and prefill:
                add(req, n)
                eager |= n > 1
        while self.waiting:
            req = self.waiting[0]
            stepwise = self._stepwise(req)
            if not (prefill or stepwise):
                break
            rank = self._admit_rank(req)
            if rank is None or budget[rank] <= 0:
                break
            self.waiting.pop(0)
            pool = self.ranks[rank]
            need = self._pages_for(len(req.prompt), req.params)
            req.rank, req.slot = rank, pool.free_slots.pop(0)
            req.pages, pool.free_pages = pool.free_pages[:need], pool.free_pages[need:]
            self.running[req.id] = req
            p = req.params
            plans[rank][0].admit.append(SeqAdmit(req.slot, req.pages, p.temperature, p.top_p, req.seed))
            n = 1 if stepwise else min(req.length, budget[rank])  # a requeued request re-prefills its output too
            add(req, n)
            eager |= not stepwise
        if eager:
            self.last_prefill = now
        for plan, reqs in plans.values():
            plan.greedy = all(r.params.temperature == 0 for r in reqs)
        return plans

    def _stepwise(self, req: Request) -> bool:
        """Whether `req`'s prompt (and output, after a `reset`) is fed one token per iteration."""
        return req.length <= self.limits.stepwise_prefill_max

    def _may_continue(self, req: Request) -> bool:
        """Whether `req` may get a row now: not ended, and the tokens in flight leave it room to generate another
        (max_tokens and the context are known on the host; end-of-text and stop strings are not)."""
        return (not req.done and len(req.out) + req.unconfirmed < req.params.max_tokens
                and req.length + req.unconfirmed < self.limits.max_seq_len)

    def _admit_rank(self, req: Request) -> int | None:
        need = self._pages_for(len(req.prompt), req.params)
        fits = [r for r, p in enumerate(self.ranks) if p.free_slots and len(p.free_pages) >= need]
        return max(fits, key=lambda r: len(self.ranks[r].free_pages)) if fits else None

    def complete(self, plans: dict[int, tuple[RankPlan, list[Request]]], outputs: dict[int, StageOutput]
                 ) -> list[Request]:
        """Take an iteration's answers (rank -> StageOutput: next tokens [N] and max-abs [N], one per sequence of
        the plan): a sequence that tripped the guards fails alone (finish 'error', `trip` set); where a sequence
        reached its last known token, its sampled token is appended; finish what ended, and free it once no iteration
        in flight holds it (overlap: the next one's row of a request that ended is dropped). Iterations complete in
        the order they were scheduled. Returns the requests that got a token or finished."""
        now, changed = self.clock(), []
        for rank, (plan, reqs) in plans.items():
            out = outputs[rank]
            trips = guards.check_sequences(out.maxabs, self.limits.guards)
            for row, (n, req) in enumerate(zip(plan.counts, reqs)):
                req.cached += n
                req.in_flight -= 1
                if req.done:  # cancelled while in flight, or ended by the iteration before (its token dropped)
                    if req.in_flight == 0:
                        self._release(req)
                        if req.finish == "cancelled":
                            changed.append(req)
                    continue
                if row in trips:
                    trip = trips[row]
                    req.finish, req.trip = "error", trip
                    req.error = (f"stopped: this request's activations blew up ({trip.rule} {trip.detail}: "
                                 f"{trip.value:g}); other requests are unaffected")
                    if req.in_flight == 0:
                        self._release(req)
                    changed.append(req)
                    continue
                if req.cached < req.length:
                    continue  # a prompt chunk short of the end: nothing to sample yet
                req.unconfirmed -= 1
                req.out.append(out.tokens[row])
                req.token_times.append(now)
                req.text += req.detok.push(req.out[-1:])
                req.finish = finish_reason(req.out, req.params, self.limits.tokenizer.eos_id,
                                           self.limits.max_seq_len - req.length, req.detok)
                if req.done:
                    req.text += req.detok.push([], final=True)
                    if req.in_flight == 0:
                        self._release(req)
                changed.append(req)
        return changed

    def step(self, executor) -> list[Request]:
        """One iteration with a synchronous executor: executor.run({rank: RankPlan}) -> {rank: StageOutput}."""
        plans = self.schedule()
        return self.complete(plans, executor.run({r: p for r, (p, _) in plans.items()}))

    # -- what it holds -------------------------------------------------------------------------------------------
    def usage(self) -> dict:
        L = self.limits.pools
        return {"waiting": len(self.waiting), "running": len(self.running),
                "pages_used": sum(L.pages - len(p.free_pages) for p in self.ranks),
                "pages_total": L.pages * self.limits.dp,
                "slots_used": sum(L.slots - len(p.free_slots) for p in self.ranks),
                "tokens_per_rank": list(self.rank_tokens)}
