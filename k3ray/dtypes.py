"""Precision helpers: "compute in fp32" means at least fp32, so a float64 model (used to check equivalence
without rounding noise) is never rounded down.

Matmuls with an fp32 result (`mm_f32`, `matmul_f32`): bf16/fp16 operands on CUDA go through the tensor
cores in one GEMM with fp32 accumulation and an fp32 output (cuBLAS, torch's `out_dtype`), with no widened copies of
the operands; elsewhere the operands are widened first, which forms the same products (a bf16 x bf16 product is exact
in fp32) and sums them in fp32 too."""
import torch

LOW = (torch.bfloat16, torch.float16)


def up32(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or unchanged if it is already fp32 or wider."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _tensor_cores(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_cuda and a.dtype == b.dtype and a.dtype in LOW


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] in fp32 (float64 stays float64). Not differentiable (`matmul_f32` is)."""
    return torch.mm(a, b, out_dtype=torch.float32) if _tensor_cores(a, b) else torch.mm(up32(a), up32(b))


class _MatmulF32(torch.autograd.Function):
    """a @ b with an fp32 result for bf16/fp16 a, b; the gradients come back in the operands' dtype, each from one
    GEMM on the operands and the incoming fp32 gradient rounded once to their dtype."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return mm_f32(a, b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        g = grad.to(a.dtype)
        return (g @ b.t() if ctx.needs_input_grad[0] else None), (a.t() @ g if ctx.needs_input_grad[1] else None)


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] in fp32, differentiable. fp32/fp64 operands: the plain `up32(a) @ up32(b)`."""
    if a.dtype == b.dtype and a.dtype in LOW:
        return _MatmulF32.apply(a, b)
    return up32(a) @ up32(b)
