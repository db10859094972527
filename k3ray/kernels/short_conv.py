"""KDA's causal short convolution: a depthwise convolution over the last W tokens of each channel, then SiLU.

    y_t[c] = silu( sum_{j=0}^{W-1} weight[c, j] * x_{t-W+1+j}[c] )        (x_s = 0 before a sequence starts,
                                                                           or the carried state when decoding)

Shapes: B batch, T tokens, C channels (q, k, v concatenated: 3 H K), W kernel size. x [B, T, C]; weight [C, W] (the
checkpoint's conv1d weight [C, 1, W] squeezed); state [N, W-1, C]: the last W-1 inputs of each of N sequences (zeros
for a fresh one). cu_seqlens [N + 1] packs N sequences into B = 1 (as in kernels/kda.py). Every function returns
(y [B, T, C] in x's dtype, final state [N, W-1, C] or None) and takes (x, weight, state=None, output_final_state=False,
cu_seqlens=None).

| function | what |
|---|---|
| short_conv_reference | torch (any device), one sequence at a time; carries the state |
| short_conv_varlen | torch (any device), every packed sequence at once by one gather: serving's chunked prefill |
| short_conv_fla | fla.modules.causal_conv1d on CUDA (training: no state in or out) |
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _conv_one(x_BTC: torch.Tensor, weight_CW: torch.Tensor, state_BwC: torch.Tensor | None):
    """One batch of equal-length rows; fp32 inside (float64 stays float64)."""
    W = weight_CW.shape[1]
    f32 = torch.float64 if x_BTC.dtype == torch.float64 else torch.float32
    x = x_BTC.to(f32)
    past = x.new_zeros(x.shape[0], W - 1, x.shape[2]) if state_BwC is None else state_BwC.to(f32)
    full = torch.cat([past, x], dim=1)                                   # [B, W-1+T, C]
    y = F.conv1d(full.transpose(1, 2), weight_CW.to(f32)[:, None, :], groups=x.shape[2]).transpose(1, 2)
    return F.silu(y).to(x_BTC.dtype), full[:, full.shape[1] - (W - 1):]


def short_conv_reference(x, weight, state=None, output_final_state=False, cu_seqlens=None):
    if cu_seqlens is None:
        y, s = _conv_one(x, weight, state)
        return y, (s.to(x.dtype if state is None else state.dtype) if output_final_state else None)
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed into batch 1, got batch {x.shape[0]}")
    bounds = cu_seqlens.tolist()
    ys, states = [], []
    for n in range(len(bounds) - 1):
        y, s = _conv_one(x[:, bounds[n]:bounds[n + 1]], weight, None if state is None else state[n:n + 1])
        ys.append(y)
        states.append(s)
    y = torch.cat(ys, dim=1) if ys else x.new_zeros(x.shape)
    if not output_final_state:
        return y, None
    out_dtype = x.dtype if state is None else state.dtype
    final = torch.cat(states).to(out_dtype) if states else x.new_zeros(0, weight.shape[1] - 1, x.shape[2])
    return y, final


def short_conv_varlen(x, weight, state=None, output_final_state=False, cu_seqlens=None):
    """`short_conv_reference` with the packed sequences all at once (no loop, no host sync: a CUDA graph can hold
    it): each token's W inputs gathered from [carried states | x], then one weighted sum. Without cu_seqlens, the
    reference (rows of equal length are one batched convolution already)."""
    if cu_seqlens is None:
        return short_conv_reference(x, weight, state, output_final_state)
    if x.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed into batch 1, got batch {x.shape[0]}")
    T, C, W, N = x.shape[1], x.shape[2], weight.shape[1], cu_seqlens.numel() - 1
    f32 = torch.float64 if x.dtype == torch.float64 else torch.float32
    dev, w1 = x.device, W - 1
    past = x.new_zeros(N, w1, C, dtype=f32) if state is None else state.to(f32)
    full = torch.cat([past.reshape(N * w1, C), x[0].to(f32)])  # [N (W-1) + T, C]
    cu = cu_seqlens.to(dev, torch.int64)
    t = torch.arange(T, device=dev)
    seq = torch.searchsorted(cu[1:], t, right=True)  # [T] each token's sequence
    j = t - cu[seq]  # [T] its place in the sequence
    d = torch.arange(w1, -1, -1, device=dev)  # [W] how far back weight column w reads: W-1-w
    back = j[:, None] - d[None, :]  # [T, W] the input's place in the sequence (< 0: in the carried state)
    src = torch.where(back >= 0, N * w1 + t[:, None] - d[None, :], seq[:, None] * w1 + w1 + back)
    y = F.silu((full[src] * weight.to(f32).t()[None]).sum(1)).to(x.dtype)[None]  # [1, T, C]
    if not output_final_state:
        return y, None
    lengths = cu[1:] - cu[:-1]
    k = torch.arange(-w1, 0, device=dev)  # the last W-1 places, relative to each sequence's end
    at = lengths[:, None] + k[None, :]  # [N, W-1]
    idx = torch.where(at >= 0, N * w1 + cu[:-1, None] + at, torch.arange(N, device=dev)[:, None] * w1 + w1 + at)
    return y, full[idx].to(x.dtype if state is None else state.dtype)


@functools.cache
def fla_conv():
    """fla.modules.causal_conv1d if fla-core is installed, else None."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return None
    return causal_conv1d


def short_conv_fla(x, weight, state=None, output_final_state=False, cu_seqlens=None):
    """fla's Triton causal_conv1d with SiLU fused (weight [C, W]); no state: the training path."""
    if state is not None or output_final_state:
        raise ValueError("short_conv_fla runs without a carried state; decoding takes short_conv_reference")
    y, _ = fla_conv()(x, weight.to(x.dtype), activation="silu", cu_seqlens=cu_seqlens)
    return y.to(x.dtype), None
