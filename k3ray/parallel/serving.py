"""One worker's part of a serving iteration, as plain library code (no Ray): its pipeline stage, its cache pools (with
the persistent batch state: page tables and sampling parameters per slot), the pipeline hand-off of hidden states,
and sampling on the last stage.

Worker (p, e) holds stage p and the caches of the requests that the engine placed on data-parallel rank e (each
request lives on one rank: its latent pages and KDA slot are there, on every stage). Every iteration, every worker
runs `StageServer.step` with its rank's `RankPlan`, also when that plan is empty: the MoE layers' expert-parallel
exchanges span the stage's EP group, so every EP rank joins them, with zero tokens if need be. Stage p receives the
hidden states from (p-1, e) and sends its own to (p+1, e); the last stage samples each sequence's next token on the
device. Only token ids and each sequence's largest activation (for the per-request guards) leave the worker, with
the log-probabilities of the rows that ask for them.

A plan is small: the sequences by slot with their start and token count, the new token ids, and for sequences new
on the rank their pages and sampling parameters (sent once). Decode iterations (one token per sequence) on a stage
whose experts are all local run as CUDA graphs, one per (batch bucket, context bucket), the likeliest captured when
the pools are made (as many as serve.graphs_at_start_s allows), the rest on first use (`DecodeGraphs`); iterations
with prompt chunks run a token bucket as CUDA graphs in pieces, captured on first use, the attention between them
eager (k3ray.parallel.prompt_graphs); rows whose logits are adjusted or whose logprobs are asked for
(`RankPlan.logits`: grammars, penalties, logit_bias) are sampled eagerly after either. The same code runs on CPU
without graphs.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from k3ray.config.serve import SERVE_DEFAULTS
from k3ray.model.cache import CachePools, IterationCache, SeqAdmit, SeqPages, StateSave, new_pools
from k3ray.model.decoder import K3Stage, boundary_shape
from k3ray.model.sampling import LogitsRow, adjust_logits, sample_tokens, token_logprobs
from k3ray.model.transfer import to_device
from k3ray.parallel.grammar_masks import GrammarMasks
from k3ray.parallel.prompt_graphs import PromptGraphs, experts_local, prompt_bucket

log = logging.getLogger("k3ray.serve")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# On a GPU an eager iteration with prompt rows runs a multiple of this many tokens (`padded_prefill`): each matmul
# shape new to cuBLAS costs the host a heuristic search, which a new token count every iteration paid at every matmul.
# (On a CPU padding would only add work.)
PREFILL_TOKEN_BUCKET = 64
DEFAULT_TOKEN_BUDGET = SERVE_DEFAULTS["gpu"]["token_budget"]  # the largest prompt graph where none is given


@dataclass
class RankPlan:
    """One data-parallel rank's iteration: its sequences (by state slot, with the tokens already cached and the
    number of new ones), their new token ids packed in sequence order, each sequence's sample counter (how many
    tokens it has generated: the index of its sampling noise), the sequences new on the rank and the pages running
    ones grew by. A row flagged
    `from_device` (one token: the engine scheduled it before the iteration sampling that token came back,
    serve.overlap) takes its token from the slot's last sampled token on the device (`CachePools.last_token`); its
    entry in `tokens` is a placeholder."""
    slots: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    counters: list[int] = field(default_factory=list)
    admit: list[SeqAdmit] = field(default_factory=list)
    grow: list[SeqPages] = field(default_factory=list)  # pages running sequences grew by (allocated on demand)
    from_device: list[bool] = field(default_factory=list)
    greedy: bool = False  # every sequence decodes greedily: the last stage takes the argmax and draws no noise
    logits: list[LogitsRow] = field(default_factory=list)  # rows whose logits are adjusted or whose logprobs return
    saves: list[StateSave] = field(default_factory=list)  # KDA state checkpoints for the prefix cache


def padded_prefill(plan: RankPlan, scratch_slot: int, tokens: int, longest: int) -> RankPlan:
    """`plan` (with prompt rows) padded to `tokens` packed tokens by rows of the scratch slot, each at most `longest`
    tokens (what a page table reaches; the plan itself where it has as many already). The padding rows read and
    write only the scratch slot and page; the step drops their outputs."""
    pad = tokens - sum(plan.counts)
    if pad <= 0:
        return plan
    rows = [longest] * (pad // longest) + ([pad % longest] if pad % longest else [])
    k = len(rows)
    return dataclasses.replace(plan, slots=[*plan.slots, *[scratch_slot] * k], starts=[*plan.starts, *[0] * k],
                               counts=[*plan.counts, *rows], counters=[*plan.counters, *[0] * k],
                               tokens=[*plan.tokens, *[0] * pad] if plan.tokens else [],
                               from_device=[*plan.from_device, *[False] * k] if plan.from_device else [])


@dataclass
class StageOutput:
    """A stage's answer to an iteration: each sequence's next token [N] (last stage; None elsewhere; meaningful only
    for sequences whose new tokens reached the end of what is known) and its largest |activation| in the stage [N]
    (inf where anything, the logits included, is not finite), the seconds the worker spent in the step and how it
    ran it (`path`: `step_path`'s)."""
    tokens: list[int] | None
    maxabs: list[float]
    seconds: float = 0.0
    logprobs: dict[int, tuple[float, list[int], list[float]]] = field(default_factory=dict)  # `token_logprobs`
    path: str = ""

    @staticmethod
    def merge(stages: list[StageOutput]) -> StageOutput:
        """One data-parallel rank's answer from its stages' (in pipeline order; the seconds and path of the
        slowest)."""
        slowest = max(stages, key=lambda s: s.seconds)
        return StageOutput(stages[-1].tokens, [max(m) for m in zip(*(s.maxabs for s in stages))],
                           slowest.seconds, stages[-1].logprobs, slowest.path)


def step_path(prompt_rows: bool, graphs: bool, saves_inside: bool) -> str:
    """How a worker ran an iteration, for the engine's breakdown of the workers' time (/v1/status `worker_paths`):
    decode or prompt rows, replayed as CUDA graphs or eager, with KDA states saved inside rows or not."""
    kind = f"{'prompt' if prompt_rows else 'decode'} {'graphs' if graphs else 'eager'}"
    return kind + ", saves inside rows" if saves_inside else kind


@dataclass
class PoolSizes:
    """Cache pools of every worker: latent pages of page_size tokens, KDA state slots (one per running request of
    the rank) and the prefix cache's KDA state checkpoints."""
    pages: int
    page_size: int
    slots: int
    checkpoints: int = 0


class StageServer:
    def __init__(self, stage: K3Stage, pools: CachePools, device, prev_rank: int | None = None,
                 next_rank: int | None = None, groups=None, graphs: bool = True, prompt_graphs: bool | None = None,
                 token_budget: int = DEFAULT_TOKEN_BUDGET):
        """graphs: decode and prompt iterations as CUDA graphs where the device is a GPU; prompt_graphs alone for
        prompt iterations (default: as `graphs` on a GPU, off on a CPU, where True runs their pieces eagerly:
        k3ray.parallel.prompt_graphs' data path without graphs, for tests). token_budget: an iteration's tokens at
        most (serve.token_budget), the largest prompt graph."""
        self.stage, self.pools, self.device = stage, pools, torch.device(device)
        self.prev_rank, self.next_rank = prev_rank, next_rank  # world ranks of the neighbouring stages (same e)
        # the grid's process groups (k3ray.parallel.grid_groups.GridGroups), asked for the world group at each use:
        # once the grid is left that refuses, and nothing here keeps a left group alive (gloo closes a group's
        # connections only when it is freed, and a peer waiting on this worker waits as long as they are open)
        self.groups = groups
        self.dtype = next(stage.parameters()).dtype
        cuda = self.device.type == "cuda"
        self.graphs = DecodeGraphs(self) if graphs and cuda else None
        if prompt_graphs is None:
            prompt_graphs = graphs and cuda
        self.prompt_graphs = PromptGraphs(self, token_budget, capture=cuda, pool=getattr(self.graphs, "pool", None)) \
            if prompt_graphs else None
        self.prefill_bucket = PREFILL_TOKEN_BUCKET if cuda else 1  # eager prompt iterations: a multiple of it
        self.grammar_masks = GrammarMasks()  # the last stage's: constrained rows' bitmasks

    @torch.no_grad()
    def step(self, plan: RankPlan) -> StageOutput:
        """Run this stage on the plan: every stage's max-abs per sequence, and on the last stage the next tokens."""
        t0 = time.perf_counter()
        self.pools.admit(plan.admit)
        self.pools.grow(plan.grow)
        if self.stage.is_last:
            self.grammar_masks.seated([a.slot for a in plan.admit])
        real = plan  # its rows' outputs are the step's (a padding row's are dropped)
        if plan.counts and max(plan.counts) > 1:
            plan = self._padded(plan, self.prompt_tokens(sum(plan.counts)))
        n, T = len(real.slots), sum(plan.counts)
        x = None
        if not self.stage.is_first:
            # the hidden state (and, with Block AttnRes, the block summaries: per token, so nothing is kept)
            x = torch.empty(boundary_shape(self.stage.cfg, self.stage.layers.start, 1, T), dtype=self.dtype,
                            device=self.device)
            if T:
                dist.recv(x, self.prev_rank, group=self.groups.world)
        # rows whose logits are adjusted (grammars, biases) are sampled after the forward (a decode graph's too), their
        # grammars' bitmasks filled on the host while the device runs it
        adjusted = self.stage.is_last and any(r.grammar is not None or r.mask is not None or r.bias_ids
                                              for r in plan.logits)
        graphed = self.graphs is not None and n and max(plan.counts) == 1
        replayed = self.graphs.run(plan, x, sample=not adjusted) if graphed else None
        at_end = [s for s in plan.saves if s.offset == plan.counts[s.row]]  # the slot's state once the step ran
        inside = [s for s in plan.saves if s.offset < plan.counts[s.row]]
        if replayed is not None:
            out, tokens, maxabs, slots, counters = replayed
            path = step_path(False, True, False)
        else:
            cache = IterationCache.from_plan(self.pools, plan.slots, plan.starts, plan.counts, self.device,
                                             saves=inside, padded=plan is not real)
            if self.stage.is_first:
                x = self._input_ids(plan)[None]
            slots, counters = cache.slots, to_device(plan.counters, torch.int64, self.device)
            out, tokens, maxabs = self.forward(x, cache, counters, plan.greedy, sample=not adjusted)
            prompt = cache.prompt is not None
            path = step_path(prompt, prompt and self.prompt_graphs is not None and self.prompt_graphs.serves(T),
                             bool(inside))
        if adjusted:
            self.grammar_masks.fill(real.slots, plan.logits)
            tokens = self.sample(out, slots, counters, plan.greedy, plan.logits)
        self.pools.save([plan.slots[s.row] for s in at_end], [s.checkpoint for s in at_end])
        if not self.stage.is_last:
            if T:
                dist.send(out.contiguous(), self.next_rank, group=self.groups.world)
            return StageOutput(None, maxabs[:n].tolist(), time.perf_counter() - t0, path=path)
        logprobs = token_logprobs(out, tokens, plan.logits) if plan.logits else {}
        both = torch.cat([tokens[:n].double(), maxabs[:n]])  # one device-to-host copy
        host = both.cpu()
        tokens = host[:n].long().tolist()
        self.grammar_masks.took(real.slots, plan.logits, tokens)
        return StageOutput(tokens, host[n:].tolist(), time.perf_counter() - t0, logprobs, path)

    def prompt_tokens(self, tokens: int) -> int:
        """The tokens an iteration of `tokens` with prompt rows runs: its prompt graphs' bucket, else (eager) the
        next multiple of `prefill_bucket`."""
        bucket = prompt_bucket(tokens)
        if self.prompt_graphs is not None and self.prompt_graphs.serves(bucket):
            return bucket
        return -(-tokens // self.prefill_bucket) * self.prefill_bucket

    def scratch_cache(self, tokens: int) -> IterationCache:
        """An iteration of `tokens` tokens in rows of the scratch slot only (a prompt graph's warm-up and capture)."""
        plan = self._padded(RankPlan(), tokens)
        return IterationCache.from_plan(self.pools, plan.slots, plan.starts, plan.counts, self.device)

    def _padded(self, plan: RankPlan, tokens: int) -> RankPlan:
        """`padded_prefill` to `tokens`, each padding row at most what a page table reaches."""
        return padded_prefill(plan, self.pools.scratch_slot, tokens, self.pools.max_pages * self.pools.page_size)

    def _input_ids(self, plan: RankPlan) -> torch.Tensor:
        """The plan's token ids [T] on the device, those of `from_device` rows taken from the slots' last sampled
        tokens (a device-side gather: no host sync)."""
        rows = [i for i, f in enumerate(plan.from_device) if f]
        first = [0, *itertools.accumulate(plan.counts)]  # each row's first packed token
        packed = to_device([*plan.tokens, *(first[i] for i in rows), *(plan.slots[i] for i in rows)], torch.int64,
                           self.device)
        ids, at, slots = packed.split([len(plan.tokens), len(rows), len(rows)])
        if rows:
            ids[at] = self.pools.last_token[slots]
        return ids

    def forward(self, x: torch.Tensor, cache: IterationCache, counters_N: torch.Tensor, greedy: bool = False,
                sample: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The stage on one iteration (no host sync: a CUDA graph can hold it): its output (hidden [1, T, d], or the
        logits [N, V] on the last stage, the model's), the sampled tokens [N] (last stage, `sample`: `self.sample`
        with no logits adjusted) and each sequence's max-abs [N] (inf where the logits are not finite)."""
        body = None
        if cache.prompt is not None and self.prompt_graphs is not None \
                and self.prompt_graphs.serves(cache.seq_of_token.numel()):
            body = self.prompt_graphs.run(x, cache)
        out = self.stage(x, cache) if body is None else self.stage.head(body, cache)
        maxabs = cache.sequence_maxabs()
        if not self.stage.is_last:
            return out, None, maxabs
        maxabs = torch.where(torch.isfinite(out).all(-1), maxabs, torch.inf)
        return out, self.sample(out, cache.slots, counters_N, greedy) if sample else None, maxabs

    def sample(self, logits_NV: torch.Tensor, slots_N: torch.Tensor, counters_N: torch.Tensor, greedy: bool,
               rows: list[LogitsRow] = ()) -> torch.Tensor:
        """The next tokens [N] from the logits, `rows` adjusting theirs first (grammars' bitmasks, biases);
        `greedy`: every sequence decodes greedily, so argmax alone. Kept in the slots' last tokens: the next
        iteration, scheduled before these come back, may read them (overlap)."""
        p = self.pools
        if any(r.mask is not None or r.bias_ids for r in rows):
            logits_NV = adjust_logits(logits_NV, rows)
        if greedy:
            tokens = logits_NV.argmax(-1)
        else:
            tokens = sample_tokens(logits_NV, p.temperature[slots_N], p.top_p[slots_N], p.seed[slots_N], counters_N)
        p.last_token[slots_N] = tokens
        return tokens

    def decode_step(self, packed: torch.Tensor, hidden: torch.Tensor | None, context: int, greedy: bool,
                    sample: bool = True):
        """A decode iteration from its packed inputs (`pack_decode`: [6, B] on the device; `hidden`: the stage's
        input on stages after the first) as `forward` gives it: what a decode CUDA graph holds, no host sync."""
        slots, starts, counters, tokens, valid, from_device = packed
        cache = IterationCache(self.pools, slots, starts, torch.ones_like(slots),
                               torch.arange(len(slots), device=slots.device), context, valid.bool())
        if hidden is None:  # rows scheduled before their token came back read it on the device (overlap)
            tokens = torch.where(from_device.bool(), self.pools.last_token[slots], tokens)
        return self.forward(tokens[None] if hidden is None else hidden, cache, counters, greedy, sample)

    def expert_load(self) -> dict[int, list[int]]:
        """layer -> routes this worker's tokens sent to each expert since the last call (then reset)."""
        return self.pools.take_load()


def decode_shape(plan: RankPlan) -> tuple[int, int, bool] | None:
    """A decode iteration's shape as a decode graph sees it, coarsened to powers of two (rows, longest sequence
    with its new token, greedy); None for a plan that holds no rows or a prompt chunk (no graph runs it)."""
    if not plan.slots or max(plan.counts) != 1:
        return None
    return 1 << (len(plan.slots) - 1).bit_length(), 1 << max(plan.starts).bit_length(), plan.greedy


def graph_key(rows: int, longest: int, greedy: bool, pools: CachePools) -> tuple[int, int, bool] | None:
    """The decode graph (batch bucket, context bucket, greedy) that replays a decode iteration of `rows` sequences,
    the longest `longest` tokens with its new one, on these pools; None past the largest bucket the pools fill."""
    bucket = next((b for b in BATCH_BUCKETS if b >= rows), None)
    if bucket is None or bucket > pools.slots:
        return None
    return bucket, pools.context_bucket(longest), bool(greedy)


def graph_keys(traffic: list[tuple[int, int, bool]], pools: CachePools) -> list[tuple[int, int, bool]]:
    """The decode graphs that iterations of `traffic`'s shapes ((rows, longest sequence, greedy), most used first:
    `decode_shape`) replay on these pools (`graph_key`), in that order, once each."""
    keys = dict.fromkeys(graph_key(*shape, pools) for shape in traffic)
    keys.pop(None, None)
    return list(keys)


def pack_decode(plan: RankPlan, bucket: int, scratch_slot: int, first_stage: bool) -> torch.Tensor:
    """A decode plan's inputs as one host tensor [6, bucket] (slots, starts, counters, token ids, valid, from_device),
    padded with rows that read and write only the scratch slot."""
    n = len(plan.slots)
    pad = bucket - n
    from_device = plan.from_device or [False] * n
    return torch.tensor([plan.slots + [scratch_slot] * pad, plan.starts + [0] * pad, plan.counters + [0] * pad,
                         (plan.tokens if first_stage else [0] * n) + [0] * pad, [1] * n + [0] * pad,
                         [int(f) for f in from_device] + [0] * pad], dtype=torch.int64)


class DecodeGraphs:
    """CUDA graphs of a stage's decode iteration, one per (batch bucket B, context bucket Lc, greedy, sampling in
    the graph or after it: an iteration whose logits are adjusted samples eagerly, once its grammars' bitmasks are
    filled on the host during the replay), captured on first use and replayed: the iteration's inputs are copied into
    the graph's static buffers, padded to B with rows that read and write only the scratch slot and page. Stages
    whose MoE exchanges experts between ranks (ep > 1: the exchange's splits come from the host) run eagerly."""

    def __init__(self, server: StageServer):
        self.server = server
        self.graphs: dict[tuple[int, int, bool, bool], tuple] = {}
        self.capture_seconds = 0.0  # spent capturing (warm-up runs included), reported with the grid's start
        self.first_capture_seconds = 0.0  # the first capture alone: a new CUDA process loads its kernels in it
        self.pool = torch.cuda.graph_pool_handle()
        self.enabled = experts_local(server.stage)

    def keys(self) -> list[tuple[int, int, bool]]:
        """Every (batch bucket, context bucket, greedy) this stage's pools can ask for, likeliest first: greedy
        before sampled, then short contexts (every request's first tokens) before long, small batches before large."""
        pools = self.server.pools
        contexts = sorted({pools.context_bucket(pools.page_size << k)
                           for k in range(pools.max_pages.bit_length() + 1)})
        buckets = [b for b in BATCH_BUCKETS if b <= pools.slots]
        return [(b, c, greedy) for greedy in (True, False) for c in contexts for b in buckets]

    def capture_ahead(self, budget_s: float, traffic: list[tuple[int, int, bool]] | None = None) -> int:
        """Capture graphs until `budget_s` seconds are spent (the capture under way finishes), so that the
        iterations traffic asks for first wait for no capture: those that `traffic` (a grid's decode shapes so far,
        most used first: a recovered grid's) replays, else every one in `keys()` order; how many were captured."""
        t0, before = time.perf_counter(), len(self.graphs)
        for key in self.keys() if traffic is None else graph_keys(traffic, self.server.pools):
            if not self.enabled or time.perf_counter() - t0 >= budget_s:
                break
            self._get(*key)
        return len(self.graphs) - before

    def _get(self, bucket: int, context: int, greedy: bool, sample: bool = True):
        """The graph of (bucket, context, greedy, sample), captured on first use; None if it cannot be (graphs off
        then)."""
        key = (bucket, context, greedy, sample)
        if key not in self.graphs:
            t0 = time.perf_counter()
            try:
                self.graphs[key] = self._capture(*key)
                if not self.capture_seconds:
                    self.first_capture_seconds = time.perf_counter() - t0
                self.capture_seconds += time.perf_counter() - t0
            except RuntimeError as err:  # a kernel that cannot be captured: this stage decodes eagerly from now on
                log.warning("decode CUDA graphs off for this stage: the capture failed: %s", err)
                self.enabled = False
                return None
        return self.graphs[key]

    def run(self, plan: RankPlan, x: torch.Tensor | None, sample: bool = True):
        """The decode iteration replayed: (output, tokens or None where not `sample`, max-abs, slots, counters on the
        device) as `StageServer.forward` gives them, or None where no graph serves it (graphs off for this stage, or
        a batch past the largest bucket): run it eagerly."""
        pools = self.server.pools
        n = len(plan.slots)
        key = graph_key(n, max(plan.starts) + 1, plan.greedy, pools)
        if not self.enabled or key is None:
            return None
        captured = self._get(*key, sample)
        if captured is None:
            return None
        bucket = key[0]
        graph, inputs, outputs = captured
        inputs["packed"].copy_(pack_decode(plan, bucket, pools.scratch_slot, x is None).pin_memory(),
                               non_blocking=True)
        if x is not None:
            inputs["hidden"][..., :n, :].copy_(x)
        graph.replay()
        out, tokens, maxabs = outputs
        packed = inputs["packed"]  # its slots and counters: what sampling after the graph reads, in stream order
        return out[..., :n, :], None if tokens is None else tokens[:n], maxabs[:n], packed[0, :n], packed[2, :n]

    # a grid's start captures outside `step`: without no_grad the captured forward would keep its autograd history
    # (the stage's parameters require gradients), and with it saved activations in the graphs' pool
    @torch.no_grad()
    def _capture(self, bucket: int, context: int, greedy: bool, sample: bool):
        server, dev = self.server, self.server.device
        pools = server.pools
        packed = torch.zeros(6, bucket, dtype=torch.int64, device=dev)
        packed[0] = pools.scratch_slot  # capture and warm-up touch only the scratch slot and page
        stage = server.stage
        hidden = None if stage.is_first else \
            torch.zeros(boundary_shape(stage.cfg, stage.layers.start, 1, bucket), dtype=server.dtype, device=dev)
        inputs = {"packed": packed, "hidden": hidden}

        def step():
            return server.decode_step(packed, hidden, context, greedy, sample)

        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for i in range(2):  # compiles and autotunes every kernel before the capture
                if i == 1 and os.environ.get("K3RAY_SYNC_DEBUG"):  # name every host sync (they break a capture)
                    torch.cuda.set_sync_debug_mode("warn")
                step()
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step()
        return graph, inputs, outputs


class LocalExecutor:
    """The whole model in this process (pp = 1, ep = 1, one data-parallel rank): the engine without Ray."""

    def __init__(self, model: K3Stage, sizes: PoolSizes, device="cpu", graphs: bool = True,
                 prompt_graphs: bool | None = None, token_budget: int = DEFAULT_TOKEN_BUDGET):
        pools = new_pools(model.cfg, model.layers, sizes.pages, sizes.page_size, sizes.slots, device,
                          sizes.checkpoints)
        self.server = StageServer(model, pools, device, graphs=graphs, prompt_graphs=prompt_graphs,
                                  token_budget=token_budget)

    def run(self, plans: dict[int, RankPlan]) -> dict[int, StageOutput]:
        return {0: self.server.step(plans[0])}
