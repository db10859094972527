"""SiTU-GLU, the K3 expert activation (K3_NOTES):

    act(g, u) = beta * tanh(g / beta) * sigmoid(g) * (beta_lin * tanh(u / beta_lin))

Computed in fp32 whatever the input dtype, returned in the input dtype. |act| <= beta * beta_lin (100 by default),
finite for any finite or infinite input; near zero it is silu(g) * u.

`situ_glu_triton` is the Triton elementwise version (forward and backward kernels, autograd). The `@triton.jit`
helpers `situ_fwd` / `situ_fwd_bwd` are shared with the grouped-FFN kernels' epilogues.
"""
from __future__ import annotations

import os

import torch
from k3ray.dtypes import up32
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BETA, BETA_LIN = 4.0, 25.0  # K3's SiTU-GLU constants; every kernel and reference takes its defaults from here


def situ_glu_reference(gate: torch.Tensor, up: torch.Tensor, beta: float = BETA,
                       beta_lin: float = BETA_LIN) -> torch.Tensor:
    """gate, up: [..., I] -> [..., I] in gate's dtype."""
    g = up32(gate)
    u = up32(up)
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (beta_lin * torch.tanh(u / beta_lin))
    return out.to(gate.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Triton helpers (fp32 in, fp32 out). tanh via exp is finite for +-inf; a short series near 0 keeps relative accuracy.
@triton.jit
def _tanh(x):
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    far = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    near = ax * (1.0 - x2 * (0.3333333333333333 - x2 * 0.13333333333333333))
    t = tl.where(ax < 0.0625, near, far)
    return tl.where(x < 0, -t, t)


@triton.jit
def _tanh_fast(x):
    """Hardware tanh (one MUFU op, max relative error ~2^-11): for epilogues whose output is bf16/fp16 anyway."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _tanhs(g, u, beta, beta_lin, FAST: tl.constexpr):
    if FAST:
        return _tanh_fast(g * (1.0 / beta)), _tanh_fast(u * (1.0 / beta_lin))
    return _tanh(g / beta), _tanh(u / beta_lin)


@triton.jit
def situ_fwd(g, u, beta, beta_lin, FAST: tl.constexpr):
    sig = 1.0 / (1.0 + tl.exp(-g))
    tg, tu = _tanhs(g, u, beta, beta_lin, FAST)
    return beta * tg * sig * (beta_lin * tu)


@triton.jit
def situ_fwd_bwd(g, u, beta, beta_lin, FAST: tl.constexpr):
    """Returns (act, d act / d g, d act / d u), all fp32. FAST: hardware tanh (GPU only, bf16/fp16 outputs)."""
    sig = 1.0 / (1.0 + tl.exp(-g))
    tg, tu = _tanhs(g, u, beta, beta_lin, FAST)
    ga = beta * tg * sig
    ub = beta_lin * tu
    dga = (1.0 - tg * tg) * sig + beta * tg * sig * (1.0 - sig)
    return ga * ub, dga * ub, ga * (1.0 - tu * tu)


@triton.jit
def _situ_fwd_kernel(g_ptr, u_ptr, o_ptr, n, beta, beta_lin, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + offs, situ_fwd(g, u, beta, beta_lin, False).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_bwd_kernel(do_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, beta, beta_lin, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    do = tl.load(do_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _, dadg, dadu = situ_fwd_bwd(g, u, beta, beta_lin, False)
    tl.store(dg_ptr + offs, (do * dadg).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (do * dadu).to(du_ptr.dtype.element_ty), mask=mask)


_BLOCK = 1024


class _SituGlu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, beta, beta_lin):
        gate_c, up_c = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate_c)
        n = gate_c.numel()
        _situ_fwd_kernel[(triton.cdiv(n, _BLOCK),)](gate_c, up_c, out, n, beta, beta_lin, BLOCK=_BLOCK)
        ctx.save_for_backward(gate_c, up_c)
        ctx.beta, ctx.beta_lin = beta, beta_lin
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        _situ_bwd_kernel[(triton.cdiv(n, _BLOCK),)](dout, gate, up, dg, du, n, ctx.beta, ctx.beta_lin, BLOCK=_BLOCK)
        return dg, du, None, None


def situ_glu_triton(gate: torch.Tensor, up: torch.Tensor, beta: float = BETA,
                    beta_lin: float = BETA_LIN) -> torch.Tensor:
    """Same contract as `situ_glu_reference`; differentiable w.r.t. gate and up."""
    if gate.numel() == 0:
        return situ_glu_reference(gate, up, beta, beta_lin)
    return _SituGlu.apply(gate, up, float(beta), float(beta_lin))
