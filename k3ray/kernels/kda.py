"""KDA (Kimi Delta Attention): fla-core's chunked Triton kernels on CUDA, torch references beside them.

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

No 1/sqrt(K) scale on q (fla's default scale is K^-0.5; the fla wrappers pass scale=1.0). Shapes: B batch, T tokens,
H heads, K key width, V value width. q, k: [B, T, H, K] (L2-normalised by the caller); g = log alpha (<= 0):
[B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H] (post-sigmoid). States [N, H, K, V] in fp32, N sequences (B, or
len(cu_seqlens) - 1). cu_seqlens: [N + 1] int64 offsets of variable-length sequences packed into B = 1
(FlashAttention's convention, as fla's). Every function here returns (o [B, T, H, V] in v's dtype, final state or
None) and takes (q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None).

| function | what |
|---|---|
| kda_recurrent_reference | per-token recurrence, fp32 state (the ground truth) |
| kda_chunk_reference | the math of fla's chunk_kda: the WY/UT form inside a chunk, a scan over chunks |
| kda_chunk_fla | fla.ops.kda.chunk_kda (training: forward and backward) |
| kda_recurrent_fla | fla.ops.kda.fused_recurrent_kda (decoding from a state slot) |
| kda_prefill_reference / _fla | serving's prefill (no autograd, no host sync): chunk indices from the caller, every chunk's starting state if asked; returns (o, final states, chunk states or None) |
| kda_context_parallel_reference / _fla | a sequence split over the ranks of a process group (below) |

Context parallelism: rank r holds tokens [r T, (r+1) T) of the sequence. Its slice maps an incoming state S to
M_r S + S_r (M_r = prod_t (I - beta_t k_t k_t^T) Diag(alpha_t), [K, K]; S_r its final state from zero); the ranks
all-gather (M_r, S_r), rank r folds S <- M_j S + S_j over j < r (a prefix scan) and runs its slice from that state.
fla's chunk_kda(cp_context=...) does the same on CUDA.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist

# fla's chunk is 64 tokens; the torch reference's is 16: its intra-chunk tensors are [C, C, K] per chunk, so on CPU
# its cost grows with C (fwd+bwd of one tiny-model KDA layer in float64: 480 ms at 64, 51 ms at 16, 75 ms for the
# per-token recurrence). The chunk length changes only rounding.
CHUNK = 16


# -- torch references -----------------------------------------------------------------------------------------------
def _segments(q, cu_seqlens) -> list[slice]:
    """The token slices of the sequences packed into batch 1 by cu_seqlens."""
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed into batch 1, got batch {q.shape[0]}")
    bounds = cu_seqlens.tolist()
    return [slice(bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]


def _per_sequence(core, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
    """core(q, k, v, g, beta, S0) -> (o, S) on the whole batch, or on each packed sequence; fp32 inside."""
    f32 = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (t.to(f32) for t in (q, k, v, g, beta))
    if cu_seqlens is None:
        o, s = core(q, k, v, g, beta, None if initial_state is None else initial_state.to(f32))
        return o, (s if output_final_state else None)
    outs, states = [], []
    for n, ts in enumerate(_segments(q, cu_seqlens)):
        s0 = None if initial_state is None else initial_state[n:n + 1].to(f32)
        o, s = core(*(t[:, ts] for t in (q, k, v, g, beta)), s0)
        outs.append(o)
        states.append(s)
    o = torch.cat(outs, dim=1)
    return o, (torch.cat(states) if output_final_state else None)


def _recurrent_core(q, k, v, g, beta, s0):
    B, T, H, K = q.shape
    state = q.new_zeros(B, H, K, v.shape[-1]) if s0 is None else s0
    alpha, outs = g.exp(), []
    for t in range(T):
        kt, bt = k[:, t], beta[:, t, :, None]
        state = alpha[:, t, :, :, None] * state
        kS = torch.einsum("bhk,bhkv->bhv", kt, state)
        state = state + bt[..., None] * kt[..., None] * (v[:, t] - kS)[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, state


def kda_recurrent_reference(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None):
    """The per-token recurrence (fp32 state; float64 stays float64)."""
    o, s = _per_sequence(_recurrent_core, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)
    return o.to(v.dtype), s


def _chunk_core(q, k, v, g, beta, s0, chunk: int = CHUNK, starts: list | None = None):
    """Chunked form. Tokens are padded to a multiple of the chunk with beta = 0, g = 0 (the state passes through
    unchanged). Inside a chunk (positions r, s; G = cumulative g from the chunk start, so G_r - G_s <= 0 for s <= r):
        A[r, s] = beta_r k_r^T Diag(exp(G_r - G_s)) k_s  (s < r),   T = (I + A)^-1 Diag(beta)   (the UT transform)
        U = T V,  W = T (K * exp(G));   delta = U - W S;   o = (Q * exp(G)) S + Aqk delta,
        Aqk[r, s] = q_r^T Diag(exp(G_r - G_s)) k_s  (s <= r);   S <- Diag(exp(G_C)) S + (K * exp(G_C - G))^T delta.
    `starts`: where given, each chunk's starting state [B, H, K, V] is appended to it.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v, g = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // chunk

    def chunks(t):  # [B, T, H, X] -> [B, H, N, C, X]
        return t.transpose(1, 2).reshape(B, H, N, chunk, t.shape[-1])

    q, k, v, g = (chunks(t) for t in (q, k, v, g))
    beta = beta.transpose(1, 2).reshape(B, H, N, chunk)
    G = g.cumsum(-2)
    incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = G[..., :, None, :] - G[..., None, :, :]                       # [B, H, N, C(r), C(s), K]
    decay = diff.masked_fill(~incl[:, :, None], float("-inf")).exp()      # exp(G_r - G_s) for s <= r, else 0
    Akk = torch.einsum("...rk,...rsk,...sk->...rs", k, decay, k).tril(-1) * beta[..., None]
    Aqk = torch.einsum("...rk,...rsk,...sk->...rs", q, decay, k)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = beta[..., None] * torch.cat([v, k * G.exp()], dim=-1)
    UW = torch.linalg.solve_triangular(eye + Akk, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :V], UW[..., V:]
    Qg = q * G.exp()
    Kd = k * (G[..., -1:, :] - G).exp()
    gC = G[..., -1, :].exp()                                              # [B, H, N, K]
    S = q.new_zeros(B, H, K, V) if s0 is None else s0
    outs = []
    for n in range(N):
        if starts is not None:
            starts.append(S)
        delta = U[:, :, n] - W[:, :, n] @ S
        outs.append(Qg[:, :, n] @ S + Aqk[:, :, n] @ delta)
        S = gC[:, :, n, :, None] * S + Kd[:, :, n].transpose(-1, -2) @ delta
    if not outs:  # an empty sequence
        return v.new_zeros(B, 0, H, V), S
    o = torch.stack(outs, dim=2).reshape(B, H, N * chunk, V)[:, :, :T].transpose(1, 2)
    return o, S


