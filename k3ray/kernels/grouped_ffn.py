"""Grouped expert FFN: rows grouped by expert, gate+up GEMM, SiTU-GLU, down GEMM.

Notation: N rows (token-expert pairs) already sorted by expert, G groups (local experts), D = d_latent input/output
width, I = expert inner width. Weights: w1 [G, D, 2I] (gate in [..., :I], up in [..., I:]), w2 [G, I, D].
group_ends [G] int32: cumulative end row of each group (torch._grouped_mm's `offs`), so group g owns rows
[group_ends[g-1], group_ends[g]). row_scale [N] optional: multiplies each output row (routing weights).
"""
from __future__ import annotations

import torch
import triton

from k3ray.kernels import grouped_gemm as gg
from k3ray.kernels.situ_glu import INTERPRET, situ_glu_reference


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
# Block configs: `CONFIGS[kernel]` = (BM, BN, BK, GROUP_M, num_warps, num_stages); benchmarks may overwrite them.
CONFIGS = {
    "up": (128, 128, 64, 8, 8, 3),
    "down": (128, 256, 64, 8, 8, 3),
    "dh": (128, 128, 64, 8, 8, 3),
    "dx": (128, 256, 64, 8, 8, 3),
    "wgrad": (128, 256, 64, 8, 8, 3),
}
_INTERPRET_CONFIG = (16, 16, 16, 2, 1, 1)
_NUM_SMS: dict[int, int] = {}


def _config(name: str) -> tuple[int, int, int, int, int, int]:
    return _INTERPRET_CONFIG if INTERPRET else CONFIGS[name]


def _num_programs(device: torch.device, max_tiles: int) -> int:
    if device.type != "cuda":
        return max(1, min(3, max_tiles))
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return max(1, min(_NUM_SMS[idx], max_tiles))


