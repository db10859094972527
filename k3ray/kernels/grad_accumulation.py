"""Gradients of micro-batches added where they are made: inside `adding_into_grads`, a backward pass adds a leaf
weight's gradient into the `.grad` an earlier backward left (the micro-batches before this one) in the GEMM that
computes it (the routed experts' Triton weight-gradient kernel), where autograd would make the gradient and then
add it with one more pass over the weight: one rounding instead of two.

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