def kda_chunk_reference(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None):
    """The chunked form of fla's chunk_kda in torch (chunks of CHUNK tokens); equals kda_recurrent_reference."""
    o, s = _per_sequence(_chunk_core, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)
    return o.to(v.dtype), s


def kda_prefill_reference(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices=None, chunk_offsets=None,
                          gate_lower_bound=None, chunk_states=False):
    """Serving's prefill of sequences packed by cu_seqlens (batch 1): (o [1, T, H, V], final states [N, H, K, V], and
    with `chunk_states` every chunk's starting state [C, H, K, V], else None), fp32 (float64 stays float64). Sequence
    n's chunks are of `CHUNK` tokens from its first; C = sum over n of ceil(T_n / CHUNK); sequence n's chunk c is row
    chunk_offsets[n] + c (`chunk_layout`; fla's layout of its intermediate states). chunk_indices, chunk_offsets and
    gate_lower_bound: kda_prefill_fla's (the math does not change)."""
    starts = []  # every chunk's starting state [1, H, K, V], sequence after sequence
    core = functools.partial(_chunk_core, starts=starts)
    o, s = _per_sequence(core, q, k, v, g, beta, initial_state, True, cu_seqlens)
    states = (torch.cat(starts) if starts else s.new_zeros(0, *s.shape[1:])) if chunk_states else None
    return o.to(v.dtype), s, states