class _Schedule:
    """Largest-first (or given) group order and cumulative row-tile counts, all on the device (no host sync)."""

    def __init__(self, group_ends: torch.Tensor, n_rows: int, group_order: torch.Tensor | None):
        ends = group_ends.to(torch.int32)
        sizes = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
        if group_order is None:
            group_order = torch.argsort(sizes, descending=True, stable=True)
        self.ends = ends.contiguous()
        self.order = group_order.to(device=ends.device, dtype=torch.int32).contiguous()
        self.sizes = sizes[self.order.long()]
        self.n_rows = n_rows
        self.G = ends.numel()
        self.block_g = triton.next_power_of_2(max(self.G, 2))
        self._cum: dict[tuple[int, int], torch.Tensor] = {}

    def cum(self, bm: int, nt: int) -> torch.Tensor:
        key = (bm, nt)
        if key not in self._cum:
            self._cum[key] = torch.cumsum((self.sizes + bm - 1) // bm * nt, 0).to(torch.int32)
        return self._cum[key]

    def max_tiles(self, bm: int, nt: int) -> int:
        return (triton.cdiv(self.n_rows, bm) + self.G) * nt


def _launch_rowtiled(kernel, name: str, sched: _Schedule, n_out: int, k_dim: int, device, args, **flags):
    bm, bn, bk, gm, warps, stages = _config(name)
    nt = triton.cdiv(n_out, bn)
    progs = _num_programs(device, sched.max_tiles(bm, nt))
    kernel[(progs,)](
        *args, BM=bm, BN=bn, BK=bk, GROUP_M=gm, BLOCK_G=sched.block_g, NUM_PROGS=progs,
        EVEN_K=k_dim % bk == 0, EVEN_N=n_out % bn == 0, DOT_F32=INTERPRET, num_warps=warps,
        num_stages=stages, **flags,
    )


def _ffn_forward(x, w1, w2, sched: _Schedule, row_scale, save_h: bool, beta: float, beta_lin: float):
    n, d = x.shape
    inner = w2.shape[1]
    act = torch.empty(n, inner, device=x.device, dtype=x.dtype)
    h = torch.empty(n, 2 * inner, device=x.device, dtype=x.dtype) if save_h else act
    bm, bn = _config("up")[:2]
    cum = sched.cum(bm, triton.cdiv(inner, bn))
    _launch_rowtiled(
        gg.ffn_up_kernel, "up", sched, inner, d, x.device,
        (x, w1, act, h, sched.ends, sched.order, cum, d, inner, sched.G, x.stride(0), x.stride(1),
         w1.stride(0), w1.stride(1), w1.stride(2), beta, beta_lin),
        SAVE_H=save_h,
    )
    y = _grouped_mm(act, w2, sched, row_scale, "down", transpose_b=False)
    return y, act, h


def _grouped_mm(a, b, sched: _Schedule, scale, name: str, transpose_b: bool):
    """out[rows_g] = a[rows_g] @ (b[g] or b[g]^T) * scale; b [G, K, M] (or [G, M, K] when transpose_b)."""
    sbg, sbk, sbn = (b.stride(0), b.stride(2), b.stride(1)) if transpose_b else b.stride()
    k_dim = a.shape[1]
    n_out = b.shape[1] if transpose_b else b.shape[2]
    out = torch.empty(a.shape[0], n_out, device=a.device, dtype=a.dtype)
    bm, bn = _config(name)[:2]
    cum = sched.cum(bm, triton.cdiv(n_out, bn))
    _launch_rowtiled(
        gg.grouped_mm_kernel, name, sched, n_out, k_dim, a.device,
        (a, b, out, scale if scale is not None else a, sched.ends, sched.order, cum, k_dim, n_out, sched.G,
         a.stride(0), a.stride(1), sbg, sbk, sbn),
        HAS_SCALE=scale is not None,
    )
    return out


def _wgrad(p, q, sched: _Schedule, out_dtype):
    """out[g] = p[rows_g]^T @ q[rows_g]: [G, p.shape[1], q.shape[1]]."""
    m1, m2 = p.shape[1], q.shape[1]
    out = torch.empty(sched.G, m1, m2, device=p.device, dtype=out_dtype)
    bm, bn, bk, gm, warps, stages = _config("wgrad")
    tiles = sched.G * triton.cdiv(m1, bm) * triton.cdiv(m2, bn)
    progs = _num_programs(p.device, tiles)
    gg.grouped_wgrad_kernel[(progs,)](
        p, q, out, sched.ends, sched.order, m1, m2, sched.G, p.stride(0), p.stride(1), q.stride(0), q.stride(1),
        m1 * m2, BM=bm, BN=bn, BK=bk, GROUP_M=gm, NUM_PROGS=progs, DOT_F32=INTERPRET, num_warps=warps,
        num_stages=stages,
    )
    return out


class _GroupedFFN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, group_ends, row_scale, group_order, save_h):
        sched = _Schedule(group_ends, x.shape[0], group_order)
        y, act, h = _ffn_forward(x, w1, w2, sched, row_scale, save_h, 4.0, 25.0)
        if save_h:
            ctx.save_for_backward(x, w1, w2, row_scale, act, h)
            ctx.sched = sched
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, row_scale, act, h = ctx.saved_tensors
        sched = ctx.sched
        dy = dy.contiguous()
        n, d = x.shape
        inner = w2.shape[1]
        dh = torch.empty(n, 2 * inner, device=x.device, dtype=x.dtype)
        has_scale = row_scale is not None
        ds = torch.zeros(n, device=x.device, dtype=torch.float32) if has_scale else dh
        bm, bn = _config("dh")[:2]
        cum = sched.cum(bm, triton.cdiv(inner, bn))
        _launch_rowtiled(
            gg.ffn_dh_kernel, "dh", sched, inner, d, x.device,
            (dy, w2, h, row_scale if has_scale else dy, dh, ds, sched.ends, sched.order, cum, d, inner, sched.G,
             dy.stride(0), dy.stride(1), w2.stride(0), w2.stride(2), w2.stride(1), 4.0, 25.0),
            HAS_SCALE=has_scale,
        )
        dx = _grouped_mm(dh, w1, sched, None, "dx", transpose_b=True) if ctx.needs_input_grad[0] else None
        dw1 = _wgrad(x, dh, sched, w1.dtype) if ctx.needs_input_grad[1] else None
        dw2 = None
        if ctx.needs_input_grad[2]:
            dys = (dy.float() * row_scale.float()[:, None]).to(dy.dtype) if has_scale else dy
            dw2 = _wgrad(act, dys, sched, w2.dtype)
        dscale = ds.to(row_scale.dtype) if has_scale and ctx.needs_input_grad[4] else None
        return dx, dw1, dw2, None, dscale, None, None


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
    x = x.contiguous()
    if row_scale is not None:
        row_scale = row_scale.contiguous()
    leaves = (x, w1, w2) if row_scale is None else (x, w1, w2, row_scale)
    save_h = torch.is_grad_enabled() and any(t.requires_grad for t in leaves)
    return _GroupedFFN.apply(x, w1, w2, group_ends, row_scale, group_order, save_h)
