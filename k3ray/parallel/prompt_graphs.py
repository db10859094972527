"""Prompt iterations as CUDA graphs, piecewise (as vLLM's piecewise graphs do for attention).

An iteration with prompt rows runs a bucket of tokens (`prompt_bucket`: the rows padded by rows of the scratch slot).
What it does to each token alone (projections, norms, the router, the routed and shared experts, AttnRes, the
residual stream, the served load and the max-abs per token) is the same work for any mix of rows: it replays from
graphs captured once per bucket. What mixes the tokens of a row (KDA's short convolution and recurrence, MLA's
attention over the pages) depends on the rows and runs eagerly between the graphs: the seams. A stage of n KDA layers
(with the convolution) and m MLA layers has 2n + m seams and one graph more. At replay graph i runs, then seam i runs
the iteration's own cache method (`IterationCache.kda`, ...) on the tensors graph i left and writes its result where
graph i + 1 reads it. An eager prompt iteration costs the host a launch per op (~16 ms for gpu2 at 4 layers, several
times its device time); replayed, the host runs only the seams.

The stage's forward (`K3Stage.body`) sees a `SeamCache` in place of the iteration's cache: the token-wise inputs in
static tensors refreshed before each replay, and the seams, which either run at once on an iteration's cache (the
warm-up before a capture; on a CPU, where nothing is captured, the pieces' whole data path: tests compare it with
the plain forward) or, while capturing, end the graph being captured and start the next.

Shapes: T tokens of the bucket; seam outputs have T in dim 1 (MLA [1, T, H, h], the convolution [1, T, 3 H K], KDA
[1, T, H, V]).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from k3ray.model.cache import IterationCache, add_served_routes, fold_maxabs
from k3ray.model.decoder import boundary_shape

log = logging.getLogger("k3ray.serve")
FINE_UP_TO = 512  # buckets every PROMPT_TOKEN_STEP tokens up to here, then four per doubling
PROMPT_TOKEN_STEP = 64
# a bucket is captured on its first use, mid-serving: another thread of the worker (expert copies fetched beside the
# iterations) may call CUDA meanwhile, which "global" capture would count as this capture's error
CAPTURE_MODE = "thread_local"


def experts_local(stage) -> bool:
    """Whether every MoE layer of the stage keeps its experts' tokens on this rank (ep = 1): an exchange between
    ranks takes its splits from the host, which no graph holds."""
    return all(getattr(getattr(moe.experts, "ctx", None), "num_ranks", 1) == 1 for moe in stage.moe_layers().values())


def prompt_bucket(tokens: int) -> int:
    """The token count an iteration of `tokens` tokens with prompt rows runs as a graph: the next multiple of 64 up
    to 512, then of a quarter of the power of two below (640, 768, 896, 1024, 1280, ...): at most a quarter more."""
    if tokens <= FINE_UP_TO:
        return max(1, -(-tokens // PROMPT_TOKEN_STEP)) * PROMPT_TOKEN_STEP
    step = (1 << (tokens - 1).bit_length() - 1) // 4
    return -(-tokens // step) * step


@dataclass
class Seam:
    """Where a graph ends: the cache method `kind` of `layer`, its arguments (the graph's tensors, or a module) and
    the static tensor its result goes to (`out`, what the next graph reads)."""
    kind: str
    layer: int
    args: tuple
    out: torch.Tensor | None = None


@dataclass
class Capture:
    """The graphs of one bucket while they are being captured (`SeamCache.capturing`)."""
    pool: object
    graphs: list = field(default_factory=list)


class SeamOutputs:
    """The seams' static outputs: one tensor per kind of seam (and per-token shape), shared by every seam of that kind
    and every bucket (a bucket's graphs read a view of its first T tokens). A seam's output is read only by the piece
    after it and by the seam after that (KDA reads v, a view of the convolution's output) before the next seam of its
    kind writes again; buckets never run at once. The CPU's pieces copy through them too, so a model whose code broke
    this would fail the tests there. One tensor per seam would hold 2n + m times as much (gigabytes at K3's size)."""

    def __init__(self, tokens: int):
        self.tokens = tokens  # the largest bucket served
        self.buffers: dict[tuple, torch.Tensor] = {}

    def view(self, kind: str, like: torch.Tensor) -> torch.Tensor:
        """The output of a seam of `kind` whose result is shaped and typed as `like` (T in dim 1)."""
        key = (kind, like.shape[0], *like.shape[2:], like.dtype)
        if key not in self.buffers:
            shape = (like.shape[0], self.tokens, *like.shape[2:])
            self.buffers[key] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.buffers[key][:, :like.shape[1]]


class SeamCache:
    """What a stage's forward reads of its cache inside a prompt graph (the interface of IterationCache it uses):
    positions [T] and token weights [T] (0: a padding row's) in static tensors (`load`), the per-token max-abs it
    folds, the layer's served load its routes add to, and the seams `mla_attention`, `short_conv` and `kda`."""

    def __init__(self, pools, tokens: int, device, outputs: SeamOutputs):
        self.pools, self.outputs = pools, outputs
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.token_weight = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.token_maxabs: torch.Tensor | None = None
        self.layer = -1
        self.seams: list[Seam] = []
        self.eager: IterationCache | None = None  # seams run at once on this cache
        self.capture: Capture | None = None  # seams end the graph being captured
        self.results: list[torch.Tensor] = []  # the eager seams' outputs (what a capture's seams return)

    def load(self, cache: IterationCache) -> None:
        """The iteration's token-wise inputs into the static tensors."""
        self.positions.copy_(cache.positions)
        self.token_weight.copy_(cache.token_weight)

    def running(self, cache: IterationCache) -> "SeamCache":
        """For one forward whose seams run at once on `cache`."""
        self.eager, self.capture, self.token_maxabs, self.results = cache, None, None, []
        return self

    def capturing(self, capture: Capture) -> "SeamCache":
        """For the forward that is captured: each seam ends the graph under way and starts the next."""
        self.eager, self.capture, self.token_maxabs, self.seams = None, capture, None, []
        return self

    def note_activations(self, x_1Td: torch.Tensor) -> None:
        self.token_maxabs = fold_maxabs(self.token_maxabs, x_1Td)

    def note_routes(self, idx_TK: torch.Tensor) -> None:
        add_served_routes(self.pools.load[self.layer], idx_TK, self.token_weight)

    def mla_attention(self, q_1THe: torch.Tensor, lat_1Tl: torch.Tensor, mla) -> torch.Tensor:
        return self._seam("mla_attention", q_1THe, lat_1Tl, mla)

    def short_conv(self, x_1TC: torch.Tensor, weight_CW: torch.Tensor) -> torch.Tensor:
        return self._seam("short_conv", x_1TC, weight_CW)

    def kda(self, q, k, v, g, beta, gate_lower_bound: float | None = None) -> torch.Tensor:
        return self._seam("kda", q, k, v, g, beta, gate_lower_bound)

    def _seam(self, kind: str, *args) -> torch.Tensor:
        if self.capture is None:  # run now, its output where a graph's seam puts it
            result = run_seam(Seam(kind, self.layer, args), self.eager)
            out = self.outputs.view(kind, result)
            out.copy_(result)
            self.results.append(out)
            return out
        cap = self.capture
        cap.graphs[-1].capture_end()
        seam = Seam(kind, self.layer, args, self.results[len(self.seams)])
        self.seams.append(seam)
        cap.graphs.append(torch.cuda.CUDAGraph())
        cap.graphs[-1].capture_begin(pool=cap.pool, capture_error_mode=CAPTURE_MODE)
        return seam.out


def run_seam(seam: Seam, cache: IterationCache) -> torch.Tensor:
    """The seam's cache method on an iteration's cache."""
    cache.layer = seam.layer
    return getattr(cache, seam.kind)(*seam.args)


@dataclass
class BucketGraphs:
    """A bucket's graphs (one more than its seams), its static input (token ids [1, T] on the first stage, else the
    hidden state) and output (`K3Stage.body`'s), and its SeamCache."""
    graphs: list
    x: torch.Tensor
    out: torch.Tensor
    seams: SeamCache


class PromptGraphs:
    """A stage's prompt iterations by token bucket, their graphs captured on first use (two eager runs first: every
    kernel compiled and autotuned at the bucket's shapes) and replayed (`run`); `capture=False` (a CPU): no graphs,
    each iteration runs the pieces' data path eagerly. Where the MoE exchanges experts between ranks (its splits come
    from the host) nothing is captured: `enabled` is False, as for the decode graphs."""

    def __init__(self, server, tokens: int, capture: bool = True, pool=None):
        """tokens: an iteration's at most (the largest bucket: this one's); pool: the CUDA graph memory pool to
        share (the decode graphs'; default a new one)."""
        self.server, self.capture = server, capture
        self.pool = (pool if pool is not None else torch.cuda.graph_pool_handle()) if capture else None
        self.enabled = experts_local(server.stage) or not capture
        self.max_tokens = prompt_bucket(tokens)
        self.outputs = SeamOutputs(self.max_tokens)
        self.buckets: dict[int, BucketGraphs] = {}
        self.capture_seconds = 0.0

    def bucket_sizes(self) -> list[int]:
        """Every bucket up to the largest, smallest first."""
        out = [prompt_bucket(1)]
        while out[-1] < self.max_tokens:
            out.append(prompt_bucket(out[-1] + 1))
        return out

    def capture_ahead(self, budget_s: float) -> int:
        """Capture buckets, smallest first (mixed iterations of a few decode rows and a chunk are the most frequent),
        until `budget_s` seconds are spent (the capture under way finishes); how many were captured."""
        t0, before = time.perf_counter(), len(self.buckets)
        for tokens in self.bucket_sizes():
            if not (self.enabled and self.capture) or time.perf_counter() - t0 >= budget_s:
                break
            self._get(tokens)
        return len(self.buckets) - before

    def serves(self, tokens: int) -> bool:
        """Whether an iteration of `tokens` tokens, a bucket (`prompt_bucket`), runs here."""
        return self.enabled and tokens <= self.max_tokens and tokens == prompt_bucket(tokens)

    def run(self, x: torch.Tensor, cache: IterationCache) -> torch.Tensor | None:
        """`K3Stage.body(x, cache)` of an iteration whose tokens fill a bucket (`prompt_bucket`), its cache's
        per-token max-abs set; None where its bucket cannot be captured (graphs off for this stage from now on)."""
        tokens = cache.seq_of_token.numel()
        bucket = self._get(tokens)
        if bucket is None:
            return None
        bucket.x.copy_(x)
        seams = bucket.seams
        seams.load(cache)
        if not self.capture:
            out = self.server.stage.body(bucket.x, seams.running(cache))
            cache.token_maxabs = seams.token_maxabs
            return out
        for graph, seam in zip(bucket.graphs, seams.seams):
            graph.replay()
            seam.out.copy_(run_seam(seam, cache))
        bucket.graphs[-1].replay()
        cache.token_maxabs = seams.token_maxabs
        return bucket.out

    def _get(self, tokens: int) -> BucketGraphs | None:
        if tokens not in self.buckets:
            t0 = time.perf_counter()
            try:
                self.buckets[tokens] = self._make(tokens)
            except RuntimeError as err:  # a kernel that cannot be captured: prompt iterations run eagerly from now on
                log.warning("prompt CUDA graphs off for this stage: the capture of %d tokens failed: %s", tokens, err)
                self.enabled = False
                return None
            self.capture_seconds += time.perf_counter() - t0
        return self.buckets[tokens]

    # a grid's start captures outside `StageServer.step`: without no_grad the captured forward would keep its
    # autograd history (the stage's parameters require gradients), and with it every layer's saved activations
    @torch.no_grad()
    def _make(self, tokens: int) -> BucketGraphs:
        server = self.server
        stage, dev = server.stage, server.device
        seams = SeamCache(server.pools, tokens, dev, self.outputs)
        if stage.is_first:
            x = torch.zeros(1, tokens, dtype=torch.int64, device=dev)
        else:
            x = torch.zeros(boundary_shape(stage.cfg, stage.layers.start, 1, tokens), dtype=server.dtype, device=dev)
        if not self.capture:
            return BucketGraphs([], x, x, seams)
        scratch = server.scratch_cache(tokens)  # warm-ups and capture touch only the scratch slot and page
        seams.load(scratch)
        seams.token_weight.zero_()  # no route of theirs is counted
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                stage.body(x, seams.running(scratch))
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            cap = Capture(self.pool, [torch.cuda.CUDAGraph()])
            cap.graphs[0].capture_begin(pool=self.pool, capture_error_mode=CAPTURE_MODE)
            try:
                out = stage.body(x, seams.capturing(cap))
            finally:
                cap.graphs[-1].capture_end()
        torch.cuda.current_stream(dev).wait_stream(stream)
        return BucketGraphs(cap.graphs, x, out, seams)
