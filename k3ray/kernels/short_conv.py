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
| short_conv_packed_reference / _triton | every packed sequence at once from its carried state in the pool, by indices computed on the host (`packed_conv_index`): serving's chunked prefill |
| short_conv_fla | fla.modules.causal_conv1d on CUDA (training: no state in or out) |
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl


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
    """Where serving's packed convolution reads, for N sequences packed into T tokens and a kernel of W: an entry
    r >= 0 is x's row r, an entry < 0 the state pool's row -1 - r (the pool [P, W-1, C] seen as [P (W-1), C]: slot
    s's carried input k at row s (W-1) + k). src [T, W] each token's W inputs; last [N, W-1] each sequence's last W-1
    inputs (its final state); tails [S, W-1] the W-1 inputs before each of S points (sequence, offset): the state a
    pass that stopped there would carry. int64, built on the host by `packed_conv_index`."""
    src: torch.Tensor
    last: torch.Tensor
    tails: torch.Tensor


def packed_conv_index(counts: list[int], slots: list[int], W: int, points: list[tuple[int, int]] = ()
                      ) -> PackedConv:
    """`PackedConv` of sequences of `counts` tokens carried in pool slots `slots` (host ints: no device work, no
    sync) and `points`. Built in numpy: a serving step builds it on the host each prompt iteration."""
    w1 = W - 1
    lengths = np.asarray(counts, dtype=np.int64)
    slot = np.asarray(slots, dtype=np.int64)
    first = np.cumsum(lengths) - lengths  # [N] each sequence's first packed token

    def rows(seq: np.ndarray, ends: np.ndarray, width: int) -> torch.Tensor:
        """[M, width] the inputs at places ends - width .. ends - 1 of sequences `seq` (< 0: the carried state)."""
        at = ends[:, None] + np.arange(-width, 0)[None, :]
        return torch.from_numpy(np.where(at >= 0, first[seq][:, None] + at,
                                         -1 - (slot[seq][:, None] * w1 + w1 + at)).reshape(len(seq), width))

    seq = np.repeat(np.arange(len(counts)), lengths)
    place = np.arange(int(lengths.sum())) - first[seq]
    points_a = np.asarray(list(points), dtype=np.int64).reshape(-1, 2)
    return PackedConv(rows(seq, place + 1, W), rows(np.arange(len(counts)), lengths, w1),
                      rows(points_a[:, 0], points_a[:, 1], w1))


def _read(x_TC: torch.Tensor, pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows `index` names (`PackedConv`) from [x | the pool], fp32 (float64 stays float64): [*index.shape, C]."""
    f32 = torch.float64 if x_TC.dtype == torch.float64 else torch.float32
    full = torch.cat([x_TC.to(f32), pool.reshape(-1, pool.shape[-1]).to(f32)])  # [T + P (W-1), C]
    return full[torch.where(index >= 0, index, x_TC.shape[0] - 1 - index)]


def short_conv_packed_reference(x, weight, pool, index: PackedConv):
    """Every packed sequence at once from its carried state in the pool (x [1, T, C], weight [C, W], pool
    [P, W-1, C]; `index`: `packed_conv_index` on x's device): (y [1, T, C] in x's dtype, final states [N, W-1, C] and
    tails [S, W-1, C] in the pool's), the pool itself unchanged (the caller writes the final states back)."""
    f32 = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.silu((_read(x[0], pool, index.src) * weight.to(f32).t()[None]).sum(1)).to(x.dtype)[None]
    return y, _read(x[0], pool, index.last).to(pool.dtype), _read(x[0], pool, index.tails).to(pool.dtype)


@triton.jit
def _packed_conv_kernel(x_ptr, pool_ptr, w_ptr, src_ptr, y_ptr, C, W: tl.constexpr, BLOCK_C: tl.constexpr):
    # one token t, BLOCK_C channels: its W inputs from x or the pool (`PackedConv`), weighted, summed in fp32, SiLU
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        r = tl.load(src_ptr + t * W + j + tl.zeros([BLOCK_C], dtype=tl.int64))  # the row, one per lane
        row = tl.where(r >= 0, r, -1 - r)
        vx = tl.load(x_ptr + row * C + c, mask=cm & (r >= 0), other=0.0).to(tl.float32)
        vp = tl.load(pool_ptr + row * C + c, mask=cm & (r < 0), other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c * W + j, mask=cm, other=0.0).to(tl.float32)
        acc += (vx + vp) * w
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + t * C + c, y.to(y_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _read_rows_kernel(x_ptr, pool_ptr, index_ptr, out_ptr, C, BLOCK_C: tl.constexpr):
    # one row of the output: x's or the pool's row that `index` names, in the output's dtype
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    r = tl.load(index_ptr + i + tl.zeros([BLOCK_C], dtype=tl.int64))  # the row, one per lane
    row = tl.where(r >= 0, r, -1 - r)
    vx = tl.load(x_ptr + row * C + c, mask=cm & (r >= 0), other=0.0)
    vp = tl.load(pool_ptr + row * C + c, mask=cm & (r < 0), other=0.0)
    v = tl.where(r >= 0, vx.to(out_ptr.dtype.element_ty), vp.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + i * C + c, v, mask=cm)


_CONV_BLOCK_C = 512


def short_conv_packed_triton(x, weight, pool, index: PackedConv):
    """short_conv_packed_reference in two Triton launches: the outputs (each token's inputs read where they are, no
    [T, W, C] gather) and the final states with the tails (one row gather into a new tensor: the pool rows it reads
    are the ones the caller then overwrites)."""
    T, C = x.shape[1], x.shape[2]
    W = weight.shape[1]
    x_TC, pool_c, w = x[0].contiguous(), pool.contiguous(), weight.contiguous()
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(C, _CONV_BLOCK_C)
    if T:
        _packed_conv_kernel[(T, blocks)](x_TC, pool_c, w, index.src.contiguous(), y, C, W=W, BLOCK_C=_CONV_BLOCK_C)
    rows = torch.cat([index.last.reshape(-1), index.tails.reshape(-1)])
    states = torch.empty(rows.numel(), C, dtype=pool.dtype, device=x.device)
    if rows.numel():
        _read_rows_kernel[(rows.numel(), blocks)](x_TC, pool_c, rows, states, C, BLOCK_C=_CONV_BLOCK_C)
    n_last = index.last.numel()
    return (y[None], states[:n_last].view(*index.last.shape, C), states[n_last:].view(*index.tails.shape, C))


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
