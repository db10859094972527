"""The K3 decoder as pipeline stages. A stage holds a contiguous range of layers; the first stage also embeds
tokens and the last one holds the final norm and LM head. The whole model is the single stage holding every layer.

Parameter names are the same whichever stage holds a layer (`blocks.<layer>.…`), and every parameter is
initialised from (seed, name) alone, so a pipeline stage or an expert shard built anywhere equals the same part of
the single-process model bit for bit.
"""
from __future__ import annotations

import contextlib
import functools
import zlib
from typing import Callable

import torch
from k3ray.dtypes import up32
from torch import nn

from k3ray.config import ExecutionConfig, ModelConfig
from k3ray.model.cache import IterationCache
from k3ray.model.balancing import own_bias
from k3ray.model.layers import KDA, AttnResRead, Documents, GatedMLA, RMSNorm, SiTUFFN
from k3ray.model.moe import ExpertShard, LatentMoE, LocalExperts, max_into, maxabs
from k3ray.model.recompute import recompute_elementwise

ExpertsFactory = Callable[[int, ExpertShard], nn.Module]
"""(layer, shard) -> the module computing that layer's routed experts."""


class Block(nn.Module):
    """One decoder layer: attention (KDA or MLA) and an FFN (the routed MoE, or a dense SiTU-GLU FFN in the first
    `first_dense_layers` layers), each behind an RMSNorm.

    Plain residual stream: x <- x + attn(norm(x)); x <- x + ffn(norm(x)).
    Block AttnRes (attn_res_block_size n; Kimi Team, "Attention Residuals", 2026): the stream is a list of block
    summaries b_0..b_{m-1} (b_0 the embedding) and a partial block p (the sum of the sublayer outputs since the last
    summary). Each sublayer reads h = sum_i softmax_i(w . RMSNorm(v_i)) v_i over v = (b_0, .., b_{m-1}, p) with its own
    pseudo-query w; at layers 0, n, 2n, ... p becomes a new summary (after the pre-attention read) and the partial
    restarts from the attention output:
        h = read_attn(b, p);  if layer % n == 0: b += [p], p = 0;  p += attn(norm(h))
        h = read_ffn(b, p);   p += ffn(norm(h))
    The last stage reads once more (output_res) before the final norm.

    | k3ray (blocks.<i>.) | HF (model.layers.<i>.) |
    |---|---|
    | attn_norm | input_layernorm |
    | attn.* | self_attn.* (layers.GatedMLA, layers.KDA) |
    | ffn_norm | post_attention_layernorm |
    | moe.* | block_sparse_moe.* (moe.LatentMoE) |
    | ffn.w_gate / w_up / w_out | mlp.gate_proj / up_proj / down_proj |
    | attn_res.*, ffn_res.* | self_attention_res_*, mlp_res_* (layers.AttnResRead) |
    """

    def __init__(self, cfg: ModelConfig, layer: int, experts: nn.Module | None):
        super().__init__()
        self.layer = layer
        self.res_block = cfg.attn_res_block_size
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = KDA(cfg) if cfg.layer_kind(layer) == "kda" else GatedMLA(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.is_moe_layer(layer):
            self.moe, self.ffn = LatentMoE(cfg, experts), None
        else:
            self.moe, self.ffn = None, SiTUFFN(cfg.d_model, cfg.dense_inner)
        if self.res_block:
            self.attn_res = AttnResRead(cfg.d_model, cfg.norm_eps)
            self.ffn_res = AttnResRead(cfg.d_model, cfg.norm_eps)
        self.resid_maxabs: torch.Tensor | None = None
        self.recompute_attention = False  # execution.recompute (set_execution)

    def _attention(self, h: torch.Tensor, cache: IterationCache | None, documents: Documents | None) -> torch.Tensor:
        if self.recompute_attention and cache is None and torch.is_grad_enabled():
            return recompute_elementwise(lambda h: self.attn(self.attn_norm(h), None, documents), h)
        return self.attn(self.attn_norm(h), cache, documents)

    def _ffn(self, x: torch.Tensor, cache: IterationCache | None) -> torch.Tensor:
        return self.moe(x, cache) if self.moe is not None else self.ffn(x)

    def forward(self, x: torch.Tensor, cache: IterationCache | None = None,
                summaries: list[torch.Tensor] | None = None, documents: Documents | None = None):
        """x [B, S, d] -> [B, S, d]; with Block AttnRes x is the partial block and (partial, summaries) come back.
        `documents`: attention stays within each packed document (training with document masking)."""
        if cache is not None:
            cache.layer = self.layer
        if summaries is None:
            x = x + self._attention(x, cache, documents)
            x = x + self._ffn(self.ffn_norm(x), cache)
            out = x
        else:
            h = self.attn_res(summaries + [x])
            partial: torch.Tensor | None = x
            if self.layer % self.res_block == 0:
                summaries, partial = summaries + [x], None
            a = self._attention(h, cache, documents)
            partial = a if partial is None else partial + a
            h = self.ffn_res(summaries + [partial])
            x = out = partial + self._ffn(self.ffn_norm(h), cache)
        if cache is not None:  # serving: each sequence's max-abs for the per-request guards
            cache.note_activations(out)
            return x if summaries is None else (x, summaries)
        with torch.no_grad():
            self.resid_maxabs = max_into(self.resid_maxabs, up32(maxabs(out.detach())))
        return x if summaries is None else (x, summaries)


def summaries_before(cfg: ModelConfig, layer: int) -> int:
    """Block AttnRes summaries committed before `layer` runs (one at each of layers 0, n, 2n, ... below it)."""
    n = cfg.attn_res_block_size
    return -(-layer // n) if n else 0


def boundary_shape(cfg: ModelConfig, layer: int, batch: int, seq: int) -> tuple[int, ...]:
    """Shape of the hidden state a pipeline stage starting at `layer` receives: [B, S, d]; with Block AttnRes
    [1 + summaries, B, S, d], the partial block first, then the block summaries (they travel with the activations)."""
    if not cfg.attn_res_block_size:
        return (batch, seq, cfg.d_model)
    return (1 + summaries_before(cfg, layer), batch, seq, cfg.d_model)


class K3Stage(nn.Module):
    """Layers [first_layer, last_layer) of the decoder. forward: token ids [B, S] (first stage) or hidden (shape
    `boundary_shape`) -> hidden (the next stage's `boundary_shape`), or logits [B, S, V] on the last stage.

    With an inference cache (k3ray.model.cache): token ids [1, T] or hidden [..., 1, T, d], the iteration's new tokens
    of N sequences packed, -> hidden, or on the last stage the logits of each sequence's last token [N, V].

    | k3ray | HF |
    |---|---|
    | embed | model.embed_tokens |
    | blocks.<i>.* | model.layers.<i>.* (Block) |
    | output_res.proj, output_res.norm | model.output_attn_res_proj, model.output_attn_res_norm |
    | final_norm | model.norm |
    | lm_head | lm_head |
    """

    def __init__(self, cfg: ModelConfig, layers: range, experts: dict[int, ExpertShard],
                 experts_factory: ExpertsFactory | None = None):
        super().__init__()
        self.cfg, self.layers = cfg, layers
        self.is_first, self.is_last = layers.start == 0, layers.stop == cfg.n_layers
        factory = experts_factory or (lambda layer, shard: LocalExperts(shard))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model) if self.is_first else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i, factory(i, experts[i]) if i in experts else None)
                                     for i in layers})
        self.output_res = AttnResRead(cfg.d_model, cfg.norm_eps) if self.is_last and cfg.attn_res_block_size \
            else None
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if self.is_last else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if self.is_last else None

    def forward(self, x: torch.Tensor, cache: IterationCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        return self.head(self.body(x, cache, documents), cache)

    def body(self, x: torch.Tensor, cache: IterationCache | None = None,
             documents: Documents | None = None) -> torch.Tensor:
        """Every position through the stage's blocks: the next stage's input (`boundary_shape`), or on the last
        stage the hidden state [B, S, d] (with an inference cache [1, T, d]) that `head` reads."""
        if self.embed is not None:
            x = self.embed(x)
        if self.cfg.attn_res_block_size:
            x, summaries = (x, []) if self.is_first else (x[0], list(x[1:]))
            for block in self.blocks.values():
                x, summaries = block(x, cache, summaries, documents)
            return self.output_res(summaries + [x]) if self.is_last else torch.stack([x] + summaries)
        for block in self.blocks.values():
            x = block(x, cache, documents=documents)
        return x

    def head(self, x: torch.Tensor, cache: IterationCache | None = None) -> torch.Tensor:
        """`body`'s output -> the logits on the last stage ([B, S, V]; with an inference cache those of each
        sequence's last token, [N, V]); elsewhere `x` itself."""
        if self.lm_head is None:
            return x
        if cache is not None:  # only each sequence's last position is sampled from
            x = x[0, cache.last_rows]
        return self.lm_head(self.final_norm(x))

    def moe_layers(self) -> dict[int, LatentMoE]:
        return {int(i): b.moe for i, b in self.blocks.items() if b.moe is not None}

    def expert_shards(self) -> dict[int, ExpertShard]:
        return {i: moe.experts.shard for i, moe in self.moe_layers().items()}

    def reset_stats(self) -> None:
        for block in self.blocks.values():
            if block.moe is not None:
                block.moe.stats.reset()
            block.resid_maxabs = None


def set_execution(stage: K3Stage, execution: ExecutionConfig, device: str) -> None:
    """How the stage's blocks run in training (the results do not depend on it): selective recompute of each
    attention sublayer's elementwise ops, and regional compilation, one `torch.compile` per block (blocks of one
    kind share the compiled code; kernels and the routed experts run eagerly between the graphs)."""
    for block in stage.blocks.values():
        block.recompute_attention = execution.recompute == "attention_elementwise"
        if execution.compiles_blocks(device):
            block.compile(dynamic=False)
            if block.moe is not None:  # ~200 small ops a micro-batch eagerly, a few fused kernels compiled
                block.moe.own_bias = compiled_own_bias()


@functools.cache
def compiled_own_bias():
    """`balancing.own_bias` through torch.compile, one for every layer (the histogram kernel runs between its
    graphs). Called from the MoE layer's eager region between a compiled block's graphs: a compiled function of
    its own there."""
    return torch.compile(own_bias, dynamic=False)


def is_expert_param(name: str) -> bool:
    return ".experts." in name


def _generator(seed: int, name: str, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(f"{seed}/{name}".encode()) + (seed << 32))
    return g


RESIDUAL_OUTPUTS = ("attn.w_o.weight", "moe.w_up.weight", "w_out.weight")


def _init_tensor(t: torch.Tensor, name: str, seed: int, cfg: ModelConfig) -> None:
    """Norm weights 1, biases 0, AttnRes pseudo-queries 0 (a uniform mix at start, as the paper), KDA's A_log 0 and
    dt_bias -4 (alpha ~ 0.98 with the softplus gate: slow forgetting at start), the embedding N(0, 1), every matrix
    N(0, 1/fan_in), residual-branch outputs further scaled by 1/sqrt(2L)."""
    if name.endswith("norm.weight"):
        t.fill_(1.0)
    elif name.endswith("dt_bias"):
        t.fill_(-4.0)
    elif name.endswith(("res.proj.weight", "A_log", "bias")):
        t.zero_()
    else:
        if name.endswith("embed.weight"):
            std = 1.0
        else:  # nn.Linear weights are [out, in], conv weights [C, 1, W]; expert weights are [in, out] per expert
            std = (t.shape[0] if name.endswith(("w1", "w2")) else t.shape[-1]) ** -0.5
        if name.endswith(RESIDUAL_OUTPUTS):
            std /= (2 * cfg.n_layers) ** 0.5
        g = _generator(seed, name, "cpu")
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).mul_(std))


