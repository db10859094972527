"""Kernels of the routed-expert path. Each public function picks the Triton kernel on CUDA tensors and the torch
reference elsewhere; K3RAY_KERNELS=reference forces the reference everywhere (K3RAY_KERNELS=triton forces Triton,
e.g. on CPU tensors under TRITON_INTERPRET=1). The variable is read once, at import; `set_backend` changes it later.

| function | reference | Triton | autograd |
|---|---|---|---|
| situ_glu(gate, up, beta, beta_lin) | situ_glu.situ_glu_reference | situ_glu.situ_glu_triton | gate, up |
| grouped_expert_ffn(x, w1, w2, group_ends, row_scale) | grouped_ffn.*_reference | grouped_ffn.*_triton | x, w1, w2, row_scale |
| permute_rows(x, dest, num_rows) | permute.*_reference | permute.*_triton | x |
| unpermute_rows(y, dest, weights) | permute.*_reference | permute.*_triton | y, weights |
| score_histogram(values, lo, hi, bins) | histogram.*_reference | histogram.*_triton | - |
"""
from __future__ import annotations

import os

import torch

from k3ray.kernels import grouped_ffn as _ffn
from k3ray.kernels import histogram as _hist
from k3ray.kernels import permute as _perm
from k3ray.kernels import situ_glu as _situ

_BACKENDS = ("auto", "reference", "triton")
_backend = os.environ.get("K3RAY_KERNELS", "auto")
if _backend not in _BACKENDS:
    raise ValueError(f"K3RAY_KERNELS={_backend!r}: use one of {', '.join(_BACKENDS)}")


def set_backend(name: str) -> None:
    """'auto' (Triton on CUDA tensors), 'reference' or 'triton' (everywhere)."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend {name!r}: use one of {', '.join(_BACKENDS)}")
    _backend = name


def _triton(t: torch.Tensor) -> bool:
    return _backend == "triton" or (_backend == "auto" and t.is_cuda)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = _situ.BETA, beta_lin: float = _situ.BETA_LIN) -> torch.Tensor:
    if _triton(gate):
        return _situ.situ_glu_triton(gate, up, beta, beta_lin)
    return _situ.situ_glu_reference(gate, up, beta, beta_lin)


def grouped_expert_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group_ends: torch.Tensor,
    row_scale: torch.Tensor | None = None,
    group_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """group_order: the order the persistent Triton kernel takes the groups in (the scheduling policy's, largest
    first by default); the result does not depend on it, so the reference ignores it."""
    if _triton(x):
        return _ffn.grouped_expert_ffn_triton(x, w1, w2, group_ends, row_scale, group_order=group_order)
    return _ffn.grouped_expert_ffn_reference(x, w1, w2, group_ends, row_scale)


def permute_rows(x: torch.Tensor, dest: torch.Tensor, num_rows: int) -> torch.Tensor:
    if _triton(x):
        return _perm.permute_rows_triton(x, dest, num_rows)
    return _perm.permute_rows_reference(x, dest, num_rows)


def unpermute_rows(y: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if _triton(y):
        return _perm.unpermute_rows_triton(y, dest, weights)
    return _perm.unpermute_rows_reference(y, dest, weights)


def score_histogram(values: torch.Tensor, lo: float, hi: float, bins: int) -> torch.Tensor:
    if _triton(values):
        return _hist.score_histogram_triton(values, lo, hi, bins)
    return _hist.score_histogram_reference(values, lo, hi, bins)


__all__ = ["situ_glu", "grouped_expert_ffn", "permute_rows", "unpermute_rows", "score_histogram", "set_backend"]
