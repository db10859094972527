"""The serving engine's scheduler (Ray-free): the request table, iteration-level continuous batching with chunked
prefill under a token budget, and the allocation of KV pages and KDA state slots.

Every iteration, per data-parallel rank, while the rank's token budget (serve.token_budget) lasts: one token for
each running request that is decoding, then the next prompt chunks of requests still prefilling, oldest first, then
new requests admitted in arrival order: several prompts share an iteration, and none waits for a time to pass. With
serve.iteration_target_ms the prompt chunks of an iteration hold at most the tokens that keep it near that
length, as measured on the iterations before (`IterationPacer`): a long prompt never stalls the decoding streams for
more than about one target. A
request is admitted onto the rank with the most free pages that has a free state slot and pages for its first chunk
(keeping one page per running request of the rank in reserve, so that decoding rarely preempts). A request lives on
one rank until it finishes or is preempted; its pages and slot return to the rank's free lists then.

Pages are allocated on demand, as a request's scheduled positions reach a new page (`RankPlan.grow` tells the
workers). Where a rank's free pages run out, the newest running requests of the rank not yet scheduled in this
iteration are preempted by recompute: their pages and slot go back, and they are requeued (in arrival order) to be
prefilled again from prompt + generated tokens; the stream goes on with no token lost or repeated (the next token
comes from the same logits and the same sampling counter). A prompt chunk that finds too few pages is cut to those
there are; a decoding request that finds none and can preempt nobody newer is preempted itself.

Overlap (serve.overlap): the engine may schedule iteration n+1 while n runs. A request whose row in n samples a token
decodes on in n+1 with that token, unknown on the host: its row is flagged `from_device` (the workers take the token
their last stage sampled for the slot). Per request, `planned` counts the positions whose cache entries are scheduled
and `unconfirmed` the sampled tokens not yet back; `complete` of n confirms. A request never gets a row past what it
may generate (max_tokens, the context: known on the host); one that ends in n (end-of-text, stop string, guard trip,
cancel) while in n+1 has n+1's token dropped, and its slot and pages are freed once n+1 completes. A request
preempted while an iteration in flight holds its caches starts a new incarnation (`Request.epoch`): the rows of the
old one are void when they complete, and its old pages and slot return only then (`_Held`).

A request's state is its prompt and the tokens generated so far (`Request.ids`: confirmed tokens only); the caches
on the workers can be rebuilt from it by prefilling again (`reset`, after the grid holding them was lost, with any
iterations in flight: they are void): the next token then comes from the same logits, so greedy and seeded outputs
are those of an undisturbed run.

Stepwise prefill (`stepwise_prefill_max` > 0): a request whose prompt (with any output to prefill again) has at most
that many tokens is fed one token per iteration, as a decode row whose sampled token is dropped until the last one.
Every iteration of such requests is decode-shaped, so it replays a CUDA graph (a few ms at any batch) instead of
running eagerly; a short prompt's first token comes after as many iterations as it has tokens. The caches hold what
a chunk would leave (the same recurrence and attention, one position at a time: in float64 the outputs are the
reference's; in bf16 the rounding differs from a chunk's, as it does between chunks of other sizes). So is a run
of output a grammar forces (jump-forward: written at once, none of it sampled) no longer than its rank's rows, in an
iteration that decodes only; in an iteration that runs eagerly anyway it is fed whole (k3ray.serve.feeding).

Interface: `submit`, `schedule` -> SchedulerOutput, `complete(output, answers by rank)`; `step` runs both with a
synchronous executor (tests, the single-process engine); `reset` after a lost grid. The requests themselves, and
`cancel`, `forget` and `fail_all`, are in its request table (`Scheduler.table`, k3ray.serve.request_table), and
what the requests hit in and offer to the prefix cache in its books on it (`Scheduler.request_prefixes`,
k3ray.serve.request_prefixes). Sizes come from serve.* (ServeConfig, resolved for the device: `ServeConfig.resolved`).
"""
from __future__ import annotations

import itertools
import time

