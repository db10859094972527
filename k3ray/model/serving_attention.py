"""Gated MLA attention of a serving iteration, split by phase (as vLLM's MLA backend and DeepSeek serve it).

- Decode rows (one new token): the absorbed form over the paged latents. Scores q_n . (W_uk c) = (W_uk^T q_n) . c
  and o = W_uv (sum_j p_j c_j), so attention runs over the latents themselves (one shared key/value head of width
  r + p / r), never over [N, Lc, H, h] keys and values; one query per row, so the score tensor is [N, H, 1, Lc].
  With RoPE (K2's layout) keys depend on positions after the up-projection: they are recomputed from the latents.
- Prompt rows (a chunk of n > 1 new tokens): the non-absorbed form. The row's own context (cached prefix + chunk,
  L tokens) is up-projected to keys and values and attended causally (query t sees keys <= L - n + t:
  bottom-right aligned). On CUDA all of an iteration's prompt rows take one call of flash attention over packed
  variable-length segments (`prompt_rows_attention_varlen`: their contexts up-projected together, in groups of at
  most PROMPT_CONTEXT_GROUP context tokens), not a call per row: the per-row form dispatched ~12 ops a row from the
  host. Elsewhere, and as the reference, one row at a time by torch's fused attention (`prompt_rows_attention_
  reference`): no padding to the longest chunk, no fp32 score tensor; a context longer than PREFIX_CHUNK runs
  blockwise, its partial results merged by log-sum-exp (`blockwise_attention`, plain torch).

Shapes: N decode rows, n a prompt row's new tokens, L its context, H heads, h head dim, e = h + p query/key width,
r kv_rank, Lc the decode rows' context bucket.
"""
from __future__ import annotations

import functools
import inspect
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from k3ray.dtypes import up32

FLASH_DTYPES = (torch.bfloat16, torch.float16)
PREFIX_CHUNK = 16384  # contexts up to this many tokens take one fused call; longer ones run blockwise
# the prompt rows of one packed attention call hold at most this many context tokens (unless one row alone has more):
# their keys and values up-projected at once, ~32 KB a token at gpu2's 32 heads (with v padded to q's width)
PROMPT_CONTEXT_GROUP = 32768
QUERY_BLOCK = 1024  # queries per block of the blockwise form (its fp32 scores: [H, QUERY_BLOCK, PREFIX_CHUNK])
# Prompt segments on CUDA: flash (or memory-efficient) attention only. cuDNN's attention, torch's first choice on
# Hopper, builds a plan for every new shape (n, L): ~65 ms of host time per prompt segment on an H200, where the
# attention itself takes ~0.1 ms, and every iteration brings new shapes.
PROMPT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def decode_attention(q_NHe: torch.Tensor, lat_NLl: torch.Tensor, in_context_NL: torch.Tensor, mla) -> torch.Tensor:
    """One query per row over its paged latents lat [N, Lc, r + p] (positions past the row's own masked by
    in_context [N, Lc]). `mla` is the layer (layers.GatedMLA). Returns [N, H, h]."""
    # positions past a row's end are masked, but whatever a reused page still holds there (even NaN from a
    # request that blew up) must not reach the value sum: 0 * NaN is NaN
    lat = lat_NLl.masked_fill(~in_context_NL[..., None], 0.0)
    mask = in_context_NL[:, None, None, :]  # [N, 1, 1, Lc]
    q = q_NHe[:, None]  # [N, 1, H, e]
    if mla.rotate:
        k, v = mla.up(lat)  # [N, Lc, H, e], [N, Lc, H, h]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=mla.scale).transpose(1, 2)
        return o[:, 0]
    H, h, r = mla.n_heads, mla.head_dim, mla.kv_rank
    w_ukv = mla.w_ukv.weight.view(H, 2 * h, r)
    q_n, q_p = q.split([h, q.shape[-1] - h], dim=-1)
    q_lat = torch.cat([torch.einsum("nthd,hdr->nthr", q_n, w_ukv[:, :h]), q_p], dim=-1)  # [N, 1, H, r + p]
    scores = up32(torch.einsum("nthe,nle->nhtl", q_lat, lat)) * mla.scale  # [N, H, 1, Lc]
    probs = torch.softmax(scores.masked_fill(~mask, -torch.inf), dim=-1).to(lat.dtype)
    o_lat = torch.einsum("nhtl,nlr->nthr", probs, lat[..., :r])  # [N, 1, H, r]
    return torch.einsum("nthr,hdr->nthd", o_lat, w_ukv[:, h:])[:, 0]  # [N, H, h]


