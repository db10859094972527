"""Dense K3 blocks: RMSNorm, RoPE, the gated MLA attention, KDA (Kimi Delta Attention) and the shared expert.
The KDA recurrence and its references live in kernels/kda.py.

Shapes: B batch, S sequence, d model width, H heads, h head dim, r MLA latent KV width.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from k3ray.dtypes import up32
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from k3ray.config import ModelConfig
from k3ray.kernels import kda_attention, situ_glu

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
    """Causal multi-head attention with an MLA-style low-rank KV path and a sigmoid output gate.

    q = W_q x; c = RMSNorm(W_dkv x) [r]; k = W_uk c; v = W_uv c; o = softmax(q k^T) v; out = W_o(o * sigmoid(W_g x)).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.d_model, cfg.n_heads * cfg.head_dim
        self.n_heads, self.head_dim, self.theta = cfg.n_heads, cfg.head_dim, cfg.rope_theta
        self.w_q = nn.Linear(d, hd, bias=False)
        self.w_dkv = nn.Linear(d, cfg.kv_rank, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_rank, cfg.norm_eps)
        self.w_uk = nn.Linear(cfg.kv_rank, hd, bias=False)
        self.w_uv = nn.Linear(cfg.kv_rank, hd, bias=False)
        self.w_g = nn.Linear(d, hd, bias=False)
        self.w_o = nn.Linear(hd, d, bias=False)

    def up(self, c_BSr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (with RoPE at positions 0..S-1) and values [B, S, H, h] from latents."""
        heads = c_BSr.shape[:2] + (self.n_heads, self.head_dim)
        return rope(self.w_uk(c_BSr).view(heads), self.theta), self.w_uv(c_BSr).view(heads)

    def forward(self, x_BSd: torch.Tensor, cache: IterationCache | None = None) -> torch.Tensor:
        """Training: x [B, S, d]. With a cache: x [1, T, d], the iteration's new tokens of every sequence packed
        (their latents go into the cache's pages; attention reads each sequence's whole context from there)."""
        B, S, _ = x_BSd.shape
        heads = (B, S, self.n_heads, self.head_dim)
        c = self.kv_norm(self.w_dkv(x_BSd))
        q = rope(self.w_q(x_BSd).view(heads), self.theta, None if cache is None else cache.positions)
        if cache is not None:
            o = cache.mla_attention(q, c, self.up)
        else:
            k, v = self.up(c)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if x_BSd.is_cuda:
                with sdpa_kernel(MLA_CUDA_BACKENDS, set_priority=True):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o = o.transpose(1, 2)
        o = o.flatten(2)  # [B, S, H*h]; also for zero tokens
        return self.w_o(o * torch.sigmoid(self.w_g(x_BSd)))


class KDA(nn.Module):
    """KDA layer: L2-normalised q, k; per-channel forget gate alpha = exp(-softplus(.)) from a low-rank projection;
    beta = sigmoid(W_b x); per-head RMSNorm of the output, a sigmoid output gate, then W_o. The recurrence is
    `kernels.kda_attention`: fla-core's chunk_kda on CUDA, the torch reference elsewhere (kernels/kda.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.kda_head_dim
        self.n_heads, self.head_dim = cfg.n_heads, h
        hd = cfg.n_heads * h
        self.w_q = nn.Linear(d, hd, bias=False)
        self.w_k = nn.Linear(d, hd, bias=False)
        self.w_v = nn.Linear(d, hd, bias=False)
        self.w_a_down = nn.Linear(d, h, bias=False)
        self.w_a_up = nn.Linear(h, hd, bias=True)
        self.w_b = nn.Linear(d, cfg.n_heads, bias=False)
        self.o_norm = RMSNorm(h, cfg.norm_eps)
        self.w_g = nn.Linear(d, hd, bias=False)
        self.w_o = nn.Linear(hd, d, bias=False)

    def forward(self, x_BSd: torch.Tensor, cache: IterationCache | None = None) -> torch.Tensor:
        """Training: x [B, S, d]. With a cache: x [1, T, d] packed sequences, each continuing from its state slot."""
        B, S, _ = x_BSd.shape
        heads = (B, S, self.n_heads, self.head_dim)
        q = F.normalize(up32(self.w_q(x_BSd).view(heads)), dim=-1)
        k = F.normalize(up32(self.w_k(x_BSd).view(heads)), dim=-1)
        v = self.w_v(x_BSd).view(heads)
        log_alpha = -F.softplus(self.w_a_up(self.w_a_down(x_BSd))).view(heads)
        beta = torch.sigmoid(up32(self.w_b(x_BSd)))
        if cache is not None:
            o = cache.kda(q, k, v, log_alpha, beta).to(x_BSd.dtype)
        else:
            o = kda_attention(q, k, v, log_alpha, beta)[0].to(x_BSd.dtype)
        o = self.o_norm(o).flatten(2)
        return self.w_o(o * torch.sigmoid(self.w_g(x_BSd)))


class SharedExpert(nn.Module):
    """A dense SiTU-GLU FFN on the full-width residual stream (K3's fixed constants, as the routed experts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_in = nn.Linear(cfg.d_model, 2 * cfg.shared_inner, bias=False)
        self.w_out = nn.Linear(cfg.shared_inner, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(situ_glu(gate, up))