def chunk_layout(lengths: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks of sequences of `lengths` tokens, on the host: indices [C, 2] (each chunk's sequence and its place
    in it) and offsets [N + 1] (where each sequence's chunks start), int64: fla's `prepare_chunk_indices` and
    `prepare_chunk_offsets`, which a caller with the lengths on the host sends with its other indices (computed by
    fla from cu_seqlens, they cost a host sync)."""
    counts = -(-np.asarray(lengths, dtype=np.int64) // chunk)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    seq = np.repeat(np.arange(len(counts)), counts)
    indices = np.stack([seq, np.arange(int(offsets[-1])) - offsets[seq]], axis=1)
    return torch.from_numpy(indices.reshape(-1, 2)), torch.from_numpy(offsets.astype(np.int64))


def _affine_map(k, v, g, beta):
    """The slice's map S -> M S + S_loc as one tensor [S_loc | M]: [B, H, K, V + K] (fp32). One chunked pass over
    the augmented state, started from [0 | I], with values [v | 0]: the M columns get no input term."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    f32 = torch.float64 if v.dtype == torch.float64 else torch.float32
    k, v, g, beta = (t.to(f32) for t in (k, v, g, beta))
    v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    s0 = torch.cat([k.new_zeros(B, H, K, V), torch.eye(K, dtype=f32, device=k.device).expand(B, H, K, K)], dim=-1)
    return _chunk_core(torch.zeros_like(k), k, v_aug, g, beta, s0)[1]


class _AllGather(torch.autograd.Function):
    """all_gather with a backward that works on gloo: the gradient of my tensor is the sum over ranks of the
    gradient each rank's copy received (an all-reduce, then my slot)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def kda_context_parallel_reference(q, k, v, g, beta, group):
    """KDA over a sequence split across `group`: this rank holds tokens [r T, (r+1) T) of every row. Returns this
    rank's o [B, T, H, V]; autograd flows across ranks (through the gathered maps)."""
    rank, V = dist.get_rank(group), v.shape[-1]
    maps = _AllGather.apply(_affine_map(k, v, g, beta), group)          # [R, B, H, K, V + K]
    # every rank scans every prefix, so each rank's graph holds the gather (its backward is a collective)
    S, prefixes = torch.zeros_like(maps[0][..., :V]), []
    for j in range(maps.shape[0]):
        prefixes.append(S)
        S = maps[j][..., V:] @ S + maps[j][..., :V]
    o, _ = kda_chunk_reference(q, k, v, g, beta, initial_state=torch.stack(prefixes)[rank])
    return o


# -- the forget gate ------------------------------------------------------------------------------------------------
def kda_gate_reference(raw, A_log, dt_bias, lower_bound=None):
    """log alpha [..., H, K] fp32 (float64 stays float64) from the raw gate projection W_b W_a x [..., H, K],
    A_log [H] and dt_bias [H * K] (fla's gates, same formulas as fla.ops.kda.gate):
        lower_bound None:  g = -exp(A_log) * softplus(raw + dt_bias)                       (unbounded below)
        lower_bound lb:    g = lb * sigmoid(exp(A_log) * (raw + dt_bias))   in (lb, 0)     (K3: lb = -5)"""
    H = raw.shape[-2]
    f32 = torch.float64 if raw.dtype == torch.float64 else torch.float32
    z = raw.to(f32) + dt_bias.to(f32).view(H, -1)
    a = A_log.to(f32).exp().view(H, 1)
    if lower_bound is None:
        return -a * torch.nn.functional.softplus(z)
    return lower_bound * torch.sigmoid(a * z)


def kda_gate_fla(raw, A_log, dt_bias, lower_bound=None):
    """fla's fused Triton gate (forward and backward) with the same formulas."""
    from fla.ops.kda.gate import fused_kda_gate

    return fused_kda_gate(raw, A_log, dt_bias, lower_bound=lower_bound, output_dtype=torch.float32)


# -- fla-core on CUDA -----------------------------------------------------------------------------------------------
@functools.cache
def fla_ops():
    """fla.ops.kda (chunk_kda, fused_recurrent_kda) if fla-core is installed, else None (`pip install .[kda]`)."""
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except ImportError:
        return None
    return chunk_kda, fused_recurrent_kda


def _fla_inputs(q, k, v, g, beta):
    """fla takes q, k, v, beta in one dtype (the model's, v's) and the log gate in fp32."""
    dt = v.dtype
    return q.to(dt), k.to(dt), v, g.float(), beta.to(dt)


# fla's safe_gate takes log gates in [SAFE_GATE_LOWEST, 0): bounded so, exp(G_r - G_s) inside a 16-token sub-chunk
# stays in fp32's range split around an anchor, and the intra-chunk products run as tensor-core dots (bf16x3) instead
# of a loop of outer products, one token at a time.
SAFE_GATE_LOWEST = -5.0


def safe_gate(gate_lower_bound: float | None) -> bool:
    """Whether gates bounded below by `gate_lower_bound` (None: unbounded) take fla's safe_gate kernels."""
    return gate_lower_bound is not None and SAFE_GATE_LOWEST <= gate_lower_bound < 0


def kda_chunk_fla(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                  gate_lower_bound=None):
    """fla's chunk_kda (training: forward and backward). gate_lower_bound: the bound the layer's gate keeps g above (g in (lb, 0)); within fla's safe range the
    intra-chunk kernels run on tensor cores."""
    chunk_kda, _ = fla_ops()
    o, s = chunk_kda(*_fla_inputs(q, k, v, g, beta), scale=1.0, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     safe_gate=safe_gate(gate_lower_bound))
    return o.to(v.dtype), s


FLA_CHUNK = 64  # chunk_kda's chunk: the spacing of its intermediate states


def kda_prefill_fla(q, k, v, g, beta, initial_state, cu_seqlens, chunk_indices, chunk_offsets,
                    gate_lower_bound=None, chunk_states=False):
    """kda_prefill_reference on fla: chunk_kda's forward, its steps called one by one, from chunk indices and offsets
    the caller sent (`chunk_layout` of FLA_CHUNK, on the device; chunk_kda would derive them from cu_seqlens with a
    host sync mid-forward) and, with `chunk_states`, every chunk's starting state kept in fp32, exactly as the kernel
    carries it from chunk to chunk (chunk_kda keeps them in the inputs' dtype): a checkpoint taken there equals the
    final state of a pass that stops there. The outputs and final states are chunk_kda's, bit for bit (its output
    kernel reads the states rounded to the inputs' dtype either way). No autograd (serving)."""
    import triton
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as fwd_h_kernel
    from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    q, k, v_, g, beta = (t.contiguous() for t in _fla_inputs(q, k, v, g, beta))
    BT, N = FLA_CHUNK, cu_seqlens.numel() - 1
    _, T, H, K = k.shape
    V = v_.shape[-1]
    g = chunk_local_cumsum(g=g, scale=RCP_LN2, chunk_size=BT, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    w, u, _, kg, Aqk, _ = chunk_kda_fwd_intra(q=q, k=k, v=v_, gk=g, beta=beta, scale=1.0, cu_seqlens=cu_seqlens,
                                              chunk_size=BT, chunk_indices=chunk_indices,
                                              safe_gate=safe_gate(gate_lower_bound))
    h = k.new_empty(1, chunk_indices.shape[0], H, K, V, dtype=torch.float32 if chunk_states else k.dtype)
    v_new = torch.empty_like(u)
    final = k.new_zeros(N, H, K, V, dtype=torch.float32)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    fwd_h_kernel[lambda meta: (triton.cdiv(V, meta["BV"]) * N * H,)](
        k=kg, v=u, w=w, v_new=v_new, g=None, gk=g, h=h, h0=h0, ht=final, cu_seqlens=cu_seqlens,
        chunk_offsets=chunk_offsets, T=T, H=H, HV=H, K=K, V=V, BT=BT, STATE_V_FIRST=False)
    o = chunk_gla_fwd_o_gk(q=q, v=v_new, g=g, A=Aqk, h=h.to(k.dtype), scale=1.0, cu_seqlens=cu_seqlens,
                           chunk_size=BT, chunk_indices=chunk_indices)
    return o.to(v.dtype), final, (h[0] if chunk_states else None)


def kda_recurrent_fla(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None):
    _, fused_recurrent_kda = fla_ops()
    o, s = fused_recurrent_kda(*_fla_inputs(q, k, v, g, beta), scale=1.0, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return o.to(v.dtype), s


def kda_decode_slots_reference(q, k, v, g, beta, pool, slots):
    """One token of each of N sequences (q, k, g: [N, 1, H, K], v: [N, 1, H, V], beta [N, 1, H]) from the states
    pool[slots] ([P, H, K, V], fp32; slots [N] int64), which are updated in place. Returns o [N, 1, H, V]."""
    o, s = kda_recurrent_reference(q, k, v, g, beta, pool[slots], True)
    pool.index_copy_(0, slots, s.to(pool.dtype))
    return o


def kda_decode_slots_fla(q, k, v, g, beta, pool, slots):
    """fla's fused_recurrent_kda in its continuous-batching form: each sequence's state is read from and written
    back to its slot of the pool inside the kernel (no gathered copy of the states)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    o, _ = fused_recurrent_kda_fwd(*_fla_inputs(q, k, v, g, beta), initial_state=pool, scale=1.0,
                                   output_final_state=True, inplace_final_state=True, ssm_state_indices=slots)
    return o.to(v.dtype)


def kda_context_parallel_fla(q, k, v, g, beta, group):
    """fla's chunk_kda with a cp_context: one sequence (B = 1) split contiguously over `group`."""
    from fla.ops.cp import build_cp_context

    chunk_kda, _ = fla_ops()
    if q.shape[0] != 1:
        raise ValueError(f"context-parallel KDA on fla takes one sequence (batch 1), got batch {q.shape[0]}")
    total = q.shape[1] * dist.get_world_size(group)
    cu = torch.tensor([0, total], dtype=torch.long, device=q.device)
    ctx = build_cp_context(cu, group=group, cu_seqlens_cpu=cu.cpu())
    o, _ = chunk_kda(*_fla_inputs(q, k, v, g, beta), scale=1.0, cp_context=ctx)
    return o.to(v.dtype)
