"""One fused AdamW step for one parameter tensor, in a single pass over memory (bf16 training with fp32 masters).

Shapes: param, grad [*S] with N = numel elements (any shape, contiguous); master [*S] fp32, m, v [*S] fp32 or bf16
(each rounded once when stored), contiguous; grad_divisor [] fp32 on the tensors' device. All arithmetic is fp32:

    g      = grad.float() / grad_divisor          # grad_divisor = 1 / clip coefficient, read from device memory
    target = master if master is not None else param
    target = target - (lr * weight_decay) * target    # decoupled weight decay
    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g * g
    denom  = sqrt(v) / sqrt(1 - beta2**step) + eps
    target = target - (lr / (1 - beta1**step)) * m / denom
    store target, m, v; with a master, param = target rounded (to nearest even) to param's dtype.

This is torch's fused AdamW (`torch._fused_adamw_`, CUDA `adam_math` in ATen's fused_adam_utils.cuh, ADAMW mode,
amsgrad and maximize off) applied to the fp32 master, up to fp32 rounding; the order of operations is that kernel's:
- the gradient is divided by the scale (a true division, as torch does with `grad_scale`), not multiplied by its
  reciprocal;
- weight decay is `p - lr * wd * p` (torch's fused form), not `p * (1 - lr * wd)` (its foreach form), and is
  applied before the moments, which never see it;
- m is `beta1 * m + (1 - beta1) * g`, not torch's foreach/CPU `lerp(m, g, 1 - beta1)`; v is
  `beta2 * v + ((1 - beta2) * g) * g`;
- step_size = lr / bias_correction1 is formed in float64 on the host and rounded once to fp32, as torch's kernel does;
  sqrt(bias_correction2) is rounded to fp32 too (torch keeps it in float64: the one extra rounding);
- the update is `(step_size * m) / denom` subtracted from the parameter, with IEEE-rounded division and square root
  (`div_rn`, `sqrt_rn`; Triton's default `/` and `sqrt` are approximate on NVIDIA GPUs).
Where torch computes in float64 (its scalars are doubles) we compute in fp32, hence "up to fp32 rounding".

Memory traffic, the HBM bound of this memory-bound step: bf16 param with fp32 master and bf16 grad moves
2 (grad read) + 8 (master read+write) + 8 (m) + 8 (v) + 2 (param write) = 28 bytes per parameter (20 with bf16
moments); the bf16 grad is read directly, with no widened copy. fp32 param without master and fp32 grad: 4 + 8 + 8 +
8 = 28 bytes too.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


def _step_scalars(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """(step_size, bc2_sqrt) in float64: lr / (1 - beta1**step), sqrt(1 - beta2**step) (step >= 1)."""
    return lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step)


def adamw_step_reference_(param: torch.Tensor, master: torch.Tensor | None, grad: torch.Tensor, m: torch.Tensor,
                          v: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float,
                          weight_decay: float, step: int, grad_divisor: torch.Tensor) -> None:
    """In place: param [*S] (any float dtype), master [*S] fp32 or None, grad [*S] (bf16/fp16/fp32), m, v [*S] fp32
    or bf16, grad_divisor [] fp32; step counts from 1."""
    step_size, bc2_sqrt = _step_scalars(lr, beta1, beta2, step)
    # The scalars as fp32 tensors on the device: each rounded once to fp32 as the kernel's arguments are, and every
    # division a true division (CUDA multiplies by the reciprocal when dividing by a Python scalar).
    decay, b1, c1, b2, c2, step_size, bc2_sqrt, eps = torch.tensor(
        [lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, step_size, bc2_sqrt, eps], dtype=torch.float32,
        device=m.device).unbind()
    g = grad.float() / grad_divisor
    target = (master if master is not None else param).float()
    target = target - decay * target
    m_new = b1 * m.float() + c1 * g
    v_new = b2 * v.float() + c2 * g * g
    # float64 sqrt rounded once is the IEEE fp32 sqrt; torch's vectorized fp32 sqrt on CPU is not correctly rounded
    denom = v_new.double().sqrt().float() / bc2_sqrt + eps
    target = target - (step_size * m_new) / denom
    m.copy_(m_new)
    v.copy_(v_new)
    if master is not None:
        master.copy_(target)
    param.copy_(target)


# ---------------------------------------------------------------------------------------------------------------------
# Triton path: a 1-D grid of BLOCK-element tiles; each element is read once and written once.
@triton.jit(do_not_specialize=["n"])  # one compiled kernel for every tensor size (of each offset width)
def _adamw_kernel(param_ptr, master_ptr, grad_ptr, m_ptr, v_ptr, divisor_ptr, n, decay, beta1, c1, beta2, c2,
                  step_size, bc2_sqrt, eps, HAS_MASTER: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr):
    # WIDE: int64 offsets, for a stacked expert weight of more than 2**31 elements (int32 address arithmetic else)
    pid = tl.program_id(0).to(tl.int64) if WIDE else tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    divisor = tl.load(divisor_ptr)  # on device: no host sync for the clip coefficient
    # every byte is read once and written once: streamed past L2 (evict_first) so it holds nothing of it
    g = tl.div_rn(tl.load(grad_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32),
                  divisor)
    if HAS_MASTER:
        p = tl.load(master_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        p = tl.load(param_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)

    p = p - decay * p
    m = beta1 * m + c1 * g
    v = beta2 * v + c2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)

    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    if HAS_MASTER:
        tl.store(master_ptr + offs, p, mask=mask)
    tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)


_BLOCK = 512  # 4 elements per thread at 4 warps: measured best on the H100 (benchmarks/adamw_gpu.py, RESULTS)
_WARPS = 4  # benchmarks/adamw_gpu.py measures other tiles against the HBM bound


def adamw_step_(param: torch.Tensor, master: torch.Tensor | None, grad: torch.Tensor, m: torch.Tensor,
                v: torch.Tensor, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                step: int, grad_divisor: torch.Tensor) -> None:
    """Same contract as `adamw_step_reference_`: one kernel launch, no host sync. All tensors contiguous on one
    device with the same numel; grad_divisor a 0-d fp32 tensor there."""
    n = param.numel()
    if n == 0:
        return
    step_size, bc2_sqrt = _step_scalars(lr, beta1, beta2, step)
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        param, master if master is not None else param, grad, m, v, grad_divisor, n, lr * weight_decay, beta1,
        1.0 - beta1, beta2, 1.0 - beta2, step_size, bc2_sqrt, eps, HAS_MASTER=master is not None,
        WIDE=n + _BLOCK >= 2 ** 31, BLOCK=_BLOCK,
        num_warps=_WARPS,
    )
