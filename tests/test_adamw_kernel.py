"""The fused AdamW step (k3ray/kernels/adamw.py): the Triton kernel against its torch reference, and the reference
against torch's own AdamW.

Without a GPU the kernel runs under TRITON_INTERPRET=1 on CPU tensors (tests/conftest.py sets it before anything
imports triton) and must equal the reference bit for bit; on CUDA within fp32 rounding. The interpreter rounds
fp32 -> bf16 toward zero (triton 3.9), so there the bf16 param may sit one bf16 step below the master's nearest
rounding, toward zero; on CUDA it must be exactly the nearest rounding.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.optim.adam import adam

CUDA = torch.cuda.is_available()
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET=1 without CUDA"

from k3ray.kernels.adamw import adamw_step_, adamw_step_reference_  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8)  # lr large enough that decay and update move every element
# The interpreter does the kernel's fp32 operations one at a time in numpy, in the reference's order: bit-equal. On
# CUDA the compiler may contract a multiply-add into one FMA: within fp32 rounding (atol for m's cancellations near 0).
FP32 = dict(rtol=1e-6, atol=1e-7) if CUDA else dict(rtol=0, atol=0)


@pytest.fixture(autouse=True)
def seeded():
    """Every test draws its inputs from the same seed, so a failure reproduces."""
    torch.manual_seed(0)


def toward_zero_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded toward zero to bf16 (drop the low 16 bits), as the Triton interpreter rounds."""
    return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def assert_rounded(param: torch.Tensor, master: torch.Tensor) -> None:
    """param is master rounded to param's dtype: to nearest even (the interpreter's toward-zero also passes)."""
    nearest = master.to(param.dtype)
    if CUDA or param.dtype == torch.float32:
        assert torch.equal(param, nearest)
    else:
        assert ((param == nearest) | (param == toward_zero_bf16(master))).all()


def state(shape, param_dtype, with_master: bool, grad_dtype, steps: int):
    """(param, master, m, v, grads): a fresh parameter and optimizer state with nonzero moments, and one gradient
    per step. With a master, param starts NaN so an element the kernel never writes fails."""
    master = torch.randn(shape, device=DEV)
    param = torch.full(shape, float("nan"), device=DEV, dtype=param_dtype) if with_master else master.clone()
    m = torch.randn(shape, device=DEV) * 0.1
    v = torch.rand(shape, device=DEV) * 1e-2
    grads = [torch.randn(shape, device=DEV).to(grad_dtype) for _ in range(steps)]
    return param, (master if with_master else None), m, v, grads


CASES = {  # name -> (param dtype, fp32 master, grad dtype)
    "bf16+master,bf16 grad": (torch.bfloat16, True, torch.bfloat16),
    "bf16+master,fp16 grad": (torch.bfloat16, True, torch.float16),
    "fp32,fp32 grad": (torch.float32, False, torch.float32),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("shape", [(3001,), (37, 129)])  # numel not a multiple of the block; a 2-D weight
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("divisor", [1.0, 2.5])
def test_kernel_matches_reference(case, shape, weight_decay, divisor):
    param_dtype, with_master, grad_dtype = CASES[case]
    param, master, m, v, grads = state(shape, param_dtype, with_master, grad_dtype, steps=3)
    ref = [t.clone() if t is not None else None for t in (param, master, m, v)]
    grad_divisor = torch.tensor(divisor, device=DEV)
    for step, grad in enumerate(grads, start=1):
        kw = dict(HYPER, weight_decay=weight_decay, step=step, grad_divisor=grad_divisor)
        adamw_step_(param, master, grad, m, v, **kw)
        adamw_step_reference_(*ref[:2], grad, *ref[2:], **kw)
        torch.testing.assert_close(m, ref[2], **FP32)
        torch.testing.assert_close(v, ref[3], **FP32)
        if master is not None:
            torch.testing.assert_close(master, ref[1], **FP32)
            assert_rounded(param, master)
        else:
            torch.testing.assert_close(param, ref[0], **FP32)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_kernel_with_bf16_moments_matches_reference(weight_decay):
    """optimizer.moments_dtype bfloat16: m and v read as bf16, the step in fp32, each moment rounded once when
    stored (to nearest even; the interpreter's toward zero also passes), the master as the fp32 reference's. Each
    step starts both from the kernel's state, so one rounding apart never compounds."""
    param, master, m, v, grads = state((37, 129), torch.bfloat16, True, torch.bfloat16, steps=3)
    m, v = m.bfloat16(), v.bfloat16()
    grad_divisor = torch.tensor(2.5, device=DEV)
    for step, grad in enumerate(grads, start=1):
        kw = dict(HYPER, weight_decay=weight_decay, step=step, grad_divisor=grad_divisor)
        ref = [t.clone() for t in (param, master, m, v)]
        adamw_step_(param, master, grad, m, v, **kw)
        adamw_step_reference_(*ref[:2], grad, *ref[2:], **kw)
        assert m.dtype == v.dtype == torch.bfloat16
        torch.testing.assert_close(master, ref[1], **FP32)
        assert_rounded(param, master)
        for got, want in ((m, ref[2]), (v, ref[3])):
            exact = got == want
            if not CUDA:  # the interpreter rounds toward zero: at most one bf16 step from the nearest, toward 0
                exact |= (got.float().abs() <= want.float().abs()) & ((got.float() - want.float()).abs()
                                                                     <= want.float().abs() * 2 ** -7)
            assert exact.all()


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_reference_is_torch_adamw(impl, weight_decay):
    """Our reference on a bf16 param with fp32 master == torch's AdamW (foreach, or the fused op with our divisor as
    its grad_scale) on the fp32 master with the bf16 grads widened, over 3 steps, within fp32 rounding. torch's
    foreach and CPU fused paths form m with lerp and keep its scalars in float64, so this checks the formula, not the
    bits."""
    shape, divisor = (37, 129), 2.5
    param, master, m, v, grads = state(shape, torch.bfloat16, True, torch.bfloat16, steps=3)
    t_master, t_m, t_v, t_step = master.clone(), m.clone(), v.clone(), torch.zeros((), device=DEV)
    grad_divisor = torch.tensor(divisor, device=DEV)
    for step, grad in enumerate(grads, start=1):
        adamw_step_reference_(param, master, grad, m, v, **HYPER, weight_decay=weight_decay, step=step,
                              grad_divisor=grad_divisor)
        if impl == "foreach":  # torch's functional Adam increments the step itself
            adam([t_master], [grad.float() / grad_divisor], [t_m], [t_v], [], [t_step], foreach=True,
                 decoupled_weight_decay=True, amsgrad=False, maximize=False, weight_decay=weight_decay, **HYPER)
        else:  # the fused op divides by grad_scale itself (and writes the divided grad back)
            t_step += 1
            torch._fused_adamw_([t_master], [grad.float()], [t_m], [t_v], [], [t_step], amsgrad=False,
                                maximize=False, weight_decay=weight_decay, grad_scale=grad_divisor, **HYPER)
        torch.testing.assert_close(m, t_m, rtol=1e-6, atol=1e-7)  # lerp vs beta1 * m + (1 - beta1) * g
        torch.testing.assert_close(v, t_v, rtol=1e-6, atol=1e-10)
        torch.testing.assert_close(master, t_master, rtol=1e-6, atol=1e-8)
    assert torch.equal(param, master.to(torch.bfloat16))