def prompt_attention(q_nHe: torch.Tensor, lat_Ll: torch.Tensor, mla) -> torch.Tensor:
    """A prompt row's n new queries over its whole context lat [L, r + p] (positions 0..L-1, the last n its own
    new tokens), non-absorbed: keys and values up-projected, causal bottom-right. Returns [n, H, h]."""
    k, v = mla.up(lat_Ll[None])  # [1, L, H, e], [1, L, H, h]
    if lat_Ll.shape[0] > PREFIX_CHUNK:
        return blockwise_attention(q_nHe, k[0], v[0], mla.scale, PREFIX_CHUNK)
    return segment_attention(q_nHe, k[0], v[0], mla.scale)


@dataclass(frozen=True)
class PromptSegments:
    """Prompt rows packed back to back for one attention call. Per row (host ints) its new tokens and its context
    (cached + new); `queries` and `contexts` the slices of the iteration's packed prompt queries and packed contexts
    they occupy; cu_q, cu_k [R + 1] int32 on the device: each row's offsets within those slices."""
    counts: list[int]
    lengths: list[int]
    queries: slice
    contexts: slice
    cu_q: torch.Tensor
    cu_k: torch.Tensor


def prompt_segments(counts: list[int], lengths: list[int], cu_device: torch.Tensor) -> list[PromptSegments]:
    """The prompt rows (new tokens and contexts, in order) cut into groups of at most PROMPT_CONTEXT_GROUP context
    tokens (a longer row alone), each one `PromptSegments`; cu_device: `segment_offsets(...)` on the device, int32."""
    out, q0, k0, at = [], 0, 0, 0
    for a, b in _groups(lengths):
        n, L = sum(counts[a:b]), sum(lengths[a:b])
        r = b - a
        out.append(PromptSegments(counts[a:b], lengths[a:b], slice(q0, q0 + n), slice(k0, k0 + L),
                                  cu_device[at:at + r + 1], cu_device[at + r + 1:at + 2 * r + 2]))
        q0, k0, at = q0 + n, k0 + L, at + 2 * r + 2
    return out


def segment_offsets(counts: list[int], lengths: list[int]) -> list[int]:
    """On the host, for `prompt_segments`: per group its cu_q then its cu_k, back to back."""
    out = []
    for a, b in _groups(lengths):
        for sizes in (counts[a:b], lengths[a:b]):
            out.append(0)
            for x in sizes:
                out.append(out[-1] + x)
    return out


def _groups(lengths: list[int]) -> list[tuple[int, int]]:
    """Consecutive row ranges [a, b) of at most PROMPT_CONTEXT_GROUP context tokens each (a longer row alone)."""
    out, a, total = [], 0, 0
    for i, L in enumerate(lengths):
        if i > a and total + L > PROMPT_CONTEXT_GROUP:
            out.append((a, i))
            a, total = i, 0
        total += L
    if lengths:
        out.append((a, len(lengths)))
    return out


def prompt_rows_attention(q_mHe: torch.Tensor, lat_Sl: torch.Tensor, seg: PromptSegments, mla,
                          positions_S: torch.Tensor | None = None) -> torch.Tensor:
    """The prompt rows of `seg`: their queries packed q [m, H, e] over their contexts packed lat [S, r + p]
    (positions_S: each context token's position, where the model rotates keys) -> [m, H, h]. One flash call on
    CUDA in bf16 or fp16 with q's width a multiple of 8 (what flash takes), else a fused call a row."""
    if q_mHe.is_cuda and q_mHe.dtype in FLASH_DTYPES and q_mHe.shape[-1] % 8 == 0 and varlen_attention() is not None:
        return prompt_rows_attention_varlen(q_mHe, lat_Sl, seg, mla, positions_S)
    return prompt_rows_attention_reference(q_mHe, lat_Sl, seg, mla, positions_S)


def prompt_rows_attention_varlen(q_mHe: torch.Tensor, lat_Sl: torch.Tensor, seg: PromptSegments, mla,
                                 positions_S: torch.Tensor | None = None) -> torch.Tensor:
    """`prompt_rows_attention` in one call of torch's flash attention over packed segments (causal: bottom-right
    aligned, as flash aligns a query block shorter than its keys); v zero-padded to q's width (exact)."""
    k, v = mla.up(lat_Sl[None], positions_S)  # [1, S, H, e], [1, S, H, h]
    h = v.shape[-1]
    v = F.pad(v[0], (0, q_mHe.shape[-1] - h)) if h < q_mHe.shape[-1] else v[0]
    varlen_attn, takes = varlen_attention()
    # MLA's scale is (h + p)^-0.5, flash's default for q's width: passed where this torch takes it
    scale = {"scale": mla.scale} if "scale" in takes else {}
    o = varlen_attn(q_mHe, k[0], v, seg.cu_q, seg.cu_k, max(seg.counts), max(seg.lengths), window_size=(-1, 0),
                    **scale)
    return o[..., :h]


