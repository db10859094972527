"""Dispatch permute and combine unpermute between token order and expert-grouped order.

T tokens, K routes per token, D width, N rows of the expert-grouped layout (N >= number of valid routes).
dest [T, K] int64: row of the grouped layout that route (t, k) goes to, or -1 for a route that goes nowhere
(dropped, or sent to another rank by a layout that holds only local rows).
"""
from __future__ import annotations

import torch
from k3ray.dtypes import up32


def permute_rows_reference(x: torch.Tensor, dest: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x [T, D], dest [T, K] -> out [num_rows, D] with out[dest[t, k]] = x[t]; rows nothing targets are zero."""
    keep = dest >= 0
    token = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(dest)
    out = x.new_zeros(num_rows, x.shape[1])
    return out.index_copy(0, dest[keep], x[token[keep]])


def unpermute_rows_reference(y: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [N, D], dest [T, K], weights [T, K] -> out [T, D] = sum_k weights[t, k] * y[dest[t, k]] (fp32 sum)."""
    safe = dest.clamp(min=0)
    w = torch.where(dest >= 0, up32(weights), 0.0)
    gathered = up32(y[safe.reshape(-1)].reshape(*dest.shape, y.shape[1]))
    return (gathered * w.unsqueeze(-1)).sum(1).to(y.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Triton path. Dispatch writes every grouped row exactly once: an inverse map src[r] = t*K + k (route feeding row r,
# -1 if none; T*K ints, built with one scatter) lets each program gather its rows straight from x, zero-filling
# untargeted rows, with no padded intermediate. Combine gathers the K rows of a token and sums them in fp32.
# Backward: permute's is a combine with unit weights; unpermute's is a dispatch gather scaled by the route's weight,
# fused with d weights[t, k] = <dout[t], y[dest[t, k]]>.
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit(do_not_specialize=["num_rows"])  # row counts change every call: compile once
def _gather_rows_kernel(x_ptr, src_ptr, w_ptr, out_ptr, y_ptr, dw_ptr, num_rows, D, K, sx, sy,
                        HAS_W: tl.constexpr, HAS_DOT: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """out[r] = w[src[r]] * x[src[r] // K] (0 if src[r] < 0); HAS_DOT: dw[src[r]] = <x[src[r] // K], y[r]>."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < num_rows
    route = tl.load(src_ptr + rows, mask=rmask, other=-1)
    valid = route >= 0
    tok = tl.where(valid, route // K, 0).to(tl.int64)
    if HAS_W:
        w = tl.load(w_ptr + route, mask=valid, other=0.0).to(tl.float32)
    dot = tl.zeros((BR,), dtype=tl.float32)
    r64 = rows.to(tl.int64)
    for d0 in range(0, D, BD):
        cols = d0 + tl.arange(0, BD)
        cm = cols < D
        v = tl.load(x_ptr + tok[:, None] * sx + cols[None, :], mask=valid[:, None] & cm[None, :], other=0.0)
        if HAS_DOT:
            yv = tl.load(y_ptr + r64[:, None] * sy + cols[None, :], mask=valid[:, None] & cm[None, :], other=0.0)
            dot += tl.sum(v.to(tl.float32) * yv.to(tl.float32), axis=1)
        if HAS_W:
            v = v.to(tl.float32) * w[:, None]
        tl.store(out_ptr + r64[:, None] * D + cols[None, :], v.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cm[None, :])
    if HAS_DOT:
        tl.store(dw_ptr + route, dot.to(dw_ptr.dtype.element_ty), mask=valid)


@triton.jit(do_not_specialize=["T"])  # row counts change every call: compile once
def _combine_kernel(y_ptr, dest_ptr, w_ptr, out_ptr, T, D, K, sy,
                    HAS_W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """out[t, cols] = sum_k w[t, k] * y[dest[t, k], cols] (fp32 sum; routes with dest < 0 skipped)."""
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    tm = toks < T
    cm = cols < D
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for k in range(0, K):
        r = tl.load(dest_ptr + toks * K + k, mask=tm, other=-1)
        ok = r >= 0
        v = tl.load(y_ptr + r.to(tl.int64)[:, None] * sy + cols[None, :], mask=ok[:, None] & cm[None, :], other=0.0)
        if HAS_W:
            w = tl.load(w_ptr + toks * K + k, mask=ok, other=0.0).to(tl.float32)
            acc += v.to(tl.float32) * w[:, None]
        else:
            acc += v.to(tl.float32)
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * D + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])


_BR, _BD_GATHER, _BT, _BD_COMBINE = 4, 512, 8, 256


def _inverse_routes(dest: torch.Tensor, num_rows: int) -> torch.Tensor:
    """src [num_rows] int32: the route t*K + k that targets each row, -1 for none (one scatter, no host sync)."""
    flat = dest.reshape(-1)
    src = torch.full((num_rows + 1,), -1, device=dest.device, dtype=torch.int32)
    slot = torch.where(flat >= 0, flat, num_rows)
    src.scatter_(0, slot, torch.arange(flat.numel(), device=dest.device, dtype=torch.int32))
    return src[:num_rows]


def _gather(x, src, k, num_rows, w=None, y=None, dw=None):
    d = x.shape[1]
    out = torch.empty(num_rows, d, device=x.device, dtype=x.dtype)
    if num_rows:
        _gather_rows_kernel[(triton.cdiv(num_rows, _BR),)](
            x, src, w if w is not None else x, out, y if y is not None else x, dw if dw is not None else x,
            num_rows, d, k, x.stride(0), y.stride(0) if y is not None else 0,
            HAS_W=w is not None, HAS_DOT=y is not None, BR=_BR, BD=min(_BD_GATHER, triton.next_power_of_2(d)),
        )
    return out


def _combine(y, dest, w=None):
    t, k = dest.shape
    d = y.shape[1]
    out = torch.empty(t, d, device=y.device, dtype=y.dtype)
    if t:
        bd = min(_BD_COMBINE, triton.next_power_of_2(d))
        _combine_kernel[(triton.cdiv(t, _BT), triton.cdiv(d, bd))](
            y, dest, w if w is not None else y, out, t, d, k, y.stride(0), HAS_W=w is not None, BT=_BT, BD=bd,
        )
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dest, num_rows):
        ctx.save_for_backward(dest)
        return _gather(x, _inverse_routes(dest, num_rows), dest.shape[1], num_rows)

    @staticmethod
    def backward(ctx, dout):
        (dest,) = ctx.saved_tensors
        return _combine(dout.contiguous(), dest), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, dest, weights):
        ctx.save_for_backward(y, dest, weights)
        return _combine(y, dest, weights)

    @staticmethod
    def backward(ctx, dout):
        y, dest, weights = ctx.saved_tensors
        dw = torch.zeros_like(weights)
        dy = _gather(dout.contiguous(), _inverse_routes(dest, y.shape[0]), dest.shape[1], y.shape[0],
                     w=weights, y=y, dw=dw)
        return dy, None, dw


def permute_rows_triton(x: torch.Tensor, dest: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Same contract as `permute_rows_reference` (each valid row targeted by at most one route); differentiable."""
    return _Permute.apply(x.contiguous(), dest.contiguous(), int(num_rows))


def unpermute_rows_triton(y: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Same contract as `unpermute_rows_reference`; differentiable w.r.t. y and weights."""
    return _Unpermute.apply(y.contiguous(), dest.contiguous(), weights.contiguous())
