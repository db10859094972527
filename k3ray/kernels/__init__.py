"""Kernels of the routed-expert path and KDA. Each public function picks the Triton kernel on CUDA tensors and the torch
reference elsewhere; K3RAY_KERNELS=reference forces the reference everywhere (K3RAY_KERNELS=triton forces Triton,
e.g. on CPU tensors under TRITON_INTERPRET=1). The variable is read once, at import; `set_backend` changes it later.

| function | reference | Triton | autograd |
|---|---|---|---|
| situ_glu(gate, up, beta, beta_lin) | situ_glu.situ_glu_reference | situ_glu.situ_glu_triton | gate, up |
| grouped_expert_ffn(x, w1, w2, group_ends, row_scale) | grouped_ffn.*_reference | grouped_ffn.*_triton | x, w1, w2, row_scale |
| permute_rows(x, dest, num_rows) | permute.*_reference | permute.*_triton | x |
| unpermute_rows(y, dest, weights) | permute.*_reference | permute.*_triton | y, weights |
| score_histogram(values, lo, hi, bins) | histogram.*_reference | histogram.*_triton | - |
| attn_res_scores(v, u, eps) -> r, s | attn_res.*_reference | attn_res.*_triton | - (an AttnRes read's parts) |
| attn_res_weighted_sum(p, v) | attn_res.*_reference | attn_res.*_triton | - |
| attn_res_value_dots(dh, v) | attn_res.*_reference | attn_res.*_triton | - |
| attn_res_value_grad(p, dh, a, b, u, v) -> dv, x | attn_res.*_reference | attn_res.*_triton | - |
| kda_attention(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, gate_lower_bound) | kda.*_reference | kda.*chunk_fla | all |
| kda_prefill(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, gate_lower_bound, chunk_states) | kda.kda_prefill_reference | kda.kda_prefill_fla | - |
| kda_decode(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens) | kda.kda_recurrent_reference | kda.kda_recurrent_fla | - |
| kda_decode_slots(q, k, v, g, beta, pool, slots) | kda.*_reference | kda.*_fla | - |
| kda_context_parallel(q, k, v, g, beta, group) | kda.*_context_parallel_reference | kda.*_context_parallel_fla | all |
| kda_gate(raw, A_log, dt_bias, lower_bound) | kda.kda_gate_reference | kda.kda_gate_fla | all |
| short_conv(x, weight, state, output_final_state, cu_seqlens) | short_conv.*_reference | *_fla (no state) | all |
| short_conv_packed(x, weight, pool, index) -> y, final states, tails | short_conv.*_reference | short_conv.*_triton | - |

`adding_into_grads()` (grad_accumulation): inside it, a backward adds the routed experts' weight gradients into the
`.grad` an earlier micro-batch left, in the Triton kernel that makes them.

Every public function here but `situ_glu` runs outside torch.compile's graphs (`outside_compile`): a compiled decoder
block (execution.compile_blocks) breaks its graph around each kernel call instead of tracing into Triton launchers and
fla's autograd Functions; Inductor fuses what lies between them. Outside compilation the wrapper costs well under 1 us.
`situ_glu`, elementwise, is traced inside a graph as its reference (Inductor's fused kernel stands for the Triton one).

KDA's fast path is fla-core's Triton kernels (`pip install .[kda]`), taken on CUDA tensors when fla imports and the
backend is not 'reference'; without fla, CUDA tensors take the torch reference too.
"""
from __future__ import annotations

import os

import torch

from k3ray.kernels import attn_res as _attn_res
from k3ray.kernels import grad_accumulation as _grad_acc
from k3ray.kernels import grouped_ffn as _ffn
from k3ray.kernels import histogram as _hist
from k3ray.kernels import kda as _kda
from k3ray.kernels import permute as _perm
from k3ray.kernels import short_conv as _conv
from k3ray.kernels import situ_glu as _situ

adding_into_grads = _grad_acc.adding_into_grads

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