@functools.cache
def varlen_attention():
    """torch's flash attention over packed segments and the arguments it takes, where this torch has it with the
    causal mask as window_size=(-1, 0) (2.11 on); else None. Imported on first use: the module imports torch._dynamo
    (~1 s of CPU), which a worker without CUDA never pays."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - older torch
        return None
    takes = set(inspect.signature(varlen_attn).parameters)
    return (varlen_attn, takes) if "window_size" in takes else None


def prompt_rows_attention_reference(q_mHe: torch.Tensor, lat_Sl: torch.Tensor, seg: PromptSegments, mla,
                                    positions_S: torch.Tensor | None = None) -> torch.Tensor:
    """`prompt_rows_attention` a row at a time (`prompt_attention`: each row's context at positions 0..L-1, as
    positions_S holds them)."""
    out, q0, k0 = [], 0, 0
    for n, L in zip(seg.counts, seg.lengths):
        out.append(prompt_attention(q_mHe[q0:q0 + n], lat_Sl[k0:k0 + L], mla))
        q0, k0 = q0 + n, k0 + L
    return torch.cat(out)


def segment_attention(q_nHe: torch.Tensor, k_LHe: torch.Tensor, v_LHh: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last n of L positions over all L (query t sees keys <= L - n + t) by torch's fused
    attention -> [n, H, h]. On CUDA a narrower v is zero-padded to q's width for the fused kernels (exact)."""
    n, L = q_nHe.shape[0], k_LHe.shape[0]
    q, k, v = q_nHe.transpose(0, 1)[None], k_LHe.transpose(0, 1)[None], v_LHh.transpose(0, 1)[None]
    h = v.shape[-1]
    if q.is_cuda and h < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - h))
    if n == L:
        how = {"is_causal": True}
    else:  # imported here: torch.nn.attention.bias imports torch._dynamo (~1 s of CPU in every worker process)
        from torch.nn.attention.bias import causal_lower_right
        how = {"attn_mask": causal_lower_right(n, L)}
    with sdpa_kernel(PROMPT_BACKENDS) if q.is_cuda else nullcontext():
        o = F.scaled_dot_product_attention(q, k, v, scale=scale, **how)[..., :h]
    return o[0].transpose(0, 1)


def blockwise_attention(q_nHe: torch.Tensor, k_LHe: torch.Tensor, v_LHh: torch.Tensor, scale: float,
                        chunk: int, query_block: int = QUERY_BLOCK) -> torch.Tensor:
    """`segment_attention` in plain torch over blocks of queries and key chunks, the partial results of a query
    block merged by log-sum-exp (flash attention's recurrence): memory bounded by [H, query_block, chunk] whatever L.
    -> [n, H, h]."""
    n, L = q_nHe.shape[0], k_LHe.shape[0]
    out = []
    for q0 in range(0, n, query_block):
        q = q_nHe[q0:q0 + query_block].transpose(0, 1)  # [H, b, e]
        q_pos = torch.arange(L - n + q0, L - n + q0 + q.shape[1], device=q.device)
        last = int(L - n + q0 + q.shape[1])  # keys past the block's last query are masked for all of it
        acc, lse = None, None
        for k0 in range(0, last, chunk):
            k, v = k_LHe[k0:min(k0 + chunk, last)].transpose(0, 1), v_LHh[k0:min(k0 + chunk, last)].transpose(0, 1)
            k_pos = torch.arange(k0, k0 + k.shape[1], device=q.device)
            s = up32(q @ k.transpose(1, 2)) * scale  # [H, b, c]
            s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], -torch.inf)
            part_lse = torch.logsumexp(s, dim=-1)  # [H, b]; -inf where a query sees none of this chunk
            o = torch.softmax(s, dim=-1).nan_to_num(0.0).to(v.dtype) @ v  # [H, b, h]
            acc, lse = merge_lse(acc, lse, o, part_lse)
        out.append(acc.transpose(0, 1))
    return torch.cat(out)


def merge_lse(acc, lse, o, part_lse):
    """Merge two partial attention results over disjoint keys: outputs weighted by exp(lse - new lse)."""
    if acc is None:
        return o, part_lse
    new = torch.logaddexp(lse, part_lse)
    w_old = torch.exp(lse - new).nan_to_num(0.0)[..., None]
    w_new = torch.exp(part_lse - new).nan_to_num(0.0)[..., None]
    return (acc * w_old.to(acc.dtype) + o * w_new.to(o.dtype)), new
