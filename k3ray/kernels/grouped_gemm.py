"""Triton kernels of the grouped expert FFN (forward and backward). Host-side logic lives in grouped_ffn.py.

Notation as grouped_ffn.py: N rows sorted by group, G groups, D input/output width, I inner width.

Row tiles. `schedule_kernel` lays out every group's BM-row tiles back to back, groups in `order` (largest first by
default), into a table on the device (no host sync): tiles[i] = group of row tile i, tiles[MT + i] = its first row,
tiles[2 MT] = the number of row tiles, tiles[2 MT + 1 + r] = the group of rank r. MT = N // BM + G bounds the count.
The row-tiled kernels are persistent: NUM_PROGS programs walk a flat tile index t = pid, pid + NUM_PROGS, ...; t
maps to (row tile, column tile) in bands of GROUP_M row tiles, so a band's weight columns stay in L2 and the biggest
groups start first while the small ones fill the tail. The lookup is three loads, no loop. (Flattening the tile loop
into the K loop, `tl.range(..., flatten=True)`, measured slower on an H200; Triton 3.6 has no warp specialization on
Hopper.)

TMA: operands read through tensor descriptors (Hopper TMA + wgmma pipelining) when the host built them; otherwise
plain pointer loads. Row tiles that run past their group read the next group's rows (rows past N read zeros); those
rows are masked at the store, so no row of another group is ever written. Weights are viewed 2-D: [G*K, n_out], or
[G*n_out, K] with TRANS_B (the tile is transposed in shared memory).

Compiled variants never depend on the loads: G and MT are not specialised, NUM_PROGS is fixed per device and the
schedule's BLOCK is fixed (grouped_ffn.py), so a kernel compiles once per model shape, never mid-run.

DOT_F32 upcasts the dot operands to fp32: only for TRITON_INTERPRET, whose bf16 dot is wrong on CPU (triton 3.9).
"""
from __future__ import annotations

import triton
import triton.language as tl

from k3ray.kernels.situ_glu import situ_fwd, situ_fwd_bwd


