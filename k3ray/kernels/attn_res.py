"""A Block AttnRes read (k3ray.model.layers `_AttnResMix`) in passes over memory: each reads the values once.

For N values v [N, T, d] (the block summaries and the partial block, T tokens), u [d] = w * g (the pseudo-query times
the key norm's weight) and the norm's eps, the read is

    r[n, t] = (|v[n, t]|^2 / d + eps)^-1/2,  s[n, t] = r[n, t] (v[n, t] . u),  p = softmax_n(s),
    h[t] = sum_n p[n, t] v[n, t]

and its backward, from the incoming dh [T, d]:

    dp[n, t] = dh[t] . v[n, t]
    dv[n, t, :] = p[n, t] dh[t, :] + a[n, t] u[:] + b[n, t] v[n, t, :],   x = sum_nt a[n, t] v[n, t, :]

(a = ds r, b = -ds s r^2 / d: the score's gradient through the folded RMSNorm; x gives the pseudo-query's and the
norm's gradients). Every sum is in fp32 over the values as stored, rounded once to v's dtype where the result has
v's shape. Written with torch ops in a bf16 model these are batched GEMVs (the mix [T, 1, N] @ [T, N, d] and dp
[T, 1, d] @ [T, d, N] ran at ~1/8 and ~1/3 of HBM bandwidth on an H200), a norm, two GEMMs against a two-column
operand and a multiply with two mixed-dtype `addcmul_`s; each kernel here is one launch and one read of the values.

Shapes: v [N, T, d] (bf16/fp16/fp32, contiguous), u [d] fp32, p, a, b, r, s, dp [N, T] fp32, dh, h [T, d]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_T, _BLOCK_D = 16, 256


def _wide(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def attn_res_scores_reference(v_NTd: torch.Tensor, u_d: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    wide = _wide(v_NTd)
    v = v_NTd.to(wide)
    r = torch.rsqrt(v.square().sum(-1) / v.shape[-1] + eps)
    return r, r * (v @ u_d.to(wide))


def attn_res_weighted_sum_reference(p_NT: torch.Tensor, v_NTd: torch.Tensor) -> torch.Tensor:
    wide = _wide(v_NTd)
    return (p_NT.to(wide)[..., None] * v_NTd.to(wide)).sum(0).to(v_NTd.dtype)


def attn_res_value_dots_reference(dh_Td: torch.Tensor, v_NTd: torch.Tensor) -> torch.Tensor:
    wide = _wide(v_NTd)
    return (v_NTd.to(wide) * dh_Td.to(wide)).sum(-1)


def attn_res_value_grad_reference(p_NT: torch.Tensor, dh_Td: torch.Tensor, a_NT: torch.Tensor, b_NT: torch.Tensor,
                                  u_d: torch.Tensor, v_NTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    wide = _wide(v_NTd)
    v = v_NTd.to(wide)
    dv = p_NT[..., None].to(wide) * dh_Td.to(wide) + a_NT[..., None].to(wide) * u_d.to(wide) \
        + b_NT[..., None].to(wide) * v
    return dv.to(v_NTd.dtype), torch.einsum("nt,ntd->d", a_NT.to(wide), v)


@triton.jit
def _scores_kernel(v_ptr, u_ptr, r_ptr, s_ptr, R, d, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # BLOCK_R rows of v [R = N T, d]: |v|^2 and v . u in one sweep over the row
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = rows < R
    base = rows.to(tl.int64)[:, None] * d
    square = tl.zeros([BLOCK_R], dtype=tl.float32)
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    for f0 in range(0, d, BLOCK_D):
        f = f0 + tl.arange(0, BLOCK_D)
        fm = f < d
        v = tl.load(v_ptr + base + f[None, :], mask=rm[:, None] & fm[None, :], other=0.0).to(tl.float32)
        u = tl.load(u_ptr + f, mask=fm, other=0.0)
        square += tl.sum(v * v, axis=1)
        dot += tl.sum(v * u[None, :], axis=1)
    r = 1.0 / tl.sqrt_rn(square / d + eps)
    tl.store(r_ptr + rows, r, mask=rm)
    tl.store(s_ptr + rows, r * dot, mask=rm)


@triton.jit
def _weighted_sum_kernel(p_ptr, v_ptr, h_ptr, N, T, d, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    f = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tm = t < T
    mask = tm[:, None] & (f < d)[None, :]
    td = t.to(tl.int64)[:, None] * d + f[None, :]
    h = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for n in range(N):
        p = tl.load(p_ptr + n * T + t, mask=tm, other=0.0)
        v = tl.load(v_ptr + n * T * d.to(tl.int64) + td, mask=mask, other=0.0).to(tl.float32)
        h += p[:, None] * v
    tl.store(h_ptr + td, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _value_dots_kernel(dh_ptr, v_ptr, dp_ptr, T, d, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # one value n (axis 1) for BLOCK_T tokens; the N programs of a token tile read the same dh rows (from L2)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1)
    tm = t < T
    base = t.to(tl.int64)[:, None] * d
    vbase = n * T * d.to(tl.int64) + base
    dot = tl.zeros([BLOCK_T], dtype=tl.float32)
    for f0 in range(0, d, BLOCK_D):
        f = f0 + tl.arange(0, BLOCK_D)
        mask = tm[:, None] & (f < d)[None, :]
        dh = tl.load(dh_ptr + base + f[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + vbase + f[None, :], mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(dh * v, axis=1)
    tl.store(dp_ptr + n * T + t, dot, mask=tm)


@triton.jit
def _value_grad_kernel(p_ptr, dh_ptr, a_ptr, b_ptr, u_ptr, v_ptr, out_ptr, x_part_ptr, N, T, d,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # one tile of BLOCK_T tokens x BLOCK_D features; dh and u are read once and serve all N values; the tile's share
    # of x goes to its own row of x_part [cdiv(T, BLOCK_T), d] (summed after: the same order every run)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    f = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tm, fm = t < T, f < d
    mask = tm[:, None] & fm[None, :]
    td = t.to(tl.int64)[:, None] * d + f[None, :]
    dh = tl.load(dh_ptr + td, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + f, mask=fm, other=0.0).to(tl.float32)
    x = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n in range(N):
        row = n * T + t
        p = tl.load(p_ptr + row, mask=tm, other=0.0)
        a = tl.load(a_ptr + row, mask=tm, other=0.0)
        b = tl.load(b_ptr + row, mask=tm, other=0.0)
        at = n * T * d.to(tl.int64) + td
        v = tl.load(v_ptr + at, mask=mask, other=0.0).to(tl.float32)
        out = p[:, None] * dh + a[:, None] * u[None, :] + b[:, None] * v
        tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=mask)
        x += tl.sum(a[:, None] * v, axis=0)
    tl.store(x_part_ptr + tl.program_id(0).to(tl.int64) * d + f, x, mask=fm)


def attn_res_scores_triton(v_NTd: torch.Tensor, u_d: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    N, T, d = v_NTd.shape
    r = torch.empty(N, T, dtype=torch.float32, device=v_NTd.device)
    s = torch.empty_like(r)
    if r.numel():
        _scores_kernel[(triton.cdiv(N * T, _BLOCK_T),)](v_NTd.contiguous(), u_d.float().contiguous(), r, s, N * T, d,
                                                          eps, BLOCK_R=_BLOCK_T, BLOCK_D=_BLOCK_D, num_warps=4)
    return r, s


def attn_res_weighted_sum_triton(p_NT: torch.Tensor, v_NTd: torch.Tensor) -> torch.Tensor:
    N, T, d = v_NTd.shape
    h = torch.empty(T, d, dtype=v_NTd.dtype, device=v_NTd.device)
    if h.numel():
        grid = (triton.cdiv(T, _BLOCK_T), triton.cdiv(d, _BLOCK_D))
        _weighted_sum_kernel[grid](p_NT.float().contiguous(), v_NTd.contiguous(), h, N, T, d,
                                   BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D, num_warps=4)
    return h


def attn_res_value_dots_triton(dh_Td: torch.Tensor, v_NTd: torch.Tensor) -> torch.Tensor:
    N, T, d = v_NTd.shape
    dp = torch.empty(N, T, dtype=torch.float32, device=v_NTd.device)
    if dp.numel():
        _value_dots_kernel[(triton.cdiv(T, _BLOCK_T), N)](dh_Td.contiguous(), v_NTd.contiguous(), dp, T, d,
                                                          BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D, num_warps=4)
    return dp


def attn_res_value_grad_triton(p_NT: torch.Tensor, dh_Td: torch.Tensor, a_NT: torch.Tensor, b_NT: torch.Tensor,
                               u_d: torch.Tensor, v_NTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, T, d = v_NTd.shape
    out = torch.empty_like(v_NTd)
    x_part = torch.zeros(triton.cdiv(T, _BLOCK_T), d, dtype=torch.float32, device=v_NTd.device)
    if out.numel():
        grid = (triton.cdiv(T, _BLOCK_T), triton.cdiv(d, _BLOCK_D))
        _value_grad_kernel[grid](p_NT.float().contiguous(), dh_Td.contiguous(), a_NT.float().contiguous(),
                                 b_NT.float().contiguous(), u_d.float().contiguous(), v_NTd.contiguous(), out, x_part,
                                 N, T, d, BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D, num_warps=4)
    return out, x_part.sum(0)