@torch.no_grad()
def init_stage_(stage: K3Stage, seed: int) -> None:
    """Initialise every parameter from (seed, its name); expert weights from (seed, layer, expert id)."""
    cfg = stage.cfg
    init_dense_(stage, seed, cfg)
    for layer, shard in stage.expert_shards().items():
        init_shard_(shard, layer, seed, cfg)


@torch.no_grad()
def init_dense_(module: nn.Module, seed: int, cfg: ModelConfig, prefix: str = "") -> None:
    """Initialise the non-expert parameters of any module (a stage, or one layer named by `prefix`)."""
    for name, p in module.named_parameters():
        if not is_expert_param(name):
            _init_tensor(p, prefix + name, seed, cfg)


@torch.no_grad()
def init_shard_(shard: ExpertShard, layer: int, seed: int, cfg: ModelConfig) -> None:
    for row, e in enumerate(shard.expert_ids):
        for wname in ("w1", "w2"):
            _init_tensor(getattr(shard, wname)[row], f"blocks.{layer}.expert.{e}.{wname}", seed, cfg)


def new_shard(cfg: ModelConfig, expert_ids: list[int], device=None) -> ExpertShard:
    dtype = getattr(torch, cfg.dtype)
    return ExpertShard(expert_ids, cfg.d_latent, cfg.expert_inner, dtype=dtype, device=device)


