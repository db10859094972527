"""Grouped expert FFN: rows grouped by expert, gate+up GEMM, SiTU-GLU, down GEMM.

Notation: N rows (token-expert pairs) already sorted by expert, G groups (local experts), D = d_latent input/output
width, I = expert inner width. Weights: w1 [G, D, 2I] (gate in [..., :I], up in [..., I:]), w2 [G, I, D].
group_ends [G] int32: cumulative end row of each group (torch._grouped_mm's `offs`), so group g owns rows
[group_ends[g-1], group_ends[g]). row_scale [N] optional: multiplies each output row (routing weights).
"""
from __future__ import annotations

import threading

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from k3ray.kernels import grouped_gemm as gg
from k3ray.kernels.grad_accumulation import grad_to_add_into
from k3ray.kernels.situ_glu import BETA, BETA_LIN, INTERPRET, situ_glu_reference


def grouped_expert_ffn_reference(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group_ends: torch.Tensor,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [N, D], w1 [G, D, 2I], w2 [G, I, D], group_ends [G] int32 -> [N, D] (x's dtype). Differentiable."""
    inner = w2.shape[1]
    starts = torch.cat([group_ends.new_zeros(1), group_ends[:-1]]).tolist()
    ends = group_ends.tolist()
    outs = []
    for g, (lo, hi) in enumerate(zip(starts, ends)):
        h = x[lo:hi] @ w1[g]
        a = situ_glu_reference(h[:, :inner], h[:, inner:])
        outs.append(a @ w2[g])
    y = torch.cat(outs) if outs else x.new_zeros(0, w2.shape[2])
    if row_scale is not None:
        y = y * row_scale.to(y.dtype).unsqueeze(-1)
    return y


# ---------------------------------------------------------------------------------------------------------------------
# Triton path. Forward: ffn_up_kernel (gate+up GEMM, SiTU-GLU epilogue; also saves the bf16 pre-activations h when a
# gradient is needed) then grouped_mm_kernel (down GEMM, row_scale epilogue). Backward (2x the forward FLOPs):
# ffn_dh_kernel (dY @ W2^T with the SiTU-GLU gradient and d row_scale in its epilogue, activation recomputed from the
# saved h), grouped_mm_kernel (dX = dH @ W1^T), grouped_wgrad_kernel twice (dW1 = X^T dH, dW2 = A^T (s * dY)).
# Block configs: `CONFIGS[kernel]` = (BM, BN, BK, GROUP_M, num_warps, num_stages), "_tma" for the TMA-descriptor
# variant (used where the shapes allow); benchmarks may overwrite them.
CONFIGS = {  # tuned on an H200 (benchmarks/expert_ffn.py --tune), bf16, D=3584, I=2048
    "up_tma": (64, 256, 64, 4, 8, 3),
    "down_tma": (64, 256, 64, 16, 4, 5),
    "dh_tma": (64, 256, 64, 8, 8, 5),
    "dx_tma": (64, 256, 64, 16, 4, 5),
    "up": (128, 128, 64, 8, 8, 3),
    "down": (64, 256, 64, 8, 8, 4),
    "dh": (64, 128, 64, 8, 8, 4),
    "dx": (128, 256, 64, 8, 8, 3),
    "wgrad": (128, 256, 32, 8, 8, 5),
}
# Where a problem has many rows a group (training's: ROWS_PER_GROUP_MANY on average and more), configs tuned at other
# expert widths (D, I) take the place of CONFIGS' entries. gpu2's (D 2048, I 1024): tuned on an H100 at 64 experts x
# 65,536 rows (`benchmarks/expert_ffn.py --dims 2048 1024 --shapes 64:65536:balanced 64:65536:zipf1.2 --tune`):
# up, down, dH and dX 4-11 % faster than at CONFIGS there.
CONFIGS_AT_WIDTHS = {
    (2048, 1024): {"up_tma": (128, 128, 64, 8, 8, 3), "down_tma": (128, 256, 64, 8, 8, 3),
                   "dh_tma": (128, 128, 64, 8, 8, 4), "dx_tma": (128, 256, 64, 8, 8, 3)},
}
ROWS_PER_GROUP_MANY = 256
USE_TMA = True  # read operands through TMA descriptors where the shapes allow
_INTERPRET_CONFIG = (16, 16, 16, 2, 1, 1)
_FP32_CONFIG = (64, 64, 32, 4, 4, 2)  # fp32 operands: the bf16 tiles would not fit in shared memory
_NUM_SMS: dict[int, int] = {}
_BLOCK_G = 128  # groups the schedule kernel ranks at a time (fixed: no recompile as G changes)


def _config(name: str, t: torch.Tensor, at: dict | None = None) -> tuple[int, ...]:
    if INTERPRET:
        return _INTERPRET_CONFIG
    if t.element_size() > 2:
        return _FP32_CONFIG
    return at[name] if at is not None and name in at else CONFIGS[name]


def configs_at(widths: tuple[int, int], sched: "_Schedule") -> dict | None:
    """The configs tuned at the experts' widths (D, I), for a problem of many rows a group; None: CONFIGS'."""
    return CONFIGS_AT_WIDTHS.get(widths) if sched.n_rows >= ROWS_PER_GROUP_MANY * sched.G else None


def _tma_config(name: str, k_dim: int, at: dict | None, *tensors: torch.Tensor):
    """(config, use TMA) for kernel `name` (`at`: configs_at's table): TMA needs contiguous, 16-byte aligned
    operands and K % BK == 0."""
    cfg = _config(name + "_tma", tensors[0], at)
    ok = USE_TMA and k_dim % cfg[2] == 0 and all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0 for t in tensors
    )
    return (cfg, True) if ok else (_config(name, tensors[0], at), False)


def _fast_act(t: torch.Tensor) -> bool:
    """Hardware tanh in the SiTU-GLU epilogues: on the GPU, for 16-bit outputs (its ~2^-11 relative error is below
    their rounding); fp32 keeps the exact formula."""
    return not INTERPRET and t.element_size() <= 2


_THREAD = threading.local()


def _bind_cuda_context(device: torch.device) -> None:
    """Triton encodes TMA descriptors through the driver API before its launch binds a context. A thread whose first
    CUDA work is such a launch has none current and fails ("invalid device context"): autograd's backward thread,
    when the caching allocator needs no new memory. Any runtime call binds the primary context; a stream query does
    so without waiting. Once per thread and device."""
    if device.type != "cuda":
        return
    bound = getattr(_THREAD, "bound", None)
    if bound is None:
        bound = _THREAD.bound = set()
    if device.index not in bound:
        torch.cuda.current_stream(device).query()
        bound.add(device.index)


def _desc(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    _bind_cuda_context(t.device)
    return TensorDescriptor.from_tensor(t, [rows, cols])


def _num_programs(device: torch.device) -> int:
    """One program per SM (3 under the interpreter), whatever the tile count: NUM_PROGS is a compile-time constant,
    so a count that followed the load would recompile the kernel; programs without a tile return at once."""
    if device.type != "cuda":
        return 3
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


class _Schedule:
    """Row-tile tables (grouped_gemm.schedule_kernel), one per tile height, built on the device when first used:
    one small launch each, no host sync."""

    def __init__(self, group_ends: torch.Tensor, group_order: torch.Tensor | None, n_rows: int):
        self.ends = group_ends.to(torch.int32).contiguous()
        self.order_in = None if group_order is None else group_order.to(self.ends.device, torch.int32).contiguous()
        self.G = self.ends.numel()
        self.n_rows = n_rows
        self._tiles: dict[int, tuple[torch.Tensor, int]] = {}

    def tiles(self, bm: int) -> tuple[torch.Tensor, int]:
        """(table, MT) for BM-row tiles; layout in grouped_gemm's docstring."""
        if bm not in self._tiles:
            mt = self.n_rows // bm + self.G
            tiles = torch.empty(2 * mt + 1 + self.G, device=self.ends.device, dtype=torch.int32)
            order = self.order_in if self.order_in is not None else self.ends
            gg.schedule_kernel[(self.G,)](self.ends, order, tiles, self.G, mt, BM=bm,
                                          HAS_ORDER=self.order_in is not None, BLOCK=_BLOCK_G)
            self._tiles[bm] = (tiles, mt)
        return self._tiles[bm]

    def order(self) -> torch.Tensor:
        """[G] int32: the groups, first to last."""
        tiles, mt = next(iter(self._tiles.values())) if self._tiles else self.tiles(64)
        return tiles[2 * mt + 1:]


def _launch_rowtiled(kernel, cfg, tma: bool, sched: _Schedule, n_out: int, k_dim: int, head, tail, **flags):
    """Persistent launch of a row-tiled kernel: kernel(*head, tiles, ends, MT, *tail, **constexprs)."""
    bm, bn, bk, gm, warps, stages = cfg
    tiles, mt = sched.tiles(bm)
    progs = _num_programs(sched.ends.device)
    kernel[(progs,)](
        *head, tiles, sched.ends, mt, *tail, TMA=tma, BM=bm, BN=bn, BK=bk, GROUP_M=gm, NUM_PROGS=progs,
        EVEN_K=k_dim % bk == 0, EVEN_N=n_out % bn == 0, DOT_F32=INTERPRET, num_warps=warps,
        num_stages=stages, **flags,
    )


def _ffn_up(x, w1, sched: _Schedule, inner: int, save_h: bool, beta: float, beta_lin: float):
    """act [N, I] = SiTU-GLU of the gate+up GEMM, and the pre-activations h [N, 2I] when save_h (else h is act)."""
    n, d = x.shape
    act = torch.empty(n, inner, device=x.device, dtype=x.dtype)
    h = torch.empty(n, 2 * inner, device=x.device, dtype=x.dtype) if save_h else act
    if n == 0:  # no rows: nothing to launch (and no kernel variant that only empty inputs would compile)
        return act, h
    cfg, tma = _tma_config("up", d, configs_at((d, inner), sched), x, w1)
    srcs = (_desc(x, cfg[0], cfg[2]), _desc(w1.view(-1, w1.shape[2]), cfg[2], cfg[1])) if tma else (x, w1)
    _launch_rowtiled(gg.ffn_up_kernel, cfg, tma, sched, inner, d, (*srcs, act, h),
                     (d, inner, x.stride(0), x.stride(1), *w1.stride(), beta, beta_lin), SAVE_H=save_h,
                     FAST_ACT=_fast_act(x))
    return act, h


def _ffn_forward(x, w1, w2, sched: _Schedule, row_scale, save_h: bool, beta: float, beta_lin: float):
    act, h = _ffn_up(x, w1, sched, w2.shape[1], save_h, beta, beta_lin)
    y = _grouped_mm(act, w2, sched, row_scale, "down", transpose_b=False)
    return y, act, h


def _grouped_mm(a, b, sched: _Schedule, scale, name: str, transpose_b: bool):
    """out[rows_g] = a[rows_g] @ (b[g] or b[g]^T) * scale; b [G, K, M] (or [G, M, K] when transpose_b)."""
    k_dim = a.shape[1]
    n_out = b.shape[1] if transpose_b else b.shape[2]
    out = torch.empty(a.shape[0], n_out, device=a.device, dtype=a.dtype)
    if a.shape[0] == 0:
        return out
    widths = (b.shape[1], b.shape[2] // 2) if transpose_b else (b.shape[2], b.shape[1])  # b: w1 [G, D, 2I] or w2
    cfg, tma = _tma_config(name, k_dim, configs_at(widths, sched), a, b)
    srcs = (a, b)
    if tma:
        bm, bn, bk = cfg[:3]
        b_desc = _desc(b.view(-1, k_dim), bn, bk) if transpose_b else _desc(b.view(-1, n_out), bk, bn)
        srcs = (_desc(a, bm, bk), b_desc)
    sbg, sbk, sbn = (b.stride(0), b.stride(2), b.stride(1)) if transpose_b else b.stride()
    _launch_rowtiled(gg.grouped_mm_kernel, cfg, tma, sched, n_out, k_dim,
                     (*srcs, out, scale if scale is not None else a),
                     (k_dim, n_out, a.stride(0), a.stride(1), sbg, sbk, sbn),
                     HAS_SCALE=scale is not None, TRANS_B=transpose_b)
    return out


def _ffn_dh(dy, w2, h, row_scale, sched: _Schedule, beta: float, beta_lin: float):
    """dh [N, 2I] (gradient of the pre-activations) and ds [N] fp32 (of row_scale; None without one)."""
    n, d = dy.shape
    inner = w2.shape[1]
    dh = torch.empty(n, 2 * inner, device=dy.device, dtype=dy.dtype)
    has_scale = row_scale is not None
    ds = torch.zeros(n, device=dy.device, dtype=torch.float32) if has_scale else None
    if n == 0:
        return dh, ds
    cfg, tma = _tma_config("dh", d, configs_at((d, inner), sched), dy, w2)
    srcs = (_desc(dy, cfg[0], cfg[2]), _desc(w2.view(-1, d), cfg[1], cfg[2])) if tma else (dy, w2)
    _launch_rowtiled(gg.ffn_dh_kernel, cfg, tma, sched, inner, d,
                     (*srcs, h, row_scale if has_scale else dy, dh, ds if has_scale else dh),
                     (d, inner, dy.stride(0), dy.stride(1), w2.stride(0), w2.stride(2), w2.stride(1), beta, beta_lin),
                     HAS_SCALE=has_scale, FAST_ACT=_fast_act(dy))
    return dh, ds


def _wgrad(p, q, sched: _Schedule, out_dtype, into: torch.Tensor | None = None):
    """out[g] = p[rows_g]^T @ q[rows_g]: [G, p.shape[1], q.shape[1]], or added to `into` (that shape, contiguous)
    and `into` returned. Tiles never straddle two groups' blocks when the block shape divides [M1, M2]; then the
    stores of a new `out` go through a TMA descriptor (asynchronous: the next tile's loads start while this one's
    bulk store drains)."""
    m1, m2 = p.shape[1], q.shape[1]
    if p.shape[0] == 0:
        return into if into is not None else torch.zeros(sched.G, m1, m2, device=p.device, dtype=out_dtype)
    out = into if into is not None else torch.empty(sched.G, m1, m2, device=p.device, dtype=out_dtype)
    bm, bn, bk, gm, warps, stages = _config("wgrad", p)
    tma_out = (USE_TMA and into is None and m1 % bm == 0 and m2 % bn == 0
               and (m2 * out.element_size()) % 16 == 0)
    out_dst = _desc(out.view(-1, m2), bm, bn) if tma_out else out
    progs = _num_programs(p.device)
    gg.grouped_wgrad_kernel[(progs,)](
        p, q, out_dst, sched.ends, sched.order(), m1, m2, sched.G, p.stride(0), p.stride(1), q.stride(0),
        q.stride(1), m1 * m2, TMA_OUT=tma_out, BM=bm, BN=bn, BK=bk, GROUP_M=gm, NUM_PROGS=progs,
        DOT_F32=INTERPRET, ACCUMULATE=into is not None, num_warps=warps, num_stages=stages,
    )
    return out


class _GroupedFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, group_ends, row_scale, group_order):
        sched = _Schedule(group_ends, group_order, x.shape[0])
        y, act, h = _ffn_forward(x, w1, w2, sched, row_scale, True, BETA, BETA_LIN)
        ctx.save_for_backward(x, w1, w2, row_scale, act, h)
        ctx.sched = sched
        ctx.weights = (w1, w2)  # the tensors themselves (saved tensors unpack as new objects): their .grad
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, row_scale, act, h = ctx.saved_tensors
        sched = ctx.sched
        dy = dy.contiguous()
        dh, ds = _ffn_dh(dy, w2, h, row_scale, sched, BETA, BETA_LIN)
        dx = _grouped_mm(dh, w1, sched, None, "dx", transpose_b=True) if ctx.needs_input_grad[0] else None
        # a weight whose gradient an earlier micro-batch left gets this one's added in place (returned as None)
        w1_grad, w2_grad = grad_to_add_into(ctx.weights[0]), grad_to_add_into(ctx.weights[1])
        dw1 = dw2 = None
        if ctx.needs_input_grad[1]:
            dw1 = _wgrad(x, dh, sched, w1.dtype, w1_grad)
        if ctx.needs_input_grad[2]:
            dys = (dy.float() * row_scale.float()[:, None]).to(dy.dtype) if row_scale is not None else dy
            dw2 = _wgrad(act, dys, sched, w2.dtype, w2_grad)
        dscale = ds.to(row_scale.dtype) if ds is not None and ctx.needs_input_grad[4] else None
        return (dx, None if w1_grad is not None else dw1, None if w2_grad is not None else dw2, None, dscale,
                None)


def grouped_expert_ffn_triton(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group_ends: torch.Tensor,
    row_scale: torch.Tensor | None = None,
    *,
    group_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `grouped_expert_ffn_reference`. group_order: permutation of the G groups giving the order in
    which the persistent kernels take their tiles (default: largest group first). Differentiable w.r.t. x, w1, w2,
    row_scale."""
    if w1.shape[0] == 0 and x.shape[0] > 0:
        raise ValueError(f"grouped_expert_ffn: x has {x.shape[0]} rows but there are no groups (w1 has 0 experts)")
    x = x.contiguous()
    if row_scale is not None:
        row_scale = row_scale.contiguous()
    leaves = (x, w1, w2) if row_scale is None else (x, w1, w2, row_scale)
    if torch.is_grad_enabled() and any(t.requires_grad for t in leaves):
        return _GroupedFFN.apply(x, w1, w2, group_ends, row_scale, group_order)
    sched = _Schedule(group_ends, group_order, x.shape[0])  # inference: no autograd node, nothing saved
    return _ffn_forward(x, w1, w2, sched, row_scale, False, BETA, BETA_LIN)[0]
