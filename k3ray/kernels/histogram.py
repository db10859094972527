"""Per-expert histogram for Quantile Balancing: counts[e, b] = #tokens t with values[t, e] in bin b.

Bins split [lo, hi) evenly; values below lo count in bin 0 and values at or above hi in the last bin (clamped), so
every token lands in exactly one bin per expert and the counts of a column sum to T.
"""
from __future__ import annotations

import torch


def score_histogram_reference(values: torch.Tensor, lo: float, hi: float, bins: int) -> torch.Tensor:
    """values [T, E] -> counts [E, bins] int64."""
    num_experts = values.shape[1]
    idx = ((values.float() - lo) * (bins / (hi - lo))).floor().clamp(0, bins - 1).long()
    flat = (idx + torch.arange(num_experts, device=values.device) * bins).reshape(-1)
    return torch.bincount(flat, minlength=num_experts * bins).reshape(num_experts, bins)


# ---------------------------------------------------------------------------------------------------------------------
# Triton path: one pass over values; each program bins a [BT, BE] block and adds 1 per element with an atomic.
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit(do_not_specialize=["T"])  # row counts change every call: compile once
def _histogram_kernel(v_ptr, counts_ptr, T, E, sv, lo, scale, BINS: tl.constexpr, BT: tl.constexpr,
                      BE: tl.constexpr):
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    ex = tl.program_id(1) * BE + tl.arange(0, BE)
    mask = (toks < T)[:, None] & (ex < E)[None, :]
    v = tl.load(v_ptr + toks.to(tl.int64)[:, None] * sv + ex[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.floor((v - lo) * scale)
    b = tl.minimum(tl.maximum(b, 0.0), BINS - 1).to(tl.int32)
    tl.atomic_add(counts_ptr + ex[None, :] * BINS + b, tl.full((BT, BE), 1, tl.int32), mask=mask)


def score_histogram_triton(values: torch.Tensor, lo: float, hi: float, bins: int) -> torch.Tensor:
    """Same contract as `score_histogram_reference` (int32 counts inside, so T < 2**31)."""
    t, e = values.shape
    counts = torch.zeros(e, bins, device=values.device, dtype=torch.int32)
    if t and e:
        values = values.contiguous()
        bt, be = 64, 32
        _histogram_kernel[(triton.cdiv(t, bt), triton.cdiv(e, be))](
            values, counts, t, e, values.stride(0), float(lo), bins / (hi - lo), BINS=bins, BT=bt, BE=be,
        )
    return counts.to(torch.int64)