def outside_compile(fn):
    """`torch.compiler.disable(fn)` where CUDA is, else fn: compiled blocks (execution.compile_blocks, CUDA only)
    break their graphs around it. Without CUDA nothing is compiled, and every process (each Ray worker) is spared
    importing torch._dynamo (~1 s of CPU)."""
    return torch.compiler.disable(fn) if torch.cuda.is_available() else fn


def _triton(t: torch.Tensor) -> bool:
    return _backend == "triton" or (_backend == "auto" and t.is_cuda)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = _situ.BETA,
             beta_lin: float = _situ.BETA_LIN) -> torch.Tensor:
    """Inside a compiled graph, the reference's elementwise ops, which Inductor fuses with their neighbours: a graph
    break here, inside the MoE layer's loop over its shared experts, made Dynamo run the rest of that layer eagerly
    (graph breaks in loops are not resumed)."""
    if torch.compiler.is_compiling():
        return _situ.situ_glu_reference(gate, up, beta, beta_lin)
    return _situ_glu_eager(gate, up, beta, beta_lin)


@outside_compile
def _situ_glu_eager(gate: torch.Tensor, up: torch.Tensor, beta: float, beta_lin: float) -> torch.Tensor:
    if _triton(gate):
        return _situ.situ_glu_triton(gate, up, beta, beta_lin)
    return _situ.situ_glu_reference(gate, up, beta, beta_lin)


@outside_compile
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


@outside_compile
def permute_rows(x: torch.Tensor, dest: torch.Tensor, num_rows: int) -> torch.Tensor:
    if _triton(x):
        return _perm.permute_rows_triton(x, dest, num_rows)
    return _perm.permute_rows_reference(x, dest, num_rows)


