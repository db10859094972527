"""Gradients of micro-batches added where they are made: inside `adding_into_grads`, a backward pass adds a leaf
weight's gradient into the `.grad` an earlier backward left (the micro-batches before this one) in the GEMM that
computes it (the routed experts' Triton weight-gradient kernel; cuBLAS's beta = 1 for a dense weight through
`linear`), where autograd would make the gradient and then add it with one more pass over the weight: one rounding
instead of two.

Only for `.backward()`, which accumulates into `.grad`: `torch.autograd.grad` must return the gradient and leave
`.grad` alone, so it runs outside the context (the flag is a module global: autograd runs a CUDA backward on its
own thread)."""
from __future__ import annotations

import contextlib

import torch

_adding = False


@contextlib.contextmanager
def adding_into_grads():
    global _adding
    before, _adding = _adding, True
    try:
        yield
    finally:
        _adding = before


def grad_to_add_into(w: torch.Tensor) -> torch.Tensor | None:
    """The `.grad` the GEMM adds `w`'s gradient into, inside `adding_into_grads` where an earlier backward left one
    of w's shape and dtype; None: autograd takes the gradient."""
    g = w.grad if _adding and w.is_leaf else None
    return g if g is not None and g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous() else None



class _Linear(torch.autograd.Function):
    """y = x w^T, whose weight gradient goes into w.grad by the GEMM itself where `grad_to_add_into` gives one."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.weight = w  # the tensor itself (saved tensors unpack as new objects): its .grad
        return torch.nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        grad = grad_to_add_into(ctx.weight)
        if grad is None:
            return dx, dy2.t() @ x2
        grad.addmm_(dy2.t(), x2)  # cuBLAS's beta = 1: the add inside the GEMM
        return dx, None


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w [out, in]^T -> [..., out]: torch's linear without a bias, whose weight gradient a backward
    inside `adding_into_grads` adds into w.grad (eager; a compiled graph keeps torch's own backward)."""
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return torch.nn.functional.linear(x, w)
    return _Linear.apply(x, w)
