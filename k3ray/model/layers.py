"""Dense K3 blocks: RMSNorm, RoPE, the gated MLA attention, KDA (Kimi Delta Attention), the SiTU-GLU FFN (shared
expert and dense layer) and the Block Attention Residuals read. The KDA recurrence, its gate and short convolution
live in kernels/ with their torch references.

Each parameter maps to one tensor of the released Hugging Face checkpoint (`model.layers.<i>.` + the name given in
the class docstrings); shapes are torch's ([out, in] for a Linear).

Shapes: B batch, S sequence, d model width, H heads, h head dim, r MLA latent KV width, p the decoupled (rope) slice
of MLA, K KDA head dim, W KDA convolution width.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from k3ray.dtypes import up32
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from k3ray.config import ModelConfig
from k3ray.kernels import (attn_res_scores, attn_res_value_dots, attn_res_value_grad, attn_res_weighted_sum,
                            kda_attention, kda_gate, outside_compile, short_conv, situ_glu)

if TYPE_CHECKING:
    from k3ray.model.cache import IterationCache

# Causal attention on CUDA: cuDNN's flash attention first, then FlashAttention-2 (on an H200, bf16, 32 heads of 128,
# the MLA layer's forward + backward is 1.3x / 1.5x / 1.6x faster with cuDNN at 4k / 32k / 128k tokens:
# benchmarks/attention_gpu.py, RESULTS.md).
MLA_CUDA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH]


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, returned in the input dtype. On CUDA, bf16 in and out of torch's fused kernel, which
    accumulates in fp32 itself: one kernel instead of casts around it (the decode step is launch-bound)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == self.weight.dtype == torch.bfloat16:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(up32(x), (x.shape[-1],), up32(self.weight), self.eps).to(x.dtype)


def rope(x_BSHh: torch.Tensor, theta: float, positions_S: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding over the last dim (pairs of halves), at positions 0..S-1 or the given ones."""
    seq, half = x_BSHh.shape[1], x_BSHh.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x_BSHh.device, dtype=torch.float32) / half)
    pos = torch.arange(seq, device=x_BSHh.device) if positions_S is None else positions_S
    angles = pos.to(torch.float32)[:, None] * freqs  # [S, h/2]
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    x1, x2 = up32(x_BSHh).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x_BSHh.dtype)


