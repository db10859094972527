"""Triton kernels of the grouped expert FFN (forward and backward). Host-side logic lives in grouped_ffn.py.

Notation as grouped_ffn.py: N rows sorted by group, G groups, D input/output width, I inner width.

All row-tiled kernels are persistent: NUM_PROGS programs walk a flat tile index t = pid, pid + NUM_PROGS, ...
Tiles are laid out group after group in `order` (a permutation of the groups, largest first by default), so the
biggest groups are started first and the small ones fill the tail. `cum[j]` is the cumulative tile count of the
first j+1 groups of `order` (computed on the device: no host sync); inside a group the tiles are swizzled in
bands of GROUP_M row tiles so a band's weight columns stay in L2.

Compiled variants never depend on the loads: G is not specialised, and BLOCK_G and NUM_PROGS are fixed per device
(grouped_ffn.py), so a kernel compiles once per model shape at the first step, never mid-run when routing shifts.

DOT_F32 upcasts the dot operands to fp32: only for TRITON_INTERPRET, whose bf16 dot is wrong on CPU (triton 3.9).
"""
from __future__ import annotations

import triton
import triton.language as tl

from k3ray.kernels.situ_glu import situ_fwd, situ_fwd_bwd


@triton.jit
def _row_tile(t, cum_ptr, order_ptr, ends_ptr, G, NT, BM: tl.constexpr, GROUP_M: tl.constexpr,
              BLOCK_G: tl.constexpr):
    """Flat tile index -> (group, first row, end row, row-tile index m, column-tile index n). The group is found
    by counting cum entries <= t, BLOCK_G at a time (a fixed block, so the kernel never recompiles as G changes)."""
    j = 0
    for c0 in range(0, G, BLOCK_G):
        offs = c0 + tl.arange(0, BLOCK_G)
        cum = tl.load(cum_ptr + offs, mask=offs < G, other=2147483647)
        j += tl.sum((cum <= t).to(tl.int32), axis=0)
    base = tl.load(cum_ptr + j - 1, mask=j > 0, other=0)
    g = tl.load(order_ptr + j)
    start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
    end = tl.load(ends_ptr + g)
    local = t - base
    mt = (end - start + BM - 1) // BM
    band = GROUP_M * NT
    first_m = (local // band) * GROUP_M
    rows_in_band = tl.minimum(mt - first_m, GROUP_M)
    m = first_m + (local % band) % rows_in_band
    n = (local % band) // rows_in_band
    return g, start, end, m, n


@triton.jit
def _mainloop(a_ptr, b_ptr, rows, rmask, cols, cmask, K, sam, sak, sbk, sbn,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
              DOT_F32: tl.constexpr):
    """acc[BM, BN] = a[rows, :K] @ b[:K, cols] (b already offset to its group)."""
    ks = tl.arange(0, BK)
    ap = a_ptr + rows[:, None].to(tl.int64) * sam + ks[None, :] * sak
    bp = b_ptr + ks[:, None] * sbk + cols[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(ap, mask=rmask[:, None], other=0.0)
            if EVEN_N:
                b = tl.load(bp)
            else:
                b = tl.load(bp, mask=cmask[None, :], other=0.0)
        else:
            kmask = (k0 + ks) < K
            a = tl.load(ap, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(bp, mask=kmask[:, None] & cmask[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        ap += BK * sak
        bp += BK * sbk
    return acc


@triton.jit(do_not_specialize=["G"])
def ffn_up_kernel(x_ptr, w1_ptr, a_ptr, h_ptr, ends_ptr, order_ptr, cum_ptr,
                  D, I, G, sxm, sxk, swg, swk, swn, beta, beta_lin,
                  SAVE_H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  GROUP_M: tl.constexpr, BLOCK_G: tl.constexpr, NUM_PROGS: tl.constexpr,
                  EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr):
    """a[rows, cols] = situ(x @ w1[g][:, cols], x @ w1[g][:, I + cols]); gate and up tiles share the x tile.
    SAVE_H also stores the pre-activations h [N, 2I] (bf16) for the backward."""
    pid = tl.program_id(0)
    NT = (I + BN - 1) // BN
    total = tl.load(cum_ptr + G - 1)
    for t in range(pid, total, NUM_PROGS):
        g, start, end, m, n = _row_tile(t, cum_ptr, order_ptr, ends_ptr, G, NT, BM, GROUP_M, BLOCK_G)
        rows = start + m * BM + tl.arange(0, BM)
        rmask = rows < end
        cols = n * BN + tl.arange(0, BN)
        cmask = cols < I
        ks = tl.arange(0, BK)
        xp = x_ptr + rows[:, None].to(tl.int64) * sxm + ks[None, :] * sxk
        wp = w1_ptr + g.to(tl.int64) * swg + ks[:, None] * swk + cols[None, :].to(tl.int64) * swn
        up_off = I * swn
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, D, BK):
            if EVEN_K:
                xa = tl.load(xp, mask=rmask[:, None], other=0.0)
                if EVEN_N:
                    wg = tl.load(wp)
                    wu = tl.load(wp + up_off)
                else:
                    wg = tl.load(wp, mask=cmask[None, :], other=0.0)
                    wu = tl.load(wp + up_off, mask=cmask[None, :], other=0.0)
            else:
                kmask = (k0 + ks) < D
                xa = tl.load(xp, mask=rmask[:, None] & kmask[None, :], other=0.0)
                wmask = kmask[:, None] & cmask[None, :]
                wg = tl.load(wp, mask=wmask, other=0.0)
                wu = tl.load(wp + up_off, mask=wmask, other=0.0)
            if DOT_F32:
                xa = xa.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_g = tl.dot(xa, wg, acc_g)
            acc_u = tl.dot(xa, wu, acc_u)
            xp += BK * sxk
            wp += BK * swk
        # Round the pre-activations to the storage dtype first, as the unfused path (and the backward) sees them.
        hg = acc_g.to(a_ptr.dtype.element_ty)
        hu = acc_u.to(a_ptr.dtype.element_ty)
        act = situ_fwd(hg.to(tl.float32), hu.to(tl.float32), beta, beta_lin)
        omask = rmask[:, None] & cmask[None, :]
        r64 = rows[:, None].to(tl.int64)
        tl.store(a_ptr + r64 * I + cols[None, :], act.to(a_ptr.dtype.element_ty), mask=omask)
        if SAVE_H:
            hp = h_ptr + r64 * (2 * I) + cols[None, :]
            tl.store(hp, hg, mask=omask)
            tl.store(hp + I, hu, mask=omask)


@triton.jit(do_not_specialize=["G"])
def grouped_mm_kernel(a_ptr, b_ptr, c_ptr, scale_ptr, ends_ptr, order_ptr, cum_ptr,
                      K, NOUT, G, sam, sak, sbg, sbk, sbn,
                      HAS_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, BLOCK_G: tl.constexpr, NUM_PROGS: tl.constexpr,
                      EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr):
    """c[rows] = (a[rows] @ b[g]) * scale[rows]; b[g] is [K, NOUT] through strides (sbk, sbn); c is [N, NOUT]."""
    pid = tl.program_id(0)
    NT = (NOUT + BN - 1) // BN
    total = tl.load(cum_ptr + G - 1)
    for t in range(pid, total, NUM_PROGS):
        g, start, end, m, n = _row_tile(t, cum_ptr, order_ptr, ends_ptr, G, NT, BM, GROUP_M, BLOCK_G)
        rows = start + m * BM + tl.arange(0, BM)
        rmask = rows < end
        cols = n * BN + tl.arange(0, BN)
        cmask = cols < NOUT
        acc = _mainloop(a_ptr, b_ptr + g.to(tl.int64) * sbg, rows, rmask, cols, cmask, K, sam, sak, sbk, sbn,
                        BM, BN, BK, EVEN_K, EVEN_N, DOT_F32)
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        cp = c_ptr + rows[:, None].to(tl.int64) * NOUT + cols[None, :]
        tl.store(cp, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["G"])
def ffn_dh_kernel(dy_ptr, w2_ptr, h_ptr, scale_ptr, dh_ptr, ds_ptr, ends_ptr, order_ptr, cum_ptr,
                  D, I, G, sym, syk, swg, swk, swn, beta, beta_lin,
                  HAS_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  GROUP_M: tl.constexpr, BLOCK_G: tl.constexpr, NUM_PROGS: tl.constexpr,
                  EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr):
    """dA0 = dy @ w2[g]^T (tile of [rows, cols of I]); epilogue: ds[rows] += sum(dA0 * act), dA = scale * dA0,
    dh[:, cols] = dA * dact/dg, dh[:, I + cols] = dA * dact/du (activation recomputed from the saved h)."""
    pid = tl.program_id(0)
    NT = (I + BN - 1) // BN
    total = tl.load(cum_ptr + G - 1)
    for t in range(pid, total, NUM_PROGS):
        g, start, end, m, n = _row_tile(t, cum_ptr, order_ptr, ends_ptr, G, NT, BM, GROUP_M, BLOCK_G)
        rows = start + m * BM + tl.arange(0, BM)
        rmask = rows < end
        cols = n * BN + tl.arange(0, BN)
        cmask = cols < I
        acc = _mainloop(dy_ptr, w2_ptr + g.to(tl.int64) * swg, rows, rmask, cols, cmask, D, sym, syk, swk, swn,
                        BM, BN, BK, EVEN_K, EVEN_N, DOT_F32)
        omask = rmask[:, None] & cmask[None, :]
        hp = h_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
        hg = tl.load(hp, mask=omask, other=0.0).to(tl.float32)
        hu = tl.load(hp + I, mask=omask, other=0.0).to(tl.float32)
        act, dadg, dadu = situ_fwd_bwd(hg, hu, beta, beta_lin)
        if HAS_SCALE:
            tl.atomic_add(ds_ptr + rows, tl.sum(acc * act, axis=1), mask=rmask)
            acc = acc * tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        dp = dh_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
        tl.store(dp, (acc * dadg).to(dh_ptr.dtype.element_ty), mask=omask)
        tl.store(dp + I, (acc * dadu).to(dh_ptr.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize=["G"])
def grouped_wgrad_kernel(p_ptr, q_ptr, out_ptr, ends_ptr, order_ptr,
                         M1, M2, G, spm, spk, sqm, sqk, sog,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                         NUM_PROGS: tl.constexpr, DOT_F32: tl.constexpr):
    """out[g] [M1, M2] = p[rows_g]^T @ q[rows_g] for every group (zeros for an empty group); out contiguous."""
    pid = tl.program_id(0)
    T1 = (M1 + BM - 1) // BM
    T2 = (M2 + BN - 1) // BN
    per = T1 * T2
    for t in range(pid, G * per, NUM_PROGS):
        j = t // per
        local = t % per
        g = tl.load(order_ptr + j)
        start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
        end = tl.load(ends_ptr + g)
        band = GROUP_M * T2
        first = (local // band) * GROUP_M
        in_band = tl.minimum(T1 - first, GROUP_M)
        i1 = first + (local % band) % in_band
        i2 = (local % band) // in_band
        c1 = i1 * BM + tl.arange(0, BM)
        c2 = i2 * BN + tl.arange(0, BN)
        m1 = c1 < M1
        m2 = c2 < M2
        rs = tl.arange(0, BK)
        pp = p_ptr + (start + rs)[None, :].to(tl.int64) * spm + c1[:, None] * spk
        qp = q_ptr + (start + rs)[:, None].to(tl.int64) * sqm + c2[None, :] * sqk
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for r0 in range(start, end, BK):
            rm = (r0 + rs) < end
            pt = tl.load(pp, mask=m1[:, None] & rm[None, :], other=0.0)
            q = tl.load(qp, mask=rm[:, None] & m2[None, :], other=0.0)
            if DOT_F32:
                pt = pt.to(tl.float32)
                q = q.to(tl.float32)
            acc = tl.dot(pt, q, acc)
            pp += BK * spm
            qp += BK * sqm
        op = out_ptr + g.to(tl.int64) * sog + c1[:, None].to(tl.int64) * M2 + c2[None, :]
        tl.store(op, acc.to(out_ptr.dtype.element_ty), mask=m1[:, None] & m2[None, :])


# ------------------------------------------------------------------------------------------------- TMA variants
# Forward kernels with operands read through host-side tensor descriptors (Hopper TMA + wgmma pipelining). Row
# tiles that run past their group read the next group's rows (rows past N read zeros); those rows are masked at the
# store, so no row of another group is ever written. Needs K % BK == 0 and the weights viewed as 2-D [G*K, n_out].
@triton.jit(do_not_specialize=["G"])
def ffn_up_tma_kernel(x_desc, w1_desc, a_ptr, h_ptr, ends_ptr, order_ptr, cum_ptr, D, I, G, beta, beta_lin,
                      SAVE_H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, BLOCK_G: tl.constexpr, NUM_PROGS: tl.constexpr,
                      DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    NT = (I + BN - 1) // BN
    total = tl.load(cum_ptr + G - 1)
    for t in range(pid, total, NUM_PROGS):
        g, start, end, m, n = _row_tile(t, cum_ptr, order_ptr, ends_ptr, G, NT, BM, GROUP_M, BLOCK_G)
        row0 = start + m * BM
        wrow = g * D
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, D, BK):
            xa = x_desc.load([row0, k0])
            wg = w1_desc.load([wrow + k0, n * BN])
            wu = w1_desc.load([wrow + k0, I + n * BN])
            if DOT_F32:
                xa = xa.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_g = tl.dot(xa, wg, acc_g)
            acc_u = tl.dot(xa, wu, acc_u)
        rows = row0 + tl.arange(0, BM)
        cols = n * BN + tl.arange(0, BN)
        omask = (rows < end)[:, None] & (cols < I)[None, :]
        hg = acc_g.to(a_ptr.dtype.element_ty)
        hu = acc_u.to(a_ptr.dtype.element_ty)
        act = situ_fwd(hg.to(tl.float32), hu.to(tl.float32), beta, beta_lin)
        r64 = rows[:, None].to(tl.int64)
        tl.store(a_ptr + r64 * I + cols[None, :], act.to(a_ptr.dtype.element_ty), mask=omask)
        if SAVE_H:
            hp = h_ptr + r64 * (2 * I) + cols[None, :]
            tl.store(hp, hg, mask=omask)
            tl.store(hp + I, hu, mask=omask)


@triton.jit(do_not_specialize=["G"])
def grouped_mm_tma_kernel(a_desc, b_desc, c_ptr, scale_ptr, ends_ptr, order_ptr, cum_ptr, K, NOUT, G,
                          HAS_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          GROUP_M: tl.constexpr, BLOCK_G: tl.constexpr, NUM_PROGS: tl.constexpr,
                          DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    NT = (NOUT + BN - 1) // BN
    total = tl.load(cum_ptr + G - 1)
    for t in range(pid, total, NUM_PROGS):
        g, start, end, m, n = _row_tile(t, cum_ptr, order_ptr, ends_ptr, G, NT, BM, GROUP_M, BLOCK_G)
        row0 = start + m * BM
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([row0, k0])
            b = b_desc.load([g * K + k0, n * BN])
            if DOT_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        rows = row0 + tl.arange(0, BM)
        cols = n * BN + tl.arange(0, BN)
        rmask = rows < end
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        cp = c_ptr + rows[:, None].to(tl.int64) * NOUT + cols[None, :]
        tl.store(cp, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & (cols < NOUT)[None, :])
