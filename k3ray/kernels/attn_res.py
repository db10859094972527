"""The values' gradient of a Block AttnRes read (k3ray.model.layers `_AttnResMix`), in one pass over memory.

For N values v [N, T, d] (the block summaries and the partial block, T tokens), the read's softmax weights p [N, T]
and its incoming gradient dh [T, d], every value gets

    dv[n, t, :] = p[n, t] * dh[t, :] + a[n, t] * u[:] + b[n, t] * v[n, t, :]

(a = ds r, b = -ds s r^2 / d: the score's gradient through the folded RMSNorm; u = w * g the pseudo-query times the key
norm's weight). Computed in fp32 and rounded once to v's dtype. Done with torch ops in a bf16 model this is a
multiply and two `addcmul_`s over [N, T, d] with fp32 coefficients broadcast against bf16 tensors, which torch runs
through its slow mixed-dtype path: ~0.8 ms per read at T = 4,096, d = 4,096, N = 3 on an H100, 48 reads in a 6-layer
step; the kernel reads dh once for all N values, v once and writes dv once.

Shapes: p, a, b [N, T] fp32; dh [T, d] and v [N, T, d] (bf16/fp16/fp32, contiguous); u [d] fp32 -> dv [N, T, d]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def attn_res_value_grad_reference(p_NT: torch.Tensor, dh_Td: torch.Tensor, a_NT: torch.Tensor,
                                  b_NT: torch.Tensor, u_d: torch.Tensor, v_NTd: torch.Tensor) -> torch.Tensor:
    wide = torch.float64 if v_NTd.dtype == torch.float64 else torch.float32
    out = (p_NT[..., None].to(wide) * dh_Td.to(wide) + a_NT[..., None].to(wide) * u_d.to(wide)
           + b_NT[..., None].to(wide) * v_NTd.to(wide))
    return out.to(v_NTd.dtype)


@triton.jit
def _value_grad_kernel(p_ptr, dh_ptr, a_ptr, b_ptr, u_ptr, v_ptr, out_ptr, N, T, d,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # one tile of BLOCK_T tokens x BLOCK_D features; dh and u are read once and serve all N values
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    f = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tm, fm = t < T, f < d
    mask = tm[:, None] & fm[None, :]
    td = t.to(tl.int64)[:, None] * d + f[None, :]
    dh = tl.load(dh_ptr + td, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + f, mask=fm, other=0.0).to(tl.float32)
    for n in range(N):
        row = n * T + t
        p = tl.load(p_ptr + row, mask=tm, other=0.0)
        a = tl.load(a_ptr + row, mask=tm, other=0.0)
        b = tl.load(b_ptr + row, mask=tm, other=0.0)
        at = n * T * d.to(tl.int64) + td
        v = tl.load(v_ptr + at, mask=mask, other=0.0).to(tl.float32)
        out = p[:, None] * dh + a[:, None] * u[None, :] + b[:, None] * v
        tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=mask)


def attn_res_value_grad_triton(p_NT: torch.Tensor, dh_Td: torch.Tensor, a_NT: torch.Tensor,
                               b_NT: torch.Tensor, u_d: torch.Tensor, v_NTd: torch.Tensor) -> torch.Tensor:
    N, T, d = v_NTd.shape
    out = torch.empty_like(v_NTd)
    if out.numel() == 0:
        return out
    block_t, block_d = 16, 256
    grid = (triton.cdiv(T, block_t), triton.cdiv(d, block_d))
    _value_grad_kernel[grid](p_NT.float().contiguous(), dh_Td.contiguous(), a_NT.float().contiguous(),
                             b_NT.float().contiguous(), u_d.float().contiguous(), v_NTd.contiguous(), out, N, T, d,
                             BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    return out
