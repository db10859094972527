"""Inference caches of one pipeline stage, as SGLang keeps them for K3: two pools.

- Gated MLA: the latent [c | k_p] of every past token (c = RMSNorm of the compressed KV [r], k_p the decoupled
  slice [p], K3's layout), in fixed-size pages (`latent[layer]`: [pages, page_size, r + p]). k and v are recomputed
  from it (with RoPE at each position where the model rotates), so the latent alone reproduces the training forward.
- KDA: the recurrent state S [H, K, V] of every sequence, one fixed slot per sequence (`state[layer]`:
  [slots, H, K, V], fp32, float64 for float64 models); its size does not grow with the context. With KDA's short
  convolution (kernel W) each slot also keeps the last W-1 inputs of q, k, v (`conv[layer]`: [slots, W-1, 3 H K]).

`IterationCache` is one iteration's view of the pools: N sequences whose new tokens are packed into one row
(positions, cu_seqlens), each with its page table and state slot. The layers read it through `mla_attention` and
`kda`; sequences with start 0 begin from an empty state whatever their slot held before.

Shapes: T packed tokens of the iteration, N sequences, H heads, h head dim, r kv_rank, P page size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3ray.config import ModelConfig
from k3ray.kernels import kda_attention, kda_decode, short_conv


@dataclass
class CachePools:
    page_size: int
    latent: dict[int, torch.Tensor]  # MLA layer -> [pages, P, r]
    state: dict[int, torch.Tensor]  # KDA layer -> [slots, H, K, V]
    conv: dict[int, torch.Tensor]  # KDA layer -> [slots, W-1, 3 H K] (KDA with a short convolution)


def new_pools(cfg: ModelConfig, layers: range, pages: int, page_size: int, slots: int, device=None) -> CachePools:
    dtype = getattr(torch, cfg.dtype)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    latent, state, conv = {}, {}, {}
    for layer in layers:
        if cfg.layer_kind(layer) == "mla":
            latent[layer] = torch.zeros(pages, page_size, cfg.kv_rank + cfg.mla_rope_dim, dtype=dtype, device=device)
        else:
            h = cfg.kda_head_dim
            state[layer] = torch.zeros(slots, cfg.n_heads, h, h, dtype=state_dtype, device=device)
            if cfg.kda_conv_size:
                conv[layer] = torch.zeros(slots, cfg.kda_conv_size - 1, 3 * cfg.n_heads * h, dtype=dtype,
                                          device=device)
    return CachePools(page_size, latent, state, conv)


@dataclass
class SeqChunk:
    """One sequence's part of an iteration: `n` new tokens at positions start .. start+n-1."""
    start: int
    n: int
    pages: list[int]  # page table, covering at least start + n tokens
    slot: int  # KDA state slot


class IterationCache:
    def __init__(self, pools: CachePools, seqs: list[SeqChunk], device=None):
        self.pools, self.seqs = pools, seqs
        P = pools.page_size
        lens = [s.n for s in seqs]
        self.cu_seqlens = torch.tensor([0] + lens, dtype=torch.int64, device=device).cumsum(0)
        self.positions = torch.cat([torch.arange(s.start, s.start + s.n) for s in seqs]).to(device) if seqs \
            else torch.zeros(0, dtype=torch.int64, device=device)
        # flat row (page * P + offset) of every position each sequence has after this iteration
        rows = [torch.tensor(s.pages, dtype=torch.int64)[torch.arange(s.start + s.n) // P] * P
                + torch.arange(s.start + s.n) % P for s in seqs]
        self.read_rows = [r.to(device) for r in rows]
        self.write_rows = torch.cat([r[s.start:] for r, s in zip(rows, seqs)]).to(device) if seqs \
            else torch.zeros(0, dtype=torch.int64, device=device)
        self.slots = torch.tensor([s.slot for s in seqs], dtype=torch.int64, device=device)
        self.fresh = torch.tensor([s.start == 0 for s in seqs], dtype=torch.bool, device=device)
        self.last_rows = (self.cu_seqlens[1:] - 1) if seqs else self.cu_seqlens[:0]
        self.layer = -1  # set by each block before its attention runs
        self.seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lens, dtype=torch.int64)
                                                    ).to(device)
        # [N] the largest |residual| of each sequence's tokens this iteration (inf: something not finite), for the
        # serving guards, which stop only the sequences that blew up
        self.maxabs = torch.zeros(len(seqs), dtype=torch.float64, device=device)

    def note_activations(self, x_1Td: torch.Tensor) -> None:
        """Fold a block's output (the residual stream) into each sequence's max-abs."""
        if not self.seqs:
            return
        m = x_1Td[0].detach().abs().amax(-1).double()
        m = torch.where(torch.isfinite(m), m, torch.inf)
        self.maxabs = self.maxabs.scatter_reduce(0, self.seq_of_token, m, "amax")

    def mla_attention(self, q_1THh: torch.Tensor, c_1Tr: torch.Tensor, up) -> torch.Tensor:
        """Store this iteration's latents, then causal attention of each sequence's new queries over its whole
        cached context. up(latent [1, L, r + p]) -> (k [1, L, H, h + p], v [1, L, H, h]) at positions 0..L-1.
        Returns [1, T, H, h]."""
        pool = self.pools.latent[self.layer]
        flat = pool.view(-1, pool.shape[-1])
        flat[self.write_rows] = c_1Tr[0]
        outs = []
        for i, s in enumerate(self.seqs):
            k, v = up(flat[self.read_rows[i]][None])
            q = q_1THh[:, self.cu_seqlens[i]:self.cu_seqlens[i + 1]]
            L = s.start + s.n
            mask = torch.arange(L, device=q.device)[None, :] <= torch.arange(s.start, L, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
            outs.append(o.transpose(1, 2))
        return torch.cat(outs, dim=1) if outs else q_1THh.new_zeros(q_1THh.shape)

    def kda(self, q, k, v, g, beta) -> torch.Tensor:
        """KDA over the packed sequences from their slots' states; the final states go back into the slots. Pure
        decode iterations (one token per sequence) take the recurrent kernel, others the chunked one."""
        if not self.seqs:
            return v.new_zeros(v.shape)
        pool = self.pools.state[self.layer]
        s0 = pool[self.slots].masked_fill(self.fresh[:, None, None, None], 0.0)
        kernel = kda_decode if all(s.n == 1 for s in self.seqs) else kda_attention
        o, s1 = kernel(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=self.cu_seqlens)
        pool[self.slots] = s1.to(pool.dtype)
        return o

    def short_conv(self, x_1TC: torch.Tensor, weight_CW: torch.Tensor) -> torch.Tensor:
        """KDA's causal short convolution (+ SiLU) over the packed sequences, each continuing from its slot's last
        W-1 inputs (zeros for a fresh sequence); the new last inputs go back into the slots. x [1, T, 3 H K]."""
        if not self.seqs:
            return x_1TC.new_zeros(x_1TC.shape)
        pool = self.pools.conv[self.layer]
        s0 = pool[self.slots].masked_fill(self.fresh[:, None, None], 0.0)
        y, s1 = short_conv(x_1TC, weight_CW, s0, output_final_state=True, cu_seqlens=self.cu_seqlens)
        pool[self.slots] = s1.to(pool.dtype)
        return y