class GatedMLA(nn.Module):
    """Causal multi-head attention with an MLA low-rank KV path, optional q-LoRA and a sigmoid output gate.

        q = W_q x  or  W_q_up RMSNorm(W_q_down x)           [H, h + p]  (q-LoRA: q_lora_rank > 0)
        [c | k_p] = W_dkv x;  c = RMSNorm(c) [r];  k_p [p] one slice shared by all heads
        [k_n | v] = W_ukv c  [H, h + h];  k = [k_n | k_p];  o = softmax(q k^T / sqrt(h + p)) v
        out = W_o(o * sigmoid(W_g x))

    With `mla_rope` the p-wide slices of q and k are rotated (RoPE at each token's position); without it (released
    K3) nothing depends on positions but the causal mask: the slice is kept, unrotated, so cache layout and kernels
    stay as K2's. The inference cache stores [c | k_p] (r + p values per token).

    | k3ray | HF (self_attn.) |
    |---|---|
    | w_q [H(h+p), d] | q_proj |
    | w_q_down [q_lora_rank, d], q_norm, w_q_up [H(h+p), q_lora_rank] | q_a_proj, q_a_layernorm, q_b_proj |
    | w_dkv [r + p, d] | kv_a_proj_with_mqa |
    | kv_norm [r] | kv_a_layernorm |
    | w_ukv [H 2h, r] (per head k_n then v) | kv_b_proj |
    | w_g [H h, d] | g_proj |
    | w_o [d, H h] | o_proj |
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, H, h, p = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.mla_rope_dim
        self.n_heads, self.head_dim, self.rope_dim, self.kv_rank = H, h, p, cfg.kv_rank
        self.rotate, self.theta = cfg.mla_rope, cfg.rope_theta
        self.scale = (h + p) ** -0.5
        if cfg.q_lora_rank:
            self.w_q_down = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.w_q_up = nn.Linear(cfg.q_lora_rank, H * (h + p), bias=False)
        else:
            self.w_q = nn.Linear(d, H * (h + p), bias=False)
        self.w_dkv = nn.Linear(d, cfg.kv_rank + p, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_rank, cfg.norm_eps)
        self.w_ukv = nn.Linear(cfg.kv_rank, H * 2 * h, bias=False)
        self.w_g = nn.Linear(d, H * h, bias=False)
        self.w_o = nn.Linear(H * h, d, bias=False)

    def latent(self, x_BSd: torch.Tensor) -> torch.Tensor:
        """What the cache keeps per token: [c | k_p] [B, S, r + p]."""
        c, k_p = self.w_dkv(x_BSd).split([self.kv_rank, self.rope_dim], dim=-1)
        return torch.cat([self.kv_norm(c), k_p], dim=-1)

    def queries(self, x_BSd: torch.Tensor, positions_S: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, S, H, h + p], the p slice rotated at the given positions (default 0..S-1) with `mla_rope`."""
        B, S, _ = x_BSd.shape
        q = self.w_q_up(self.q_norm(self.w_q_down(x_BSd))) if hasattr(self, "w_q_up") else self.w_q(x_BSd)
        q = q.view(B, S, self.n_heads, self.head_dim + self.rope_dim)
        if self.rotate:
            q_n, q_p = q.split([self.head_dim, self.rope_dim], dim=-1)
            q = torch.cat([q_n, rope(q_p, self.theta, positions_S)], dim=-1)
        return q

    def up(self, latent_BSl: torch.Tensor, positions_S: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [B, S, H, h + p] and values [B, S, H, h] from latents [c | k_p] at positions 0..S-1 (or those given)."""
        B, S, _ = latent_BSl.shape
        c, k_p = latent_BSl.split([self.kv_rank, self.rope_dim], dim=-1)
        k_n, v = self.w_ukv(c).view(B, S, self.n_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        k_p = k_p[:, :, None, :]
        if self.rotate:
            k_p = rope(k_p, self.theta, positions_S)
        return torch.cat([k_n, k_p.expand(B, S, self.n_heads, self.rope_dim)], dim=-1), v

    def forward(self, x_BSd: torch.Tensor, cache: IterationCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """Training: x [B, S, d] (with `documents`, a token attends only within its document). With a cache:
        x [1, T, d], the iteration's new tokens of every sequence packed (their latents go into the cache's pages;
        attention reads each sequence's whole context from there)."""
        lat = self.latent(x_BSd)
        q = self.queries(x_BSd, None if cache is None else cache.positions)
        out_gate = torch.sigmoid(self.w_g(x_BSd))  # before attention's kernel: x's gradient summed in one graph
        if cache is not None:
            o = cache.mla_attention(q, lat, self)
        else:
            k, v = self.up(lat)
            o = causal_attention(q, k, v, self.scale, None if documents is None else documents.mask)
        o = o.flatten(2)  # [B, S, H*h]; also for zero tokens
        return self.w_o(o * out_gate)


class Documents:
    """Where the documents packed into a batch's rows begin, for training with document masking: the input tokens
    x [B, S] and the end-of-text id give doc [B, S] = how many end-of-text tokens precede each position in its row.

    mask [B, 1, S, S]: causal and within one document (MLA); cu_seqlens [n + 1]: every document of every row as a
    sequence of its own, the rows packed one after another (KDA's recurrence and its convolution restart there)."""

    def __init__(self, tokens_BS: torch.Tensor, eos: int):
        B, S = tokens_BS.shape
        ends = (tokens_BS == eos).to(torch.int64)
        self.doc = doc = torch.cat([ends.new_zeros(B, 1), ends[:, :-1].cumsum(1)], dim=1)  # [B, S]
        causal = torch.ones(S, S, dtype=torch.bool, device=tokens_BS.device).tril()
        self.mask = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]
        starts = torch.ones_like(doc, dtype=torch.bool)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
        first = starts.reshape(-1).nonzero().flatten()
        self.cu_seqlens = torch.cat([first, first.new_tensor([B * S])])


@functools.cache
def _hopper_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _cudnn_takes_narrow_v(device: torch.device) -> bool:
    """cuDNN's SDPA (forward and backward) with v narrower than q and k: cuDNN attention enabled, Hopper or newer."""
    return torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cudnn.is_available() and _hopper_or_newer(device)


