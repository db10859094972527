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
| short_conv_packed | torch (any device), every packed sequence at once by one gather from indices computed on the host (`packed_conv_index`): serving's chunked prefill |
| short_conv_fla | fla.modules.causal_conv1d on CUDA (training: no state in or out) |
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

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


@dataclass(frozen=True)
class PackedConv:
    """Where `short_conv_packed` gathers from, for N sequences packed into T tokens and a kernel of W, in rows of
    [every sequence's carried state (N (W-1) rows) | x (T rows)]: src [T, W] each token's W inputs; last [N, W-1] each
    sequence's last W-1 inputs (its final state); tails [S, W-1] the W-1 inputs before each of S points (sequence,
    offset): the state a pass that stopped there would carry. int64, built on the host by `packed_conv_index`."""
    src: torch.Tensor
    last: torch.Tensor
    tails: torch.Tensor

    def to(self, device) -> "PackedConv":
        return PackedConv(*(t.to(device) for t in (self.src, self.last, self.tails)))


def packed_conv_index(counts: list[int], W: int, points: list[tuple[int, int]] = ()) -> PackedConv:
    """`PackedConv` of sequences of `counts` tokens (host ints, so no device work and no sync) and `points`."""
    N, w1 = len(counts), W - 1
    lengths = torch.tensor(counts, dtype=torch.int64)
    first = torch.cumsum(lengths, 0) - lengths  # [N] each sequence's first packed token

    def rows(seq: torch.Tensor, ends: torch.Tensor, width: int) -> torch.Tensor:
        """[M, width] the inputs at places ends - width .. ends - 1 of sequences `seq` (< 0: the carried state)."""
        at = ends[:, None] + torch.arange(-width, 0)[None, :]
        return torch.where(at >= 0, N * w1 + first[seq][:, None] + at, seq[:, None] * w1 + w1 + at)

    seq = torch.repeat_interleave(torch.arange(N), lengths)
    place = torch.arange(int(lengths.sum())) - first[seq]
    points_t = torch.tensor(list(points), dtype=torch.int64).reshape(-1, 2)
    return PackedConv(rows(seq, place + 1, W), rows(torch.arange(N), lengths, w1),
                      rows(points_t[:, 0], points_t[:, 1], w1))


def short_conv_packed(x, weight, state, index: PackedConv):
    """Every packed sequence at once from its carried state (x [1, T, C], state [N, W-1, C]) by one gather
    (`index`: `packed_conv_index` on x's device; no host sync, so a CUDA graph can hold it): (y [1, T, C], final
    states [N, W-1, C], tails [S, W-1, C]), the states in state's dtype."""
    N, w1, C = state.shape
    f32 = torch.float64 if x.dtype == torch.float64 else torch.float32
    full = torch.cat([state.reshape(N * w1, C).to(f32), x[0].to(f32)])  # [N (W-1) + T, C]
    y = F.silu((full[index.src] * weight.to(f32).t()[None]).sum(1)).to(x.dtype)[None]
    return y, full[index.last].to(state.dtype), full[index.tails].to(state.dtype)


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