@triton.jit(do_not_specialize=["G", "MT"])
def schedule_kernel(ends_ptr, order_ptr, tiles_ptr, G, MT, BM: tl.constexpr, HAS_ORDER: tl.constexpr,
                    BLOCK: tl.constexpr):
    """One program per group rank r (grid G). Its group: order[r] (HAS_ORDER) or group r, ranked then by size,
    largest first (ties by index). Writes the group's row tiles after those of every group ranked before it."""
    pid = tl.program_id(0)
    if HAS_ORDER:
        g = tl.load(order_ptr + pid)
    else:
        g = pid
    start = tl.load(ends_ptr + g - 1, mask=g > 0, other=0)
    size = tl.load(ends_ptr + g) - start
    rank = 0
    offset = 0
    for c0 in range(0, G, BLOCK):
        j = c0 + tl.arange(0, BLOCK)
        valid = j < G
        if HAS_ORDER:
            k = tl.load(order_ptr + j, mask=valid, other=0)
        else:
            k = j
        k_size = tl.load(ends_ptr + k, mask=valid, other=0) - tl.load(ends_ptr + k - 1, mask=valid & (k > 0), other=0)
        if HAS_ORDER:
            before = valid & (j < pid)
        else:
            before = valid & ((k_size > size) | ((k_size == size) & (k < g)))
        rank += tl.sum(before.to(tl.int32), axis=0)
        offset += tl.sum(tl.where(before, (k_size + BM - 1) // BM, 0), axis=0)
    tl.store(tiles_ptr + 2 * MT + 1 + rank, g)
    n_tiles = (size + BM - 1) // BM
    for m0 in range(0, n_tiles, BLOCK):
        m = m0 + tl.arange(0, BLOCK)
        keep = m < n_tiles
        tl.store(tiles_ptr + offset + m, tl.zeros([BLOCK], dtype=tl.int32) + g, mask=keep)
        tl.store(tiles_ptr + MT + offset + m, start + m * BM, mask=keep)
    if rank == G - 1:
        tl.store(tiles_ptr + 2 * MT, offset + n_tiles)


@triton.jit
def _band(t, n_rows, n_cols, GROUP_M: tl.constexpr):
    """Flat index over an [n_rows, n_cols] grid of tiles -> (row, column), walked in bands of GROUP_M rows (column by
    column inside a band), so the tiles running at once share their column operand in L2."""
    band = GROUP_M * n_cols
    first = (t // band) * GROUP_M
    in_band = tl.minimum(n_rows - first, GROUP_M)
    return first + (t % band) % in_band, (t % band) // in_band


@triton.jit
def _tile(t, tiles_ptr, ends_ptr, MT, total_m, NT, GROUP_M: tl.constexpr):
    """Flat tile index -> (group, first row, group end row, column-tile index)."""
    i, n = _band(t, total_m, NT, GROUP_M)
    g = tl.load(tiles_ptr + i)
    return g, tl.load(tiles_ptr + MT + i), tl.load(ends_ptr + g), n


@triton.jit
def _dots(a, b, b2, acc, acc2, DUAL: tl.constexpr, DOT_F32: tl.constexpr):
    """acc += a @ b and, DUAL, acc2 += a @ b2 (the second weight tile shares the a tile)."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        b2 = b2.to(tl.float32)
    acc = tl.dot(a, b, acc)
    if DUAL:
        acc2 = tl.dot(a, b2, acc2)
    return acc, acc2


@triton.jit
def _mainloop(a_src, b_src, row0, col0, col2, rmask, cmask, g, K, NOUT, sam, sak, sbg, sbk, sbn,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, TRANS_B: tl.constexpr,
              DUAL: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr):
    """acc[BM, BN] = a[row0:+BM, :K] @ b[g][:K, col0:+BN]; DUAL: also acc2 from b's columns col2:+BN,
    sharing the a tile (else acc2 is acc). TMA: a_src, b_src are descriptors; otherwise pointers with strides (b's
    through (sbg, sbk, sbn), which also express a transpose)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if DUAL:
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
    else:
        acc2 = acc
    if TMA:
        if TRANS_B:
            brow = g * NOUT + col0
        else:
            brow = g * K
        for k0 in range(0, K, BK):
            a = a_src.load([row0, k0])
            if TRANS_B:
                b = b_src.load([brow, k0]).T
            else:
                b = b_src.load([brow + k0, col0])
            b2 = b
            if DUAL:
                b2 = b_src.load([brow + k0, col2])
            acc, acc2 = _dots(a, b, b2, acc, acc2, DUAL, DOT_F32)
    else:
        ks = tl.arange(0, BK)
        rows = row0 + tl.arange(0, BM)
        cols = col0 + tl.arange(0, BN)
        ap = a_src + rows[:, None].to(tl.int64) * sam + ks[None, :] * sak
        bp = b_src + g.to(tl.int64) * sbg + ks[:, None] * sbk + cols[None, :].to(tl.int64) * sbn
        b2_off = (col2 - col0) * sbn
        for k0 in range(0, K, BK):
            if EVEN_K:
                amask = rmask[:, None]
                bmask = cmask[None, :]
            else:
                kmask = (k0 + ks) < K
                amask = rmask[:, None] & kmask[None, :]
                bmask = kmask[:, None] & cmask[None, :]
            a = tl.load(ap, mask=amask, other=0.0)
            if EVEN_K and EVEN_N:
                b = tl.load(bp)
            else:
                b = tl.load(bp, mask=bmask, other=0.0)
            b2 = b
            if DUAL:
                if EVEN_K and EVEN_N:
                    b2 = tl.load(bp + b2_off)
                else:
                    b2 = tl.load(bp + b2_off, mask=bmask, other=0.0)
            acc, acc2 = _dots(a, b, b2, acc, acc2, DUAL, DOT_F32)
            ap += BK * sak
            bp += BK * sbk
    return acc, acc2


@triton.jit(do_not_specialize=["MT"])
def ffn_up_kernel(x_src, w1_src, a_ptr, h_ptr, tiles_ptr, ends_ptr, MT,
                  D, I, sxm, sxk, swg, swk, swn, beta, beta_lin,
                  SAVE_H: tl.constexpr, FAST_ACT: tl.constexpr, TMA: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr,
                  EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr):
    """a[rows, cols] = situ(x @ w1[g][:, cols], x @ w1[g][:, I + cols]); gate and up tiles share the x tile.
    SAVE_H also stores the pre-activations h [N, 2I] (bf16) for the backward."""
    pid = tl.program_id(0)
    NT = tl.cdiv(I, BN)
    total_m = tl.load(tiles_ptr + 2 * MT)
    for t in range(pid, total_m * NT, NUM_PROGS):
        g, row0, end, n = _tile(t, tiles_ptr, ends_ptr, MT, total_m, NT, GROUP_M)
        rows = row0 + tl.arange(0, BM)
        rmask = rows < end
        cols = n * BN + tl.arange(0, BN)
        cmask = cols < I
        acc_g, acc_u = _mainloop(x_src, w1_src, row0, n * BN, I + n * BN, rmask, cmask, g, D, 2 * I, sxm, sxk, swg,
                                 swk, swn, BM, BN, BK, TMA, False, True, EVEN_K, EVEN_N, DOT_F32)
        # Round the pre-activations to the storage dtype first, as the unfused path (and the backward) sees them.
        hg = acc_g.to(a_ptr.dtype.element_ty)
        hu = acc_u.to(a_ptr.dtype.element_ty)
        act = situ_fwd(hg.to(tl.float32), hu.to(tl.float32), beta, beta_lin, FAST_ACT)
        omask = rmask[:, None] & cmask[None, :]
        r64 = rows[:, None].to(tl.int64)
        tl.store(a_ptr + r64 * I + cols[None, :], act.to(a_ptr.dtype.element_ty), mask=omask)
        if SAVE_H:
            hp = h_ptr + r64 * (2 * I) + cols[None, :]
            tl.store(hp, hg, mask=omask)
            tl.store(hp + I, hu, mask=omask)


@triton.jit(do_not_specialize=["MT"])
def grouped_mm_kernel(a_src, b_src, c_ptr, scale_ptr, tiles_ptr, ends_ptr, MT,
                      K, NOUT, sam, sak, sbg, sbk, sbn,
                      HAS_SCALE: tl.constexpr, TMA: tl.constexpr, TRANS_B: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr,
                      EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr):
    """c[rows] = (a[rows] @ b[g]) * scale[rows]; c is [N, NOUT]."""
    pid = tl.program_id(0)
    NT = tl.cdiv(NOUT, BN)
    total_m = tl.load(tiles_ptr + 2 * MT)
    for t in range(pid, total_m * NT, NUM_PROGS):
        g, row0, end, n = _tile(t, tiles_ptr, ends_ptr, MT, total_m, NT, GROUP_M)
        rows = row0 + tl.arange(0, BM)
        rmask = rows < end
        cols = n * BN + tl.arange(0, BN)
        cmask = cols < NOUT
        acc, _ = _mainloop(a_src, b_src, row0, n * BN, n * BN, rmask, cmask, g, K, NOUT, sam, sak, sbg, sbk, sbn,
                           BM, BN, BK, TMA, TRANS_B, False, EVEN_K, EVEN_N, DOT_F32)
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        cp = c_ptr + rows[:, None].to(tl.int64) * NOUT + cols[None, :]
        tl.store(cp, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["MT"])
def ffn_dh_kernel(dy_src, w2_src, h_ptr, scale_ptr, dh_ptr, ds_ptr, tiles_ptr, ends_ptr, MT,
                  D, I, sym, syk, swg, swk, swn, beta, beta_lin,
                  HAS_SCALE: tl.constexpr, FAST_ACT: tl.constexpr, TMA: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr,
                  EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_F32: tl.constexpr):
    """dA0 = dy @ w2[g]^T (tile of [rows, cols of I]); epilogue: ds[rows] += sum(dA0 * act), dA = scale * dA0,
    dh[:, cols] = dA * dact/dg, dh[:, I + cols] = dA * dact/du (activation recomputed from the saved h)."""
    pid = tl.program_id(0)
    NT = tl.cdiv(I, BN)
    total_m = tl.load(tiles_ptr + 2 * MT)
    for t in range(pid, total_m * NT, NUM_PROGS):
        g, row0, end, n = _tile(t, tiles_ptr, ends_ptr, MT, total_m, NT, GROUP_M)
        rows = row0 + tl.arange(0, BM)
        rmask = rows < end
        cols = n * BN + tl.arange(0, BN)
        cmask = cols < I
        acc, _ = _mainloop(dy_src, w2_src, row0, n * BN, n * BN, rmask, cmask, g, D, I, sym, syk, swg, swk, swn,
                           BM, BN, BK, TMA, True, False, EVEN_K, EVEN_N, DOT_F32)
        # h is loaded after the main loop: issued before it, it stays live through the loop (more registers), which
        # measured slower with the 64x256 tiles that are fastest here.
        omask = rmask[:, None] & cmask[None, :]
        hp = h_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
        hg = tl.load(hp, mask=omask, other=0.0)
        hu = tl.load(hp + I, mask=omask, other=0.0)
        act, dadg, dadu = situ_fwd_bwd(hg.to(tl.float32), hu.to(tl.float32), beta, beta_lin, FAST_ACT)
        if HAS_SCALE:
            tl.atomic_add(ds_ptr + rows, tl.sum(acc * act, axis=1), mask=rmask)
            acc = acc * tl.load(scale_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        dp = dh_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
        tl.store(dp, (acc * dadg).to(dh_ptr.dtype.element_ty), mask=omask)
        tl.store(dp + I, (acc * dadu).to(dh_ptr.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize=["G"])
def grouped_wgrad_kernel(p_ptr, q_ptr, out_dst, ends_ptr, order_ptr,
                         M1, M2, G, spm, spk, sqm, sqk, sog,
                         TMA_OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr, DOT_F32: tl.constexpr,
                         ACCUMULATE: tl.constexpr = False):
    """out[g] [M1, M2] = p[rows_g]^T @ q[rows_g] for every group (zeros for an empty group); out contiguous.
    TMA_OUT: out_dst is a descriptor over out viewed [G*M1, M2] (BM | M1 and BN | M2), else a pointer.
    ACCUMULATE (a pointer out): out[g] += that, added in fp32 before the one rounding."""
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
        i1, i2 = _band(local, T1, T2, GROUP_M)
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
        if TMA_OUT:
            out_dst.store([g * M1 + i1 * BM, i2 * BN], acc.to(out_dst.dtype))
        else:
            op = out_dst + g.to(tl.int64) * sog + c1[:, None].to(tl.int64) * M2 + c2[None, :]
            if ACCUMULATE:
                acc += tl.load(op, mask=m1[:, None] & m2[None, :], other=0.0).to(tl.float32)
            tl.store(op, acc.to(out_dst.dtype.element_ty), mask=m1[:, None] & m2[None, :])