@outside_compile
def unpermute_rows(y: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if _triton(y):
        return _perm.unpermute_rows_triton(y, dest, weights)
    return _perm.unpermute_rows_reference(y, dest, weights)


@outside_compile
def score_histogram(values: torch.Tensor, lo: float, hi: float, bins: int) -> torch.Tensor:
    if _triton(values):
        return _hist.score_histogram_triton(values, lo, hi, bins)
    return _hist.score_histogram_reference(values, lo, hi, bins)


@outside_compile
def attn_res_scores(v_NTd: torch.Tensor, u_d: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton(v_NTd):
        return _attn_res.attn_res_scores_triton(v_NTd, u_d, eps)
    return _attn_res.attn_res_scores_reference(v_NTd, u_d, eps)


@outside_compile
def attn_res_weighted_sum(p_NT: torch.Tensor, v_NTd: torch.Tensor) -> torch.Tensor:
    if _triton(v_NTd):
        return _attn_res.attn_res_weighted_sum_triton(p_NT, v_NTd)
    return _attn_res.attn_res_weighted_sum_reference(p_NT, v_NTd)


@outside_compile
def attn_res_value_dots(dh_Td: torch.Tensor, v_NTd: torch.Tensor) -> torch.Tensor:
    if _triton(v_NTd):
        return _attn_res.attn_res_value_dots_triton(dh_Td, v_NTd)
    return _attn_res.attn_res_value_dots_reference(dh_Td, v_NTd)


@outside_compile
def attn_res_value_grad(p_NT: torch.Tensor, dh_Td: torch.Tensor, a_NT: torch.Tensor, b_NT: torch.Tensor,
                        u_d: torch.Tensor, v_NTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton(v_NTd):
        return _attn_res.attn_res_value_grad_triton(p_NT, dh_Td, a_NT, b_NT, u_d, v_NTd)
    return _attn_res.attn_res_value_grad_reference(p_NT, dh_Td, a_NT, b_NT, u_d, v_NTd)


def _fla_on(device) -> bool:
    return _backend != "reference" and torch.device(device).type == "cuda" and _kda.fla_ops() is not None


def _fla(t: torch.Tensor) -> bool:
    return _fla_on(t.device)


@outside_compile
def kda_attention(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                  gate_lower_bound=None):
    """KDA for training (see kernels/kda.py for shapes): fla's chunk_kda, or the torch reference (the chunked one for
    sequences longer than one chunk). Returns (o, final state or None). gate_lower_bound: the gate's bound (g in
    (lb, 0)), which lets fla run its intra-chunk products on tensor cores (kda.safe_gate); the math is the same."""
    if _fla(q):
        return _kda.kda_chunk_fla(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, gate_lower_bound)
    ref = _kda.kda_chunk_reference if q.shape[1] > _kda.CHUNK else _kda.kda_recurrent_reference
    return ref(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)


def kda_state_chunk(device) -> int:
    """The chunk (tokens) of kda_prefill on `device`: its chunk_indices' and chunk states' (kda.chunk_layout)."""
    return _kda.FLA_CHUNK if _fla_on(device) else _kda.CHUNK


@outside_compile
def kda_prefill(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets, gate_lower_bound=None,
                chunk_states=False):
    """Serving's prefill of sequences packed by cu_seqlens from their states, with no host sync (kernels/kda.py):
    (o, final states [N, H, K, V], chunk states [C, H, K, V] fp32 with `chunk_states`, else None). chunk_indices and
    chunk_offsets: kda.chunk_layout of the sequences' lengths at kda_state_chunk(device) tokens, on the device."""
    if _fla(q):
        return _kda.kda_prefill_fla(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets,
                                    gate_lower_bound, chunk_states)
    return _kda.kda_prefill_reference(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets,
                                      gate_lower_bound, chunk_states)


@outside_compile
def kda_decode(q, k, v, g, beta, initial_state=None, output_final_state=True, cu_seqlens=None):
    """KDA for decoding a few tokens from given states: fla's fused_recurrent_kda, or the recurrent reference."""
    if _fla(q):
        return _kda.kda_recurrent_fla(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)
    return _kda.kda_recurrent_reference(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)


@outside_compile
def kda_decode_slots(q, k, v, g, beta, pool, slots):
    """One token of each of N sequences from its state slot, the slots updated in place (kernels/kda.py)."""
    if _fla(q):
        return _kda.kda_decode_slots_fla(q, k, v, g, beta, pool, slots)
    return _kda.kda_decode_slots_reference(q, k, v, g, beta, pool, slots)


@outside_compile
def kda_context_parallel(q, k, v, g, beta, group):
    """KDA over a sequence split contiguously across the ranks of `group`; returns this rank's o."""
    if _fla(q):
        return _kda.kda_context_parallel_fla(q, k, v, g, beta, group)
    return _kda.kda_context_parallel_reference(q, k, v, g, beta, group)


@outside_compile
def kda_gate(raw, A_log, dt_bias, lower_bound=None):
    """KDA's forget gate log alpha [..., H, K] fp32 (kernels/kda.py): fla's fused gate, or the torch reference."""
    if _fla(raw):
        return _kda.kda_gate_fla(raw, A_log, dt_bias, lower_bound)
    return _kda.kda_gate_reference(raw, A_log, dt_bias, lower_bound)


@outside_compile
def short_conv(x, weight, state=None, output_final_state=False, cu_seqlens=None):
    """Causal short convolution + SiLU (kernels/short_conv.py). fla's kernel on CUDA when no state is carried (training
    and whole-sequence forward), else the reference (decoding: one token of each sequence, a batch); serving's
    prefill takes short_conv_packed."""
    if _backend != "reference" and state is None and not output_final_state and x.is_cuda \
            and _conv.fla_conv() is not None:
        return _conv.short_conv_fla(x, weight, state, output_final_state, cu_seqlens)
    return _conv.short_conv_reference(x, weight, state, output_final_state, cu_seqlens)


@outside_compile
def short_conv_packed(x, weight, pool, index):
    """Serving's prefill convolution: every packed sequence from its carried state in the pool, by the indices the
    plan sent (kernels/short_conv.py `PackedConv`); the pool is not written."""
    if _triton(x):
        return _conv.short_conv_packed_triton(x, weight, pool, index)
    return _conv.short_conv_packed_reference(x, weight, pool, index)


__all__ = ["situ_glu", "grouped_expert_ffn", "permute_rows", "unpermute_rows", "score_histogram", "kda_attention",
           "kda_prefill", "kda_state_chunk", "kda_decode", "kda_decode_slots", "kda_context_parallel",
           "kda_gate", "short_conv", "short_conv_packed", "set_backend"]