def build_stage(cfg: ModelConfig, layers: range, expert_ids: list[int] | None = None, seed: int = 0,
                experts_factory: ExpertsFactory | None = None, device=None, init: bool = True) -> K3Stage:
    """A stage holding `expert_ids` (default: every expert) of each of its MoE layers, in eval mode: the trainers
    set train mode, the one mode in which a forward that records gradients is a training forward (a MoE layer with
    model.quantile_bias_from=micro_batch then routes each micro-batch with its own bias). init=False (a restore
    follows): built on the meta device and given uninitialised memory on `device`, so no time goes into initialising
    weights that the restore overwrites (torch's own default init of a large stage takes seconds on one core)."""
    ids = list(range(cfg.n_experts)) if expert_ids is None else expert_ids
    with contextlib.nullcontext() if init else torch.device("meta"):
        shards = {i: new_shard(cfg, ids, device if init else None) for i in layers if cfg.is_moe_layer(i)}
        stage = K3Stage(cfg, layers, shards, experts_factory)
        stage.to(dtype=getattr(torch, cfg.dtype))
        for moe in stage.moe_layers().values():
            moe.router.bias.data = moe.router.bias.data.float()  # the bias stays fp32 in every dtype
    if init:
        init_stage_(stage, seed)
    else:
        # no device named: the caller's default (meta inside `with torch.device("meta")`: counting, no memory)
        stage.to_empty(device=device if device is not None else torch.empty(0).device)
    stage.eval()
    return stage.to(device) if device is not None else stage