from k3ray.config import GuardPolicy, ServeConfig
from k3ray.config.serve import PROMPT_TOKENS_FLOOR
from k3ray.model.cache import SeqAdmit, SeqPages
from k3ray.model.sampling import GrammarRow, SamplingParams, finish_reason
from k3ray.parallel.serving import StageOutput
from k3ray.policies import guards
from k3ray.serve.cache_allocator import CacheAllocator
from k3ray.serve.feeding import eager_ranks, forced_only, stepwise
from k3ray.serve.grammar import GrammarBooks, RequestLogits, needs_logits
from k3ray.serve.pacing import IterationPacer, paced_chunk
from k3ray.serve.prefix_cache import Hit, PrefixSizes
from k3ray.serve.request_prefixes import RequestPrefixes
from k3ray.serve.request_table import RequestTable
from k3ray.serve.scheduler_output import RankBatch, Request, SchedulerOutput
from k3ray.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["Overloaded", "RankBatch", "Request", "Scheduler", "SchedulerOutput"]


class Overloaded(RuntimeError):
    """The waiting queue is full; try again later."""


class Scheduler:
    """serve: the serving config, its sizes resolved (`ServeConfig.resolved`); dp: data-parallel ranks (requests
    are spread over them); guards: a sequence that trips them fails alone; tokenizer: end-of-text, and the text stop
    strings are met in; prefix: the prefix cache's sizes (k3ray.serve.prefix_cache.prefix_sizes; None: off)."""

    def __init__(self, serve: ServeConfig, max_seq_len: int, dp: int = 1, guards: GuardPolicy | None = None,
                 tokenizer: Tokenizer | None = None, clock=time.monotonic, prefix: PrefixSizes | None = None):
        unset = [k for k in ("pages_per_rank", "slots_per_rank", "token_budget") if getattr(serve, k) is None]
        if unset:
            raise ValueError(f"serve.{unset[0]} is unset: resolve the serving config for the device first")
        self.serve, self.max_seq_len, self.dp, self.clock, self.prefix = serve, max_seq_len, dp, clock, prefix
        self.guards = guards or GuardPolicy()
        self.tokenizer = tokenizer or ByteTokenizer()
        self.table = RequestTable(CacheAllocator(serve, dp, prefix))
        # the prefix cache's hits, checkpoints and offers per request (None: the cache is off)
        self.request_prefixes = None if prefix is None else RequestPrefixes(serve.page_size, prefix.every, self.table)
        target = serve.iteration_target_ms
        self.pacer = IterationPacer(None if target is None else target / 1e3, serve.token_budget, PROMPT_TOKENS_FLOOR)
        self._ids = itertools.count()
        self.rank_tokens = [0] * dp  # tokens each rank has run (prefill and decode), since the start
        self.grammar_books: list[GrammarBooks] = []  # what each rank's last stage holds of grammars
        self.forget_grammars()

    # -- requests ------------------------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, grammar=None) -> Request:
        """A new request; `grammar`: its params.grammar compiled (k3ray.serve.grammar.Grammars.compile)."""
        s = self.serve
        if not prompt:
            raise ValueError("prompt: empty")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"prompt: {len(prompt)} tokens leave no room to generate in the context of "
                             f"{self.max_seq_len} tokens")
        table = self.table
        if table.caches.pages(min(len(prompt) + params.max_tokens, self.max_seq_len)) > s.pages_per_rank:
            raise ValueError(f"max_tokens: prompt + max_tokens needs more KV pages than a rank has "
                             f"({s.pages_per_rank})")
        free_slots = table.caches.free_slots()  # admitted at the next iteration: not queued
        if len(table.waiting) >= s.max_waiting + free_slots:
            raise Overloaded(f"{len(table.waiting) - free_slots} requests waiting (limit {s.max_waiting})")
        req = Request(next(self._ids), list(prompt), params, self.clock(), seed=params.resolved_seed(),
                      detok=self.tokenizer.detokenizer(params.stop),
                      logits=RequestLogits(params, grammar) if needs_logits(params) else None)
        if req.logits is not None:
            req.logits.jump_forward()
            self._jump_forward(req)
        table.add(req)
        return req

    def _jump_forward(self, req: Request) -> None:
        """Jump-forward decoding: what `req`'s grammar forces next (`RequestLogits.forced`: at the output's start a
        tool call's markers, later a call's name and argument markers, a schema's keys) becomes its output at once,
        leaving room for one sampled token; none of it is sampled. At admission it is prefilled with the prompt;
        later it is fed one token an iteration or whole (k3ray.serve.feeding). A row of it in flight now (overlap)
        decodes the token after the last one known then, which is void: `req.length` passes the positions it
        fills, so `complete` takes no token from it. The last stage's matcher, which took that row's token,
        replays the output into a new matcher at the next row. Nothing for a request that ended or has no grammar."""
        if req.done or req.logits is None:
            return
        room = min(req.params.max_tokens - len(req.out), self.max_seq_len - req.length) - 1
        forced = req.logits.forced(self.tokenizer, room,
                                   (lambda ids: self._short_of_stop(req, ids)) if req.params.stop else None)
        if not forced:
            return
        req.out += forced
        req.text += req.detok.push(forced)
        req.unconfirmed = 0
        req.grammar_seated = False
        req.forced_end = req.length

    def _short_of_stop(self, req: Request, ids: list[int]) -> int:
        """How many of `ids`, following `req`'s output, complete none of its stop strings (all where none does): a
        probe detokenizer over the output's tail, long enough to hold any stop string (a token adds at least a
        byte, a character at most four)."""
        tail = 4 * max(len(s) for s in req.params.stop) + 4
        probe = self.tokenizer.detokenizer(req.params.stop)
        probe.push(req.out[-tail:])
        before = probe.tokens
        probe.push(ids)
        return max(probe.tokens - before - 1, 0) if probe.stopped else len(ids)

    def reset(self, dp: int) -> list[Request]:
        """The workers' caches are gone (a new grid of `dp` data-parallel ranks): every unfinished admitted request
        goes back to the head of the queue, in arrival order, to be prefilled again from its prompt and the tokens
        generated so far; its output so far stands. Returns the requeued requests."""
        self.dp = dp
        self.rank_tokens = (self.rank_tokens + [0] * dp)[:dp]
        self.forget_grammars()  # the new grid's workers hold none
        return self.table.requeue_all(CacheAllocator(self.serve, dp, self.prefix))

    def forget_grammars(self) -> None:
        """The books of what the ranks hold of the grammars start empty: after a new grid, or an iteration that
        failed (what its rows brought may never have reached the last stage); each grammar is sent again where next
        used (the last stage takes one it holds again as it is)."""
        self.grammar_books = [GrammarBooks() for _ in range(self.dp)]

    # -- iterations ----------------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.table.waiting or self.table.running)

    def schedule(self) -> SchedulerOutput:
        """This iteration: every decode row, then prompt chunks oldest first, then new requests, while each rank's
        token budget lasts; pages allocated as rows reach them, newer requests preempted where they run out. With
        an iteration in flight (overlap), its sampled tokens are taken on the workers (`RankPlan.from_device`)."""
        budget = [self.serve.token_budget] * self.dp
        prompt_budget = [self.pacer.prompt_allowance()] * self.dp  # tokens of chunks longer than one
        out = SchedulerOutput({r: RankBatch() for r in range(self.dp)})
        scheduled: set[int] = set()

        def add(req: Request, n: int) -> None:
            batch = out.ranks[req.rank]
            from_device = req.planned >= req.length  # the token an iteration in flight samples for it
            batch.add_row(req, n, from_device)
            scheduled.add(req.id)
            budget[req.rank] -= n
            if n > 1:
                prompt_budget[req.rank] -= n
            out.total_tokens += n
            self.rank_tokens[req.rank] += n
            if self.request_prefixes is not None:
                self.request_prefixes.checkpoint(req, n, batch, from_device)
            req.planned += n
            req.in_flight += 1
            if req.planned == req.length + req.unconfirmed:  # the row reaches the end: it samples the next token
                req.unconfirmed += 1
                if req.logits is not None:
                    batch.plan.logits.append(req.logits.row(len(batch.plan.slots) - 1, self._grammar_row(req)))

        table = self.table
        running = sorted((r for r in table.running.values() if self._may_continue(r)),
                         key=lambda r: (r.to_run > 1, r.arrival))
        stepwise_max = self.serve.stepwise_prefill_max
        eager = eager_ranks(running, table.waiting, table.caches.ranks, stepwise_max)
        for req in running:  # decoding first (one token each), then prompt chunks
            if req.id not in table.running:  # preempted for an older request in this iteration
                continue
            n = min(req.to_run, budget[req.rank])
            if n > 1 and (stepwise(req, stepwise_max) or (forced_only(req) and not eager[req.rank])):
                n = 1
            elif n > 1:
                n = paced_chunk(n, prompt_budget[req.rank])
            n = self._grow(req, n, scheduled, out) if n > 0 else 0
            if n > 0:
                add(req, n)
        while table.waiting:
            req = table.waiting[0]
            n, rank, hit = self._admit_rank(req, budget, prompt_budget)
            if rank is None:
                break
            table.seat(req, rank, n, hit)
            p = req.params
            out.ranks[rank].plan.admit.append(SeqAdmit(req.slot, list(req.pages), p.temperature, p.top_p, req.seed,
                                                        hit.checkpoint))
            add(req, n)
        for batch in out.ranks.values():
            batch.plan.greedy = all(r.params.temperature == 0 for r in batch.requests)
        return out

    def _grow(self, req: Request, n: int, scheduled: set[int], out: SchedulerOutput) -> int:
        """Pages for `req`'s next n positions, preempting newer requests of its rank not scheduled yet where the
        free pages run short. Returns how many of the n positions got pages (a prompt chunk may be cut; 0: the row
        waits, or `req` itself was preempted)."""
        table = self.table
        pool, P = table.caches.ranks[req.rank], self.serve.page_size

        def short() -> int:
            return table.caches.pages(req.planned + n) - len(req.pages) - pool.available_pages()

        while short() > pool.held_pages:
            newer = [r for r in table.on_rank(req.rank) if not r.done and r.id not in scheduled
                     and r.arrival > req.arrival and r is not req]
            if not newer:
                break
            victim = max(newer, key=lambda r: r.arrival)
            table.preempt(victim)
            out.preempted.append(victim.id)
        if short() > 0:
            fit = (len(req.pages) + pool.available_pages()) * P - req.planned
            if fit < 1 and req.to_run == 1 and not pool.held_pages:  # decoding, and no page will come back
                table.preempt(req)
                out.preempted.append(req.id)
                return 0
            n = max(0, min(n, fit))
        need = table.caches.pages(req.planned + n) - len(req.pages)
        if n and need > 0:
            new = pool.take_pages(need)
            out.ranks[req.rank].plan.grow.append(SeqPages(req.slot, len(req.pages), new))
            req.pages = req.pages + new
        return n

    def _grammar_row(self, req: Request) -> GrammarRow | None:
        """A constrained row's grammar part: the output so far with the first row since the request was seated
        (its slot's last stage makes a matcher of it), the compiled grammar where the rank does not hold it."""
        if req.logits.compiled is None:
            return None
        replay = None if req.grammar_seated else list(req.out)
        req.grammar_seated = True
        return self.grammar_books[req.rank].row(req.logits, replay)

    def _may_continue(self, req: Request) -> bool:
        """Whether `req` may get a row now: not ended, and the tokens in flight leave it room to generate another
        (max_tokens and the context are known on the host; end-of-text and stop strings are not), and none of a
        grammar's or penalised request's tokens is in flight (its next logits depend on it)."""
        return (not req.done and len(req.out) + req.unconfirmed < req.params.max_tokens
                and req.length + req.unconfirmed < self.max_seq_len
                and not (req.unconfirmed and req.logits is not None and req.logits.stateful))

    def _admit_rank(self, req: Request, budget: list[int], prompt_budget: list[int]
                    ) -> tuple[int, int | None, Hit]:
        """(first chunk, rank, cached prefix) for a waiting request: among the ranks with a free slot, budget left
        and pages for the chunk past the prefix they hold of it beside one in reserve per running request, the one
        holding the longest prefix, then the one with the most pages available; (0, None, no hit) if none."""
        best, best_key = (0, None, Hit()), None
        caches = self.table.caches
        for rank, pool in enumerate(caches.ranks):
            hit = Hit() if self.request_prefixes is None else self.request_prefixes.lookup(req, rank)
            left = req.length - hit.tokens  # a requeued request re-prefills its output
            n = 1 if stepwise(req, self.serve.stepwise_prefill_max) else min(left, budget[rank])
            if n > 1:
                n = paced_chunk(n, prompt_budget[rank])
            reserve = len(self.table.on_rank(rank))
            available = pool.available_pages() - (pool.prefix.reusable(hit) if pool.prefix is not None else 0)
            need = caches.pages(hit.tokens + n) - len(hit.pages)
            key = (hit.tokens, available)
            if n > 0 and pool.free_slots and available >= need + reserve and (best_key is None or key > best_key):
                best, best_key = (n, rank, hit), key
        return best

    def complete(self, scheduled: SchedulerOutput, outputs: dict[int, StageOutput]) -> list[Request]:
        """Take an iteration's answers (rank -> StageOutput: next tokens [N] and max-abs [N], one per sequence of
        the plan): a sequence that tripped the guards fails alone (finish 'error', `trip` set); where a sequence
        reached its last known token, its sampled token is appended; finish what ended, and free it once no iteration
        in flight holds it (overlap: the next one's row of a request that ended is dropped). Rows of an incarnation
        preempted since are void. Iterations complete in the order they were scheduled. Returns the requests that
        got a token or finished."""
        now, changed = self.clock(), []
        self.pacer.observe(max(sum(n for n in b.plan.counts if n > 1) for b in scheduled.ranks.values()),
                           max(outputs[r].seconds for r in scheduled.ranks))
        for rank, batch in scheduled.ranks.items():
            out, plan = outputs[rank], batch.plan
            trips = guards.check_sequences(out.maxabs, self.guards)
            for row, (n, req, epoch) in enumerate(zip(plan.counts, batch.requests, batch.epochs)):
                if epoch != req.epoch:  # preempted after this was scheduled: its caches return once none holds them
                    if batch.saves:
                        self.request_prefixes.drop_saves(rank, row, batch)
                    self.table.caches.row_done(req.id, epoch)
                    continue
                req.cached += n
                req.in_flight -= 1
                if self.request_prefixes is not None:
                    if row in trips:
                        self.request_prefixes.drop_saves(rank, row, batch)
                    else:
                        self.request_prefixes.offer(req, row, batch)
                if req.done:  # cancelled while in flight, or ended by the iteration before (its token dropped)
                    if req.in_flight == 0:
                        self.table.release(req)
                        if req.finish == "cancelled":
                            changed.append(req)
                    continue
                if row in trips:
                    trip = trips[row]
                    req.finish, req.trip = "error", trip
                    req.error = (f"stopped: this request's activations blew up ({trip.rule} {trip.detail}: "
                                 f"{trip.value:g}); other requests are unaffected")
                    if req.in_flight == 0:
                        self.table.release(req)
                    changed.append(req)
                    continue
                if req.cached < req.length:
                    continue  # a prompt chunk short of the end: nothing to sample yet
                req.unconfirmed -= 1
                req.out.append(out.tokens[row])
                if req.logits is not None:
                    req.logits.accept(req.out[-1])
                if req.params.logprobs is not None:
                    req.logprobs.append(out.logprobs[row])
                req.token_times.append(now)
                req.text += req.detok.push(req.out[-1:])
                req.finish = finish_reason(req.out, req.params, self.tokenizer.eos_id,
                                           self.max_seq_len - req.length, req.detok)
                self._jump_forward(req)
                if req.done:
                    req.text += req.detok.push([], final=True)
                    if req.in_flight == 0:
                        self.table.release(req)
                changed.append(req)
        return changed

    def step(self, executor) -> list[Request]:
        """One iteration with a synchronous executor: executor.run({rank: RankPlan}) -> {rank: StageOutput}."""
        scheduled = self.schedule()
        return self.complete(scheduled, executor.run(scheduled.plans()))

    # -- what it holds -------------------------------------------------------------------------------------------
    def usage(self) -> dict:
        table = self.table
        return {"waiting": len(table.waiting), "running": len(table.running), **table.caches.usage(),
                "tokens_per_rank": list(self.rank_tokens), "preemptions": table.preemptions}