@outside_compile  # cuDNN/flash attention chosen by sdpa_kernel, eager in a compiled block as every kernel
def causal_attention(q_BSHe: torch.Tensor, k_BSHe: torch.Tensor, v_BSHh: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention -> [B, S, H, h], or with `mask` [B, 1, S, S] (True: attend) that mask instead (it
    includes causality: document masking). On CUDA, cuDNN on Hopper or newer takes a narrower v as it is (MLA's
    192-wide q, k and 128-wide v: 1.5x faster forward and backward than padded); the other fused kernels take one
    head width for q, k and v, so there a narrower v is zero-padded to q's width and the padding cut (exact)."""
    q, k, v = q_BSHe.transpose(1, 2), k_BSHe.transpose(1, 2), v_BSHh.transpose(1, 2)
    how = {"is_causal": True} if mask is None else {"attn_mask": mask}
    if q.is_cuda:
        h = v.shape[-1]
        if h < q.shape[-1]:  # as it is: [B, H, S, h] contiguous, the layout cuDNN was measured with (as padding makes)
            v = v.contiguous() if _cudnn_takes_narrow_v(q.device) else F.pad(v, (0, q.shape[-1] - h))
        with sdpa_kernel(MLA_CUDA_BACKENDS, set_priority=True):
            o = F.scaled_dot_product_attention(q, k, v, scale=scale, **how)[..., :h]
    else:
        o = F.scaled_dot_product_attention(q, k, v, scale=scale, **how)
    return o.transpose(1, 2)


class KDA(nn.Module):
    """KDA layer (K3_NOTES, "The K3 model as released"):

        q, k, v = SiLU(ShortConv_W(W_q x)), ...    (kda_conv_size W > 0; without it q, k, v = W_q x, ...)
        q, k L2-normalised per head; q scaled by K^-1/2 with `kda_scaled_read`
        log alpha = lb * sigmoid(exp(A_log) (W_a_up W_a_down x + dt_bias))   (lower-bound gate, lb = -5)
                  or -exp(A_log) softplus(W_a_up W_a_down x + dt_bias)        (kda_gate_lower_bound null)
        beta = sigmoid(W_b x);  o = KDA(q, k, v, log alpha, beta);  out = W_o(RMSNorm_head(o) * sigmoid(W_g x))

    The recurrence is `kernels.kda_attention` (fla's chunk_kda on CUDA), the gate `kernels.kda_gate` (fla's fused
    gate), the convolution `kernels.short_conv` (fla's causal_conv1d in training; with a cache each request keeps
    its last W-1 inputs of q, k, v).

    | k3ray | HF (self_attn.) |
    |---|---|
    | w_q, w_k, w_v [H K, d] | q_proj, k_proj, v_proj |
    | q_conv, k_conv, v_conv .weight [H K, 1, W] | q_conv1d, k_conv1d, v_conv1d .weight |
    | w_a_down [K, d], w_a_up [H K, K] | f_a_proj, f_b_proj |
    | A_log [H] | A_log ([1, 1, H, 1]) |
    | dt_bias [H K] | dt_bias |
    | w_b [H, d] | b_proj |
    | o_norm [K] | o_norm |
    | w_g [H K, d] | g_proj |
    | w_o [d, H K] | o_proj |
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, K, H = cfg.d_model, cfg.kda_head_dim, cfg.n_heads
        self.n_heads, self.head_dim = H, K
        self.lower_bound = cfg.kda_gate_lower_bound
        self.read_scale = K ** -0.5 if cfg.kda_scaled_read else 1.0
        hd = H * K
        self.w_q = nn.Linear(d, hd, bias=False)
        self.w_k = nn.Linear(d, hd, bias=False)
        self.w_v = nn.Linear(d, hd, bias=False)
        self.conv_size = cfg.kda_conv_size
        if self.conv_size:
            self.q_conv = nn.Conv1d(hd, hd, self.conv_size, groups=hd, bias=False)  # weight only; kernels.short_conv
            self.k_conv = nn.Conv1d(hd, hd, self.conv_size, groups=hd, bias=False)
            self.v_conv = nn.Conv1d(hd, hd, self.conv_size, groups=hd, bias=False)
        self.w_a_down = nn.Linear(d, K, bias=False)
        self.w_a_up = nn.Linear(K, hd, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(hd))
        self.w_b = nn.Linear(d, H, bias=False)
        self.o_norm = RMSNorm(K, cfg.norm_eps)
        self.w_g = nn.Linear(d, hd, bias=False)
        self.w_o = nn.Linear(hd, d, bias=False)

    def conv_weight(self) -> torch.Tensor:
        """The three convolutions as one [3 H K, W] (q, k, v channels concatenated)."""
        return torch.cat([self.q_conv.weight, self.k_conv.weight, self.v_conv.weight])[:, 0]

    def forward(self, x_BSd: torch.Tensor, cache: IterationCache | None = None,
                documents: Documents | None = None) -> torch.Tensor:
        """Training: x [B, S, d] (with `documents`, the recurrence and the convolution restart at every document of
        every row). With a cache: x [1, T, d] packed sequences, each continuing from its state slot (and its
        convolution state)."""
        B, S, _ = x_BSd.shape
        heads = (B, S, self.n_heads, self.head_dim)
        qkv = torch.cat([self.w_q(x_BSd), self.w_k(x_BSd), self.w_v(x_BSd)], dim=-1)
        # every projection of x before the first kernel between a compiled block's graphs: x's gradient is then
        # summed inside one graph's backward, not by eager adds across the graphs
        gate_in = self.w_a_up(self.w_a_down(x_BSd)).view(heads)
        beta = torch.sigmoid(up32(self.w_b(x_BSd)))
        out_gate = torch.sigmoid(self.w_g(x_BSd))
        if self.conv_size:
            if cache is not None:
                qkv = cache.short_conv(qkv, self.conv_weight())
            elif documents is not None:
                qkv = short_conv(qkv.reshape(1, B * S, -1), self.conv_weight(),
                                 cu_seqlens=documents.cu_seqlens)[0].view_as(qkv)
            else:
                qkv = short_conv(qkv, self.conv_weight())[0]
        q, k, v = (t.reshape(heads) for t in qkv.chunk(3, dim=-1))
        # normalised in fp32 and rounded to v's dtype here, inside the compiled block, where fla takes them: not as
        # separate casts around its kernels (and their gradients' casts back)
        q = (F.normalize(up32(q), dim=-1) * self.read_scale).to(v.dtype)
        k = F.normalize(up32(k), dim=-1).to(v.dtype)
        log_alpha = kda_gate(gate_in, self.A_log, self.dt_bias, self.lower_bound)
        if cache is not None:
            o = cache.kda(q, k, v, log_alpha, beta, self.lower_bound).to(x_BSd.dtype)
        elif documents is not None:  # every document a sequence of its own, packed into one row
            packed = [t.reshape((1, B * S) + t.shape[2:]) for t in (q, k, v, log_alpha, beta)]
            o = kda_attention(*packed, cu_seqlens=documents.cu_seqlens,
                              gate_lower_bound=self.lower_bound)[0].view_as(v).to(x_BSd.dtype)
        else:
            o = kda_attention(q, k, v, log_alpha, beta, gate_lower_bound=self.lower_bound)[0].to(x_BSd.dtype)
        o = self.o_norm(o).flatten(2)
        return self.w_o(o * out_gate)


class SiTUFFN(nn.Module):
    """A dense SiTU-GLU FFN on the full-width residual stream (K3's fixed constants, as the routed experts): the
    shared expert (`inner` = shared_inner; HF block_sparse_moe.shared_experts) and the dense layers' FFN (`inner` =
    dense_inner; HF mlp).

    | k3ray | HF |
    |---|---|
    | w_gate [inner, d] | gate_proj |
    | w_up [inner, d] | up_proj |
    | w_out [d, inner] | down_proj |
    """

    def __init__(self, d_model: int, inner: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, inner, bias=False)
        self.w_up = nn.Linear(d_model, inner, bias=False)
        self.w_out = nn.Linear(inner, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(situ_glu(self.w_gate(x), self.w_up(x)))


def attn_res_mix(values_NBSd: torch.Tensor, query_d: torch.Tensor, norm_weight_d: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Block Attention Residuals' read (Kimi Team, "Attention Residuals", 2026, Block AttnRes):

        h = sum_n softmax_n( w . RMSNorm(v_n) ) v_n

    over the values v_0..v_N [N+1, B, S, d] (the committed block summaries, then the current partial block), per
    token; w [d] the learned pseudo-query. Scores and softmax in fp32 (float64 stays float64), returned in the values'
    dtype: fp32 and float64 values directly, bf16/fp16 values through `_AttnResMix` (no fp32 copy of the values and
    no keys materialised; every pass over the values reads them in bf16 and computes in fp32: a tensor-core GEMM with
    fp32 accumulation, a reduction or an elementwise op)."""
    if values_NBSd.dtype in (torch.float32, torch.float64):
        v = values_NBSd
        keys = F.rms_norm(v, (v.shape[-1],), norm_weight_d.to(v.dtype), eps)
        weights = torch.softmax(torch.einsum("d,nbsd->nbs", query_d.to(v.dtype), keys), dim=0)
        return torch.einsum("nbs,nbsd->bsd", weights, v)
    return _AttnResMix.apply(values_NBSd, query_d, norm_weight_d, eps)


class _AttnResMix(torch.autograd.Function):
    """`attn_res_mix` for bf16/fp16 values v [N, B, S, d] (T = B S tokens), written with the norm folded into the
    score: s_nt = r_nt (v_nt . u), r_nt = (|v_nt|^2 / d + eps)^-1/2, u = w * g (g the key norm's weight).

    Forward reads the values twice (r and s in one pass, the mix in another: k3ray.kernels.attn_res_scores and
    attn_res_weighted_sum) and writes only h; scores, the softmax and the mix's sums are fp32, h rounded once.
    Backward, with ds = p (dp - sum_n p dp) from dp = dh . v_n in fp32 (attn_res_value_dots):
        dw = g * X, dg = w * X, X = sum_nt ds r v_nt;
        dv_nt = p_nt dh_t + ds r u - ds s r^2 / d v_nt,
    both in one pass (attn_res_value_grad), fp32 over the values as stored, dv rounded once. ds sums to zero over
    depth while the values share a large common part: X sums the exact values against fp32 coefficients, so no
    per-element bf16 rounding leaks that common part in (bf16 keys, or ds rounded, put those gradients off by a few
    percent when the values are alike)."""

    @staticmethod
    def forward(ctx, values_NBSd, query_d, norm_weight_d, eps):
        N, d = values_NBSd.shape[0], values_NBSd.shape[-1]
        v_NTd = values_NBSd.reshape(N, -1, d)
        wide = torch.float64 if values_NBSd.dtype == torch.float64 else torch.float32
        u = query_d.to(wide) * norm_weight_d.to(wide)
        r, s = attn_res_scores(v_NTd, u, eps)  # [N, T]
        p = torch.softmax(s, dim=0)
        h = attn_res_weighted_sum(p, v_NTd)
        ctx.save_for_backward(values_NBSd, query_d, norm_weight_d, r, s, p)
        return h.view(values_NBSd.shape[1:])

    @staticmethod
    def backward(ctx, grad_BSd):
        values_NBSd, query_d, norm_weight_d, r, s, p = ctx.saved_tensors
        N, d, dt = values_NBSd.shape[0], values_NBSd.shape[-1], values_NBSd.dtype
        v_NTd = values_NBSd.reshape(N, -1, d)
        dh_Td = grad_BSd.reshape(-1, d).to(dt)
        dp = attn_res_value_dots(dh_Td, v_NTd)  # [N, T]
        c_u = p * (dp - (p * dp).sum(0, keepdim=True)) * r  # ds r
        wide = c_u.dtype
        u = query_d.to(wide) * norm_weight_d.to(wide)
        grad_v, X = attn_res_value_grad(p, dh_Td, c_u, c_u * s * r / -d, u, v_NTd)
        grad_query = (norm_weight_d.to(wide) * X).to(query_d.dtype)
        grad_norm = (query_d.to(wide) * X).to(norm_weight_d.dtype)
        return grad_v.view_as(values_NBSd), grad_query, grad_norm, None


class AttnResRead(nn.Module):
    """One Block AttnRes read: its pseudo-query (`proj`, zero at init: a uniform mix) and key norm.

    | k3ray | HF |
    |---|---|
    | attn_res.proj [1, d], attn_res.norm [d] | self_attention_res_proj, self_attention_res_norm |
    | ffn_res.proj, ffn_res.norm | mlp_res_proj, mlp_res_norm |
    | output_res.proj, output_res.norm (last stage) | model.output_attn_res_proj, model.output_attn_res_norm |
    """

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(d_model, 1, bias=False)
        self.norm = RMSNorm(d_model, eps)

    def forward(self, values: list[torch.Tensor]) -> torch.Tensor:
        """values: N+1 tensors [B, S, d] (block summaries, then the partial block) -> [B, S, d]."""
        if len(values) == 1:  # a softmax over one value
            return values[0]
        return attn_res_mix(torch.stack(values), self.proj.weight[0], self.norm.weight, self.norm.eps)
