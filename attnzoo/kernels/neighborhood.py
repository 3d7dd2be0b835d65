"""Fused neighborhood attention (NA / dilated NA, 1-D and 2-D, optional RPB) in Triton.

Semantics are those of :func:`attnzoo.ops.neighborhood.na_reference` (clamped windows per
dilation group, ``q`` scaled, ``rpb`` added unscaled). Layout heads-last ``[B, H, W, heads, d]``
with any strides; 1-D runs as 2-D with ``H = 1``.

Forward (one program per tile of queries, see :mod:`.tiling`): streams the tile's key region in
blocks with an online softmax in base 2, fp32 accumulation, and saves the log-sum-exp.
Backward, FlashAttention-2 style, recomputing the probabilities from the log-sum-exp:

* query-centric pass: ``delta = rowsum(dO * O)``, ``dQ``, and the rpb gradient. For each
  region row a block touches, each block's ``dS`` is gathered by relative x-offset
  (``tl.gather``), then folded into relative rows with a one-hot ``tl.dot``, so a program
  reduces its whole tile into one ``(2K-1)^2`` table in registers and writes it once;
* key-centric pass: a tile of keys streams the queries whose (clamped) windows reach it and
  accumulates ``dK`` and ``dV`` in registers: overlapping windows need no atomics. A few more
  programs of the same launch sum the first pass's tables per head, in a fixed order
  (deterministic, no contended atomics), into the bias's gradient in its own dtype.

Host side: each kernel's launch configuration (tiling, warps, pipeline stages) comes from a
small autotune space per call (:func:`configs`: the tiling of least logit work first), timed on
the GPU once per process (:class:`~attnzoo.kernels.Autotuner`); the passes run as the custom
ops ``attnzoo::na_fused`` and ``attnzoo::na_fused_backward``. What the kernels support is
declared as data (:data:`LIMITS`, :data:`MAX_KERNEL_SIZE`) and checked per device, with the
shared memory of the smallest configuration (:func:`shared_memory`, an upper bound that
scripts/compile_kernels.py checks against every compiled launch) against the device's limit
(:func:`not_supported_reasons`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.autograd import forward_ad

from . import (Allocation, Autotuner, KernelLimits, TuningStore, allocation, can_tune,
               device_info, eager, kernel_op, launch_on_device, narrow_offsets,
               once_differentiable, tiling, traced, tuning_scope, will_tune)
from .tiling import (LOG2E, Tiling, dot, dot_precision, grid_tiles, group_length, load_rows,
                     na_query_region, na_tile_region, na_window_start, online_softmax_step, pow2,
                     program_tile, rank_tilings, region_block, round_to, store_rows,
                     sum_programs, sum_tables, tile_positions, to_base2, to_source)

__all__ = ["na_fused", "support", "not_supported_reasons", "call_reasons", "configs",
           "shared_memory", "Config", "LIMITS", "KERNELS", "INTERPRETED", "MAX_KERNEL_SIZE",
           "MAX_HEAD_DIM", "DTYPES"]

MAX_KERNEL_SIZE = 13
MAX_HEAD_DIM = 128
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETED = tiling.INTERPRETED  # built for Triton's interpreter (tiling.INTERPRETED decides)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _in_window(wy, wx, ky, kx, valid_q, valid_k, KH: tl.constexpr, KW: tl.constexpr):
    """[len(q), len(k)]: key (ky, kx) lies in the window starting at (wy, wx) of a query."""
    return ((ky[None, :] >= wy[:, None]) & (ky[None, :] < wy[:, None] + KH)
            & (kx[None, :] >= wx[:, None]) & (kx[None, :] < wx[:, None] + KW)
            & valid_q[:, None] & valid_k[None, :])


@triton.jit
def _rpb_table(RPB, h, KH: tl.constexpr, KW: tl.constexpr, NREL: tl.constexpr,
               HAS_RPB: tl.constexpr, QT: tl.constexpr):
    """Head ``h``'s bias table, flat and padded to ``NREL`` (a power of two), times log2(e):
    held in registers and indexed with tl.gather, not re-read from memory per block (a global
    gather per logit doubled the forward's registers). The table is read in its own dtype and
    rounded to q's (``QT``), as the reference casts it: the host makes no cast of it (an fp32
    parameter under autocast), nor its gradient back. Without a bias, ``RPB`` is a stand-in
    pointer and is never read."""
    r = tl.arange(0, NREL)
    if HAS_RPB:
        n = (2 * KH - 1) * (2 * KW - 1)
        table = round_to(tl.load(RPB + h * n + r, mask=r < n, other=0.).to(tl.float32), QT)
    else:
        table = tl.zeros([NREL], tl.float32)
    return to_base2(table)


@triton.jit
def _bias(table, dy, dx, inside, KH: tl.constexpr, KW: tl.constexpr):
    """table[(dy + KH - 1, dx + KW - 1)] for key - query offsets (dy, dx) inside the window."""
    rel = tl.where(inside, (dy + KH - 1) * (2 * KW - 1) + dx + KW - 1, 0)
    M: tl.constexpr = rel.shape[0]
    N: tl.constexpr = rel.shape[1]
    return tl.reshape(tl.gather(table, tl.reshape(rel, (M * N,)), 0), (M, N))


@triton.jit
def _program(heads, H, W, DIL_Y, DIL_X, tiles_y, tiles_x, TH: tl.constexpr, TW: tl.constexpr):
    """What program ``tl.program_id(0)`` owns: its ``batch * heads`` index, batch (int64) and
    head, dilation group (gy, gx) of lengths (LY, LX), and its tile: the first position (ty0,
    tx0) and all positions (py, px) in group coordinates, their mask and source positions."""
    bh, gy, gx, ty, tx = program_tile(tl.program_id(0), tiles_y, tiles_x, DIL_Y, DIL_X)
    LY = group_length(H, gy, DIL_Y)
    LX = group_length(W, gx, DIL_X)
    py, px = tile_positions(ty, tx, TH, TW)
    return (bh, (bh // heads).to(tl.int64), bh % heads, gy, gx, LY, LX, ty * TH, tx * TW, py, px,
            (py < LY) & (px < LX), to_source(py, gy, DIL_Y), to_source(px, gx, DIL_X))


@triton.jit
def _region_block(A, B, n, y0, x0, rows, cols, gy, gx, DIL_Y, DIL_X,
                  say, sax, sac, sby, sbx, sbc, CA, CB, BCA: tl.constexpr, BCB: tl.constexpr,
                  BN: tl.constexpr):
    """Block ``n`` of the region at (y0, x0) of ``rows x cols`` positions (group coordinates):
    the positions, their mask and source positions, and the rows of the two tensors ``A`` and
    ``B`` there (keys and values, or queries and output gradients)."""
    py, px, valid = region_block(y0, x0, rows, cols, n, BN)
    sy = to_source(py, gy, DIL_Y)
    sx = to_source(px, gx, DIL_X)
    a = load_rows(A, sy, sx, say, sax, sac, valid, CA, BCA)
    b = load_rows(B, sy, sx, sby, sbx, sbc, valid, CB, BCB)
    return py, px, valid, sy, sx, a, b


@triton.jit
def _key_block(q, qy, qx, wy, wx, valid_q, K, V, n, y0, x0, rows, cols, gy, gx, DIL_Y,
               DIL_X, sky, skx, skd, svy, svx, svd, D, DV, table, qk_scale,
               KH: tl.constexpr, KW: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
               BN: tl.constexpr, HAS_RPB: tl.constexpr, PRECISION: tl.constexpr):
    """Block ``n`` of a query tile's key region (the query-centric passes): its keys and values,
    and the tile's base-2 logits ``(q.k * scale + rpb) * log2(e)`` [len(q), BN], -inf outside
    each query's window (queries at (qy, qx), windows starting at (wy, wx))."""
    ky, kx, valid_k, _, _, k, v = _region_block(K, V, n, y0, x0, rows, cols, gy, gx, DIL_Y,
                                                DIL_X, sky, skx, skd, svy, svx, svd, D, DV, BD,
                                                BDV, BN)
    inside = _in_window(wy, wx, ky, kx, valid_q, valid_k, KH, KW)
    s = dot(q, tl.trans(k), PRECISION) * qk_scale
    if HAS_RPB:
        s += _bias(table, ky[None, :] - qy[:, None], kx[None, :] - qx[:, None], inside, KH, KW)
    return k, v, tl.where(inside, s, float("-inf"))


@triton.jit
def _na_fwd_kernel(
        Q, K, V, RPB, O, LSE,
        sqb, sqy, sqx, sqh, sqd, skb, sky, skx, skh, skd, svb, svy, svx, svh, svd,
        sob, soy, sox, soh, sod,
        heads, H, W, D, DV, DIL_Y, DIL_X, tiles_y, tiles_x, qk_scale,
        KH: tl.constexpr, KW: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
        BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, HAS_RPB: tl.constexpr,
        NREL: tl.constexpr, PRECISION: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # (fp64 where Inductor launches the kernel)
    bh, b, h, gy, gx, LY, LX, ty0, tx0, qy, qx, valid_q, y, x = _program(
        heads, H, W, DIL_Y, DIL_X, tiles_y, tiles_x, TH, TW)
    q = load_rows(Q + b * sqb + h * sqh, y, x, sqy, sqx, sqd, valid_q, D, BD)
    wy = na_window_start(qy, LY, KH)
    wx = na_window_start(qx, LX, KW)
    table = _rpb_table(RPB, h, KH, KW, NREL, HAS_RPB, Q.dtype.element_ty)
    y0, rows = na_tile_region(ty0, TH, LY, KH)
    x0, cols = na_tile_region(tx0, TW, LX, KW)
    m_i = tl.full([TH * TW], -1e30, tl.float32)
    l_i = tl.zeros([TH * TW], tl.float32)
    acc = tl.zeros([TH * TW, BDV], tl.float32)
    for n in range(0, tl.cdiv(rows * cols, BN)):
        k, v, s = _key_block(q, qy, qx, wy, wx, valid_q, K + b * skb + h * skh,
                             V + b * svb + h * svh, n, y0, x0, rows, cols, gy, gx, DIL_Y, DIL_X,
                             sky, skx, skd, svy, svx, svd, D, DV, table, qk_scale, KH, KW, BD,
                             BDV, BN, HAS_RPB, PRECISION)
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, PRECISION)

    l_i = tl.where(l_i > 0, l_i, 1.)  # only padding queries of a partial tile have l = 0
    store_rows(O + b * sob + h * soh, acc / l_i[:, None], y, x, soy, sox, sod, valid_q, DV, BDV)
    tl.store(LSE + (bh.to(tl.int64) * H + y) * W + x, m_i + tl.log2(l_i), mask=valid_q)


@triton.jit
def _rpb_grad_block(ds, qy, qx, y0, x0, rows, cols, n, BN: tl.constexpr, KH: tl.constexpr,
                    KW: tl.constexpr, RY: tl.constexpr, CX: tl.constexpr, R: tl.constexpr):
    """Fold ``ds`` [BQ, BN] (block ``n`` of the ``rows x cols`` key region at (y0, x0), in
    row-major order; zero outside windows) into a [RY, CX] table indexed by relative offset
    (ky - qy + KH - 1, kx - qx + KW - 1). The block spans at most ``R`` region rows: for each
    of them, gather each query's 2KW-1 relative columns, then fold (query, row) pairs into
    relative rows with a one-hot matmul."""
    BQ: tl.constexpr = qy.shape[0]
    first = n * BN
    r0 = first // cols                                              # the block's first row
    m = tl.arange(0, R * CX)
    row = r0 + m // CX                                              # region row of each slot
    c = m % CX
    col = qx[:, None] + c[None, :] - (KW - 1) - x0                  # [BQ, R * CX]
    j = row[None, :] * cols + col - first                           # index inside the block
    ok = (col >= 0) & (col < cols) & (j >= 0) & (j < BN) & (c[None, :] < 2 * KW - 1) \
        & (row[None, :] < rows)
    w = tl.gather(ds, tl.where(ok, j, 0), 1)
    w = tl.reshape(tl.where(ok, w, 0.), (BQ * R, CX))
    i = tl.arange(0, BQ * R)
    ry = y0 + r0 + i % R - tl.reshape(tl.broadcast_to(qy[:, None], (BQ, R)), (BQ * R,)) + KH - 1
    onehot = (tl.arange(0, RY)[:, None] == ry[None, :]).to(tl.float32)
    return tl.dot(onehot, w, input_precision="ieee")


@triton.jit
def _na_bwd_dq_kernel(
        Q, K, V, RPB, O, DO, LSE, DELTA, DQ, DRPB,
        sqb, sqy, sqx, sqh, sqd, skb, sky, skx, skh, skd, svb, svy, svx, svh, svd,
        sob, soy, sox, soh, sod, sdob, sdoy, sdox, sdoh, sdod, sdqb, sdqy, sdqx, sdqh, sdqd,
        heads, H, W, D, DV, DIL_Y, DIL_X, tiles_y, tiles_x, qk_scale, scale,
        KH: tl.constexpr, KW: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
        BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, HAS_RPB: tl.constexpr,
        NREL: tl.constexpr, PRECISION: tl.constexpr, RY: tl.constexpr, CX: tl.constexpr,
        R: tl.constexpr, RPB_GRAD: tl.constexpr):
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)  # (as fwd)
    bh, b, h, gy, gx, LY, LX, ty0, tx0, qy, qx, valid_q, y, x = _program(
        heads, H, W, DIL_Y, DIL_X, tiles_y, tiles_x, TH, TW)
    q = load_rows(Q + b * sqb + h * sqh, y, x, sqy, sqx, sqd, valid_q, D, BD)
    wy = na_window_start(qy, LY, KH)
    wx = na_window_start(qx, LX, KW)
    do = load_rows(DO + b * sdob + h * sdoh, y, x, sdoy, sdox, sdod, valid_q, DV, BDV)
    o = load_rows(O + b * sob + h * soh, y, x, soy, sox, sod, valid_q, DV, BDV)
    row = (bh.to(tl.int64) * H + y) * W + x
    lse = tl.load(LSE + row, mask=valid_q, other=0.)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DELTA + row, delta, mask=valid_q)
    table = _rpb_table(RPB, h, KH, KW, NREL, HAS_RPB, Q.dtype.element_ty)
    y0, rows = na_tile_region(ty0, TH, LY, KH)
    x0, cols = na_tile_region(tx0, TW, LX, KW)
    dq = tl.zeros([TH * TW, BD], tl.float32)
    drpb = tl.zeros([RY, CX], tl.float32)
    for n in range(0, tl.cdiv(rows * cols, BN)):
        k, v, s = _key_block(q, qy, qx, wy, wx, valid_q, K + b * skb + h * skh,
                             V + b * svb + h * svh, n, y0, x0, rows, cols, gy, gx, DIL_Y, DIL_X,
                             sky, skx, skd, svy, svx, svd, D, DV, table, qk_scale, KH, KW, BD,
                             BDV, BN, HAS_RPB, PRECISION)
        p = tl.exp2(s - lse[:, None])  # exactly 0 outside the window (s = -inf)
        dp = dot(do, tl.trans(v), PRECISION)
        ds = p * (dp - delta[:, None])
        dq += dot(ds.to(k.dtype), k, PRECISION)
        if RPB_GRAD:
            drpb += _rpb_grad_block(ds, qy, qx, y0, x0, rows, cols, n, BN, KH, KW, RY, CX, R)

    store_rows(DQ + b * sdqb + h * sdqh, dq * scale, y, x, sdqy, sdqx, sdqd, valid_q, D, BD)
    if RPB_GRAD:
        r = tl.arange(0, RY)[:, None]
        c = tl.arange(0, CX)[None, :]
        table_out = DRPB + tl.program_id(0).to(tl.int64) * (2 * KH - 1) * (2 * KW - 1)
        tl.store(table_out + r * (2 * KW - 1) + c, drpb, mask=(r < 2 * KH - 1) & (c < 2 * KW - 1))


@triton.jit
def _na_bwd_dkdv_kernel(
        Q, K, V, RPB, DO, LSE, DELTA, DK, DV_, PARTIAL, DRPB,
        sqb, sqy, sqx, sqh, sqd, skb, sky, skx, skh, skd, svb, svy, svx, svh, svd,
        sdob, sdoy, sdox, sdoh, sdod, sdkb, sdky, sdkx, sdkh, sdkd, sdvb, sdvy, sdvx, sdvh, sdvd,
        heads, H, W, D, DV, DIL_Y, DIL_X, tiles_y, tiles_x, qk_scale, scale, n_tiles, batch,
        partial_rows,
        KH: tl.constexpr, KW: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
        BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, HAS_RPB: tl.constexpr,
        NREL: tl.constexpr, PRECISION: tl.constexpr, RPB_SUM: tl.constexpr):
    """Programs below ``n_tiles``: dK and dV of a tile of keys. With ``RPB_SUM``, the programs
    after them sum the dq pass's per-program rpb tables (``PARTIAL``) into ``DRPB``: the
    reduction rides this launch instead of two more (a sum, a cast); dq's launch, before this
    one on the stream, has written every table."""
    qk_scale, scale = tl.cast(qk_scale, tl.float32), tl.cast(scale, tl.float32)  # (as fwd)
    if tl.program_id(0) >= n_tiles:
        if RPB_SUM:
            sum_tables(PARTIAL, DRPB, tl.program_id(0) - n_tiles, heads, batch, partial_rows,
                       (2 * KH - 1) * (2 * KW - 1))
    else:
        _dkdv_tile(Q, K, V, RPB, DO, LSE, DELTA, DK, DV_, sqb, sqy, sqx, sqh, sqd, skb, sky, skx,
                   skh, skd, svb, svy, svx, svh, svd, sdob, sdoy, sdox, sdoh, sdod, sdkb, sdky,
                   sdkx, sdkh, sdkd, sdvb, sdvy, sdvx, sdvh, sdvd, heads, H, W, D, DV, DIL_Y,
                   DIL_X, tiles_y, tiles_x, qk_scale, scale, KH, KW, TH, TW, BN, BD, BDV,
                   HAS_RPB, NREL, PRECISION)


@triton.jit
def _dkdv_tile(
        Q, K, V, RPB, DO, LSE, DELTA, DK, DV_,
        sqb, sqy, sqx, sqh, sqd, skb, sky, skx, skh, skd, svb, svy, svx, svh, svd,
        sdob, sdoy, sdox, sdoh, sdod, sdkb, sdky, sdkx, sdkh, sdkd, sdvb, sdvy, sdvx, sdvh, sdvd,
        heads, H, W, D, DV, DIL_Y, DIL_X, tiles_y, tiles_x, qk_scale, scale,
        KH: tl.constexpr, KW: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
        BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, HAS_RPB: tl.constexpr,
        NREL: tl.constexpr, PRECISION: tl.constexpr):
    bh, b, h, gy, gx, LY, LX, ty0, tx0, ky, kx, valid_k, y, x = _program(
        heads, H, W, DIL_Y, DIL_X, tiles_y, tiles_x, TH, TW)
    rows_base = bh.to(tl.int64) * H  # this (batch, head)'s first row in LSE and DELTA
    k = load_rows(K + b * skb + h * skh, y, x, sky, skx, skd, valid_k, D, BD)
    v = load_rows(V + b * svb + h * svh, y, x, svy, svx, svd, valid_k, DV, BDV)
    table = _rpb_table(RPB, h, KH, KW, NREL, HAS_RPB, Q.dtype.element_ty)

    y0, rows = na_query_region(ty0, TH, LY, KH)
    x0, cols = na_query_region(tx0, TW, LX, KW)
    dk = tl.zeros([TH * TW, BD], tl.float32)
    dv = tl.zeros([TH * TW, BDV], tl.float32)
    for n in range(0, tl.cdiv(rows * cols, BN)):
        qy, qx, valid_q, sy, sx, q, do = _region_block(
            Q + b * sqb + h * sqh, DO + b * sdob + h * sdoh, n, y0, x0, rows, cols, gy, gx,
            DIL_Y, DIL_X, sqy, sqx, sqd, sdoy, sdox, sdod, D, DV, BD, BDV, BN)
        row = (rows_base + sy) * W + sx
        lse = tl.load(LSE + row, mask=valid_q, other=0.)
        delta = tl.load(DELTA + row, mask=valid_q, other=0.)
        # transposed problem: rows are this tile's keys, columns the streamed queries
        wy = na_window_start(qy, LY, KH)
        wx = na_window_start(qx, LX, KW)
        inside = ((ky[:, None] >= wy[None, :]) & (ky[:, None] < wy[None, :] + KH)
                  & (kx[:, None] >= wx[None, :]) & (kx[:, None] < wx[None, :] + KW)
                  & valid_q[None, :] & valid_k[:, None])
        st = dot(k, tl.trans(q), PRECISION) * qk_scale
        if HAS_RPB:
            st += _bias(table, ky[:, None] - qy[None, :], kx[:, None] - qx[None, :], inside, KH,
                        KW)
        pt = tl.where(inside, tl.exp2(st - lse[None, :]), 0.)
        dv += dot(pt.to(do.dtype), do, PRECISION)
        dpt = dot(v, tl.trans(do), PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk += dot(dst.to(q.dtype), q, PRECISION)

    store_rows(DK + b * sdkb + h * sdkh, dk * scale, y, x, sdky, sdkx, sdkd, valid_k, D, BD)
    store_rows(DV_ + b * sdvb + h * sdvh, dv, y, x, sdvy, sdvx, sdvd, valid_k, DV, BDV)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------

LIMITS = KernelLimits("attnzoo's Triton NA kernels", DTYPES, MAX_HEAD_DIM)

KERNELS = ("fwd", "dq", "dkdv")  # forward; backward: dQ (+ rpb), then dK and dV
# The autotune space of a launch: a default and one alternative along each of its dimensions,
# tile (the tiling of next least work, if within TUNE_SLACK of the least), warps and stages.
# Pieces of a tile x block hold at most MAX_LOGITS logits in fp16 / bf16, half in TF32 and a
# quarter in exact fp32 (tl.dot on CUDA cores): larger ones spill registers, as do 2 warps
# except on 16-bit pieces of 256 logits (scripts/compile_kernels.py).
STAGES = (2, 1)
SMALL_SHARED = 128 << 10  # under it: sm86 / sm89 (99 KiB per block); A100 163, H100 227
LARGE_SHARED = 200 << 10  # between the two: sm80 (A100, 163 KiB); above: sm90 (H100, 227)
TUNE_SLACK = 1.1
MAX_LOGITS = 1024


def _warps(tiling: Tiling, row_bytes: int, exact_fp32: bool) -> Tuple[int, int]:
    small = tiling.TH * tiling.TW * tiling.BN <= 256 and row_bytes <= 256 and not exact_fp32
    return (4, 2) if small else (4, 8)


class Config(NamedTuple):
    """One launch configuration of a kernel."""
    tiling: Tiling
    num_warps: int
    num_stages: int


def shared_memory(kernel: str, config: Config, head_dims: Tuple[int, int], dtype: torch.dtype,
                  kernel_size: Tuple[int, int]) -> int:
    """Bytes of shared memory per block, at most, that ``kernel`` ("fwd", "dq", "dkdv") takes
    in ``config``: what Triton stages there (the streamed blocks, ``num_stages`` deep, the
    tile's operands, the layout conversions of the logits; for dq the rpb gradient's one-hot
    fold), bounded from above. scripts/compile_kernels.py checks the bound against every
    compiled launch."""
    t = config.tiling
    BD, BDV = pow2(head_dims[0]), pow2(head_dims[1])
    M, N = t.TH * t.TW, t.BN
    size = dtype.itemsize
    total = (N * (BD + BDV) * size * (config.num_stages + 1)     # streamed blocks
             + M * (BD + BDV) * size                               # the tile's rows
             + 2 * M * N * 4)                                      # logits, probabilities
    if kernel == "dq":
        RY, CX = pow2(2 * kernel_size[0] - 1), pow2(2 * kernel_size[1] - 1)
        total += (RY + CX) * M * _rows_per_block(t, kernel_size) * 4 + M * max(BD, BDV) * 4
    return total


def _rows_per_block(tiling: Tiling, kernel_size: Tuple[int, int]) -> int:
    """Region rows a block can touch (the rpb gradient's ``R``): a region is at least KW wide."""
    KH, KW = kernel_size
    return pow2(min(-(-(tiling.BN - 1) // KW) + 1, tiling.TH + KH - 1), 1)


def configs(kernel: str, spatial: Tuple[int, int], kernel_size: Tuple[int, int],
            dilation: Tuple[int, int], head_dims: Tuple[int, int], dtype: torch.dtype,
            shared_limit: Optional[int] = None) -> List[Config]:
    """The autotune space of one launch of ``kernel``, its default first: the tiling of least
    work (:func:`~.tiling.rank_tilings`; tiles of at most 32 positions where a q row and a v
    row take more than 512 bytes, which otherwise spill) at 4 warps and 2 stages, then the
    same with the other warps, with 1 stage, and the tiling of next least work if within
    ``TUNE_SLACK``; those whose shared memory fits ``shared_limit`` (bytes per block; ``None``:
    no limit). fp32 follows the precision torch allows now (:func:`~.tiling.dot_precision`)."""
    exact_fp32 = dot_precision(dtype, interpreted=False) == "ieee"
    return _configs(kernel, spatial, kernel_size, dilation, head_dims, dtype, exact_fp32,
                    shared_limit)


@functools.lru_cache(maxsize=1024)
def _configs(kernel, spatial, kernel_size, dilation, head_dims, dtype, exact_fp32,
             shared_limit) -> List[Config]:
    row_bytes = (pow2(head_dims[0]) + pow2(head_dims[1])) * dtype.itemsize
    max_tile = 32 if row_bytes > 512 else 64
    max_logits = MAX_LOGITS // (4 if exact_fp32 else 2 if dtype.itemsize > 2 else 1)

    def fits(config: Config) -> bool:
        return shared_limit is None or shared_memory(kernel, config, head_dims, dtype,
                                                     kernel_size) <= shared_limit

    ranked = [(work, t) for work, t in rank_tilings(spatial, kernel_size, dilation,
                                                    kernel == "dkdv", max_tile, max_logits)
              if fits(Config(t, 4, 1))]
    if not ranked:  # the support check refuses such calls
        return []
    (least, best), rest = ranked[0], ranked[1:2]
    warps = _warps(best, row_bytes, exact_fp32)
    stages = STAGES
    # Where ptxas spills the 2-stage default and not the 1-stage one (scripts/compile_kernels.py),
    # the untuned default takes 1 stage (the autotuner tries both): the dK/dV kernel on sm86 /
    # sm89 (8 B) and on sm90 with fp32 inputs (Triton 3.8: 4 B at K 11, dilated), and with
    # Triton 3.6 the dQ kernel of 16-bit inputs on sm80 (4 B, 8x8 tiles).
    if shared_limit is not None and (
            kernel == "dkdv" and (shared_limit < SMALL_SHARED
                                  or shared_limit >= LARGE_SHARED and dtype.itemsize == 4)
            or kernel == "dq" and dtype.itemsize == 2
            and SMALL_SHARED <= shared_limit < LARGE_SHARED):
        stages = STAGES[::-1]
    space = [Config(best, warps[0], stages[0]), Config(best, warps[1], STAGES[0]),
             Config(best, warps[0], stages[1])]
    space += [Config(t, _warps(t, row_bytes, exact_fp32)[0], STAGES[0]) for work, t in rest
              if work <= TUNE_SLACK * least]
    return [c for c in space if fits(c)]


def _least_shared_memory(head_dims, dtype, kernel_size, backward: bool) -> int:
    """Shared memory of the smallest configuration of the kernels a call runs."""
    smallest = Config(Tiling(1, 16, 16), 4, min(STAGES))
    return max(shared_memory(k, smallest, head_dims, dtype, kernel_size)
               for k in (KERNELS if backward else KERNELS[:1]))


def not_supported_reasons(device: str, dtype: torch.dtype, head_dim: int, v_dim: int,
                          kernel_size: Tuple[int, ...], backward: bool = True) -> List[str]:
    """Every reason these kernels cannot run such a call on ``device`` ("cuda:1", "cpu", ...;
    the device's own capability and shared memory), empty if none."""
    ks = (1,) * (2 - len(kernel_size)) + tuple(kernel_size)
    reasons = LIMITS.reasons(device, dtype, (head_dim, v_dim),
                             _least_shared_memory((head_dim, v_dim), dtype, ks, backward))
    return reasons + _kernel_size_reasons(kernel_size)


def call_reasons(dtype: torch.dtype, head_dim: int, v_dim: int,
                 kernel_size: Tuple[int, ...]) -> List[str]:
    """The reasons of :func:`not_supported_reasons` that the call alone decides, on any
    machine (dtype, head dims, kernel size), empty if none."""
    return LIMITS.call_reasons(dtype, (head_dim, v_dim)) + _kernel_size_reasons(kernel_size)


def _kernel_size_reasons(kernel_size: Tuple[int, ...]) -> List[str]:
    if any(K > MAX_KERNEL_SIZE for K in kernel_size):
        return [f"{LIMITS.name} support kernel sizes up to {MAX_KERNEL_SIZE}, got "
                f"{tuple(kernel_size)}"]
    return []


def support(device: str, dtype: torch.dtype, head_dim: int, v_dim: int,
            kernel_size: Tuple[int, ...], backward: bool = True) -> Optional[str]:
    """``None`` if these kernels can run such a call, else every reason why not."""
    return "; ".join(not_supported_reasons(device, dtype, head_dim, v_dim, kernel_size,
                                           backward)) or None


_TUNER = Autotuner(store=TuningStore())


# The one launch point of these kernels (tests observe launches here): kernels.launch_on_device,
# which also captures them for scripts/compile_kernels.py.
_run = launch_on_device


class _Plan(NamedTuple):
    """A call key's launch of one kernel, computed once per key (``_PLANS``: the host code's
    per-call work is the key's lookup). The kernel's arguments after its tensors and strides
    are positional, a call's own values between them (``geometry, scales[, ...], constants[,
    flag]``): ~25 keywords cost some 2 us a launch to pass, here and in Triton's launcher."""
    grid: tuple
    config: Config
    geometry: tuple    # heads .. tiles_x
    constants: tuple   # KH .. the kernel's constexprs, but for a per-call flag passed last
    options: dict      # num_warps, num_stages


class _Allocations(NamedTuple):
    """A call key's tensors (:func:`~attnzoo.kernels.allocation`), contiguous: the outputs o
    and lse (:func:`_output_shapes`; delta is lse's like), q's and v's gradients, the packed
    qkv's, the rpb's (None without an rpb) and an empty stand-in per dtype (``empty``: q's,
    ``empty32``: float32). As :func:`_forward_outputs` and :func:`_backward_outputs` make
    them for a trace."""
    o: Allocation
    lse: Allocation
    q: Allocation
    v: Allocation
    qkv: Allocation
    rpb: Optional[Allocation]
    empty: Allocation
    empty32: Allocation


def _allocations(q: torch.Tensor, v: torch.Tensor, rpb: Optional[torch.Tensor]) -> _Allocations:
    B, H, W, heads, D = q.shape
    o, lse = _output_shapes(q.shape, v.shape[-1])
    return _Allocations(*(allocation(shape, dtype, q.device) for shape, dtype in (
        (o, q.dtype), (lse, torch.float32), (q.shape, q.dtype), (v.shape, q.dtype),
        ((B, H, W, 3, heads, D), q.dtype))),
        None if rpb is None else allocation(rpb.shape, rpb.dtype, q.device),
        allocation((0,), q.dtype, q.device), allocation((0,), torch.float32, q.device))


class _CallPlans(dict):
    """A call key's plans by kernel ("fwd", "dq", "dkdv"), filled in by :func:`_launch`, and
    ``alloc``, its tensors' :class:`_Allocations`."""
    __slots__ = ("alloc",)


# The call keys' plans: looked up once per call, in its forward (:func:`_call_plans`), whose
# autograd context hands them to the backward.
_PLANS: Dict[tuple, _CallPlans] = {}
_KERNELS = {"fwd": _na_fwd_kernel, "dq": _na_bwd_dq_kernel, "dkdv": _na_bwd_dkdv_kernel}


def _call_plans(q: torch.Tensor, v: torch.Tensor, kernel_size, dilation,
                rpb: Optional[torch.Tensor], config: Optional[Config]) -> _CallPlans:
    """The plans of this call's key (shape, head dims, kernel size, dilation, dtype, precision,
    the bias's dtype, device, forced config, deterministic mode), filled in by
    :func:`_launch`."""
    key = (q.shape, v.shape[-1], kernel_size, dilation, q.dtype,
           dot_precision(q.dtype, tiling.INTERPRETED), None if rpb is None else rpb.dtype,
           q.device, config, torch.are_deterministic_algorithms_enabled())
    plans = _PLANS.get(key)
    if plans is None:
        plans = _PLANS[key] = _CallPlans()
        plans.alloc = _allocations(q, v, rpb)
    return plans


def _launch(kernel: str, plans: _CallPlans, q: torch.Tensor, v: torch.Tensor,
            kernel_size, dilation, has_rpb: bool, config: Optional[Config],
            run: Callable[..., Any]) -> None:
    """Launch ``kernel`` for this call: ``run(plan, warmup)`` with its :class:`_Plan` from
    ``plans`` (:func:`_call_plans`). ``config`` forces one; else the autotuner's choice among
    :func:`configs` for this shape, kernel size, dilation, head dims, dtype, precision and
    device."""
    plan = plans.get(kernel)
    if plan is None:
        plan = _plan(kernel, plans, q, v, kernel_size, dilation, has_rpb, config, run)
    run(plan, False)


def _plan(kernel, plans, q, v, kernel_size, dilation, has_rpb, config, run) -> _Plan:
    """The launch plan of a call key (:func:`_launch`), kept in ``plans`` once final: a forced
    configuration, a tuned one, or the default where no timing will ever take place."""
    B, H, W, heads, D = q.shape
    precision = dot_precision(q.dtype, tiling.INTERPRETED)
    KH, KW = kernel_size

    def plan_of(config: Config) -> _Plan:
        t = config.tiling
        if not (t.TH * t.TW >= 16 and t.BN >= 16 and all(n & (n - 1) == 0 for n in t)):
            raise ValueError(f"{t}: tiles and blocks must be powers of two of >= 16 positions")
        tiles_y, tiles_x = grid_tiles((H, W), dilation, (t.TH, t.TW))
        args = dict(heads=heads, H=H, W=W, D=D, DV=v.shape[-1], DIL_Y=dilation[0],
                    DIL_X=dilation[1], tiles_y=tiles_y, tiles_x=tiles_x, KH=KH, KW=KW,
                    TH=t.TH, TW=t.TW, BN=t.BN, BD=pow2(D), BDV=pow2(v.shape[-1]),
                    HAS_RPB=has_rpb, NREL=pow2((2 * KH - 1) * (2 * KW - 1), 1) if has_rpb else 1,
                    PRECISION=precision)
        if kernel == "dq":  # the rpb gradient's fold (see _na_bwd_dq_kernel)
            args.update(RY=pow2(2 * KH - 1), CX=pow2(2 * KW - 1),
                        R=_rows_per_block(t, kernel_size))
        names = _KERNELS[kernel].arg_names
        constants = names[names.index("KH"):]
        if constants[-1] not in args:  # the backward's flag: the call's, passed last
            constants = constants[:-1]
        return _Plan((B * heads * dilation[0] * dilation[1] * tiles_y * tiles_x,), config,
                     tuple(args[n] for n in names[names.index("heads"):names.index("qk_scale")]),
                     tuple(args[n] for n in constants),
                     dict(num_warps=config.num_warps, num_stages=config.num_stages))

    final = config is not None
    if config is None:
        compiled = q.is_cuda and not tiling.INTERPRETED
        limit = device_info(str(q.device)).shared_memory if compiled else None
        space = configs(kernel, (H, W), kernel_size, dilation, (D, v.shape[-1]), q.dtype, limit)
        tune_key = (kernel, (H, W), kernel_size, dilation, D, v.shape[-1], q.dtype, precision,
                    has_rpb, str(q.device))
        tune = not traced(q) and can_tune(q.device)
        config = _TUNER.choose(tune_key, space,
                               lambda c, warmup=False: run(plan_of(c), warmup), tune,
                               tuning_scope(q.device) if tune else "", device=q.device)
        # untuned where a later call may tune (while tracing or capturing a CUDA graph): not final
        final = tune or tune_key in _TUNER.best or not will_tune(q.device)
    plan = plan_of(config)
    if final:
        plans[kernel] = plan
    return plan


# What each pass returns, as a trace is told (the custom ops' fake implementations): the very
# sizes, strides and dtypes that the host code's allocations (_Allocations) give the kernels,
# every output contiguous, whatever the inputs' strides.

def _output_shapes(shape, dv) -> tuple:
    """o's shape ``[B, H, W, heads, dv]`` and the log-sum-exp's ``[B, heads, H, W]``, of a call
    on q of ``shape`` (sizes symbolic in a trace)."""
    B, H, W, heads, _ = shape
    return (B, H, W, heads, dv), (B, heads, H, W)


def _forward_outputs(q, shapes):
    """o in q's dtype and the log-sum-exp in float32, of ``shapes`` (:func:`_output_shapes`)."""
    return q.new_empty(shapes[0]), q.new_empty(shapes[1], dtype=torch.float32)


def _backward_outputs(q, k, v, rpb, rpb_grad: bool, kv_grad: bool, dqkv=None):
    """dq, dk, dv and the rpb gradient in their inputs' dtypes (the rpb's summed in float32);
    an empty tensor stands for a gradient not computed (a custom op returns no None).
    ``dqkv``: the packed input's gradient (:class:`_NAPacked`), whose views dq, dk, dv are."""
    drpb = (torch.empty_like(rpb, memory_format=torch.contiguous_format) if rpb_grad else
            q.new_empty(0, dtype=torch.float32))
    if dqkv is not None:
        return (*dqkv.unbind(3), drpb)
    return (q.new_empty(q.shape), k.new_empty(k.shape if kv_grad else 0),
            v.new_empty(v.shape if kv_grad else 0), drpb)


def _forward(q, k, v, rpb, kernel_size, dilation, scale, config=None):
    """o and lse, and the call's plans (:func:`_call_plans`, for its backward)."""
    plans = _call_plans(q, v, kernel_size, dilation, rpb, config)
    o, lse = plans.alloc.o(), plans.alloc.lse()
    _launch("fwd", plans, q, v, kernel_size, dilation, rpb is not None, config,
            lambda plan, warmup: _run(
                _na_fwd_kernel, plan.grid, q, k, v, q if rpb is None else rpb, o, lse,
                *q.stride(), *k.stride(), *v.stride(), *o.stride(), *plan.geometry,
                scale * LOG2E, *plan.constants, warmup=warmup, **plan.options))
    return o, lse, plans


def _backward(do, q, k, v, rpb, o, lse, kernel_size, dilation, scale, need_rpb_grad,
              need_kv_grad, config=None, dqkv=None, plans=None):
    """dq, dk, dv and the rpb gradient (:func:`_backward_outputs`); ``plans``: the forward's
    (:func:`_forward`), or None."""
    do = narrow_offsets(do)
    if plans is None:
        plans = _call_plans(q, v, kernel_size, dilation, rpb, config)
    KH, KW = kernel_size
    B, heads = q.shape[0], q.shape[3]
    alloc = plans.alloc  # as _backward_outputs
    if dqkv is not None:
        dq, dk, dv = dqkv.unbind(3)
    else:
        dq = alloc.q()
        dk, dv = (alloc.q(), alloc.v()) if need_kv_grad else (alloc.empty(), alloc.empty())
    drpb = alloc.rpb() if need_rpb_grad else alloc.empty32()
    n_rel = (2 * KH - 1) * (2 * KW - 1)
    rpb_arg = q if rpb is None else rpb  # a stand-in pointer, never read (HAS_RPB=False)
    # rowsum(dO * O), laid out as lse: the kernels index both flat
    delta = alloc.lse()
    # with need_rpb_grad, one rpb-gradient table per program of the dq launch (its plan's);
    # else a stand-in pointer, never written (RPB_GRAD=False)
    tables = [delta]

    def run_dq(plan, warmup):
        if need_rpb_grad:
            tables[0] = torch.empty(plan.grid[0] * n_rel, device=q.device, dtype=torch.float32)
        return _run(_na_bwd_dq_kernel, plan.grid, q, k, v, rpb_arg, o, do, lse, delta, dq,
                    tables[0], *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                    *do.stride(), *dq.stride(), *plan.geometry, scale * LOG2E, scale,
                    *plan.constants, need_rpb_grad, warmup=warmup, **plan.options)

    _launch("dq", plans, q, v, kernel_size, dilation, rpb is not None, config, run_dq)
    partial = tables[0]
    if need_kv_grad:  # after dq, which writes delta and the rpb tables
        sums = sum_programs(heads, n_rel) if need_rpb_grad else 0  # their programs
        partial_rows = partial.numel() // (B * heads * n_rel)

        def run_dkdv(plan, warmup):
            tiles = plan.grid[0]
            return _run(_na_bwd_dkdv_kernel, (tiles + sums,), q, k, v, rpb_arg, do, lse,
                        delta, dk, dv, partial, drpb if need_rpb_grad else partial, *q.stride(),
                        *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
                        *plan.geometry, scale * LOG2E, scale, tiles, B, partial_rows,
                        *plan.constants, need_rpb_grad, warmup=warmup, **plan.options)

        _launch("dkdv", plans, q, v, kernel_size, dilation, rpb is not None, config,
                run_dkdv)
    elif need_rpb_grad:  # k and v frozen: torch sums the tables
        drpb.view(heads, n_rel).copy_(partial.view(B, heads, -1, n_rel).sum((0, 2)))
    return dq, dk, dv, drpb


# The passes as custom ops (kernels.kernel_op: a compiled model never traces the autotuner, the
# device query or the launch). ``config``: a Config as 5 ints (tiling, warps, stages) forcing
# every kernel's, or empty (the autotuner's choice).

def _na_impl(q, k, v, rpb, kernel_size, dilation, scale, config):
    return _forward(q, k, v, rpb, tuple(kernel_size), tuple(dilation), scale,
                    _config(config))[:2]


_na_op = kernel_op(
    "na_fused", _na_impl,
    "(Tensor q, Tensor k, Tensor v, Tensor? rpb, int[] kernel_size, int[] dilation, float scale, "
    "int[] config) -> (Tensor, Tensor)",
    lambda q, k, v, *_: _forward_outputs(q, _output_shapes(q.shape, v.shape[-1])), tuned=True)


def _na_backward_impl(do, q, k, v, rpb, o, lse, kernel_size, dilation, scale, rpb_grad,
                      kv_grad, config):
    return _backward(do, q, k, v, rpb, o, lse, tuple(kernel_size), tuple(dilation), scale,
                     rpb_grad, kv_grad, _config(config))


_na_backward_op = kernel_op(
    "na_fused_backward", _na_backward_impl,
    "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor? rpb, Tensor o, Tensor lse, "
    "int[] kernel_size, int[] dilation, float scale, bool rpb_grad, bool kv_grad, int[] config) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    lambda do, q, k, v, rpb, o, lse, kernel_size, dilation, scale, rpb_grad, kv_grad, config:
    _backward_outputs(q, k, v, rpb, rpb_grad, kv_grad), tuned=True)


def _config(ints) -> Optional[Config]:
    return Config(Tiling(*ints[:3]), *ints[3:]) if ints else None


def _grads(do, saved, needs, args, config, plans=None):
    """The inputs' gradients (q, k, v, rpb; None where not needed) from the forward's saved
    tensors (q, k, v, rpb, o, lse) and ``needs``: ``ctx.needs_input_grad``."""
    q, k, v, rpb, o, lse = saved
    rpb_grad, kv_grad = rpb is not None and needs[3], needs[1] or needs[2]
    if eager(do):
        dq, dk, dv, drpb = _backward(do, q, k, v, rpb, o, lse, *args, rpb_grad, kv_grad,
                                     _config(config), plans=plans)
    else:  # traced: the op
        dq, dk, dv, drpb = _na_backward_op(do, q, k, v, rpb, o, lse, *args, rpb_grad, kv_grad,
                                           config)
    return (dq, dk if kv_grad else None, dv if kv_grad else None,
            drpb if rpb_grad else None)


def _setup_context(ctx, inputs, output):
    q, k, v, rpb, kernel_size, dilation, scale, config = inputs
    ctx.save_for_backward(q, k, v, rpb, *output)
    ctx.args = (tuple(kernel_size), tuple(dilation), scale)
    ctx.config = config


def _autograd_backward(ctx, do, _):
    return _grads(do, ctx.saved_tensors, ctx.needs_input_grad, ctx.args, ctx.config) + (
        None,) * 4


_na_op.register_autograd(_autograd_backward, setup_context=_setup_context)


class _NA(torch.autograd.Function):
    """The eager path (:func:`~attnzoo.kernels.eager`): the host code called directly, without
    the custom op's dispatch (some 20 us a call each way)."""

    @staticmethod
    def forward(ctx, q, k, v, rpb, kernel_size, dilation, scale, config):
        o, lse, ctx.plans = _forward(q, k, v, rpb, kernel_size, dilation, scale,
                                     _config(config))
        ctx.save_for_backward(q, k, v, rpb, o, lse)
        ctx.args, ctx.config = (kernel_size, dilation, scale), config
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        return _grads(do, ctx.saved_tensors, ctx.needs_input_grad, ctx.args, ctx.config,
                      ctx.plans) + (None,) * 4


class _NAPacked(torch.autograd.Function):
    """:class:`_NA` on q, k and v packed in one input ``[B, H, W, 3, heads, d]`` (``na2d_qkv``),
    whose gradient is one allocation that dq, dk and dv are written into: three inputs'
    gradients would be copied into one by ``unbind``'s backward. ``views``: qkv's q, k and v,
    as the public op unbound them (kept for the backward: views of the saved qkv, whose
    version counter they share, so that an in-place change of qkv still raises)."""

    @staticmethod
    def forward(ctx, qkv, rpb, views, kernel_size, dilation, scale, config):
        o, lse, ctx.plans = _forward(*views, rpb, kernel_size, dilation, scale,
                                     _config(config))
        ctx.save_for_backward(qkv, rpb, o, lse)
        ctx.views, ctx.args, ctx.config = views, (kernel_size, dilation, scale), config
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        qkv, rpb, o, lse = ctx.saved_tensors
        grad_qkv, grad_rpb = ctx.needs_input_grad[:2]
        dqkv = ctx.plans.alloc.qkv() if grad_qkv else None
        rpb_grad = rpb is not None and grad_rpb
        _, _, _, drpb = _backward(do, *ctx.views, rpb, o, lse, *ctx.args, rpb_grad,
                                  grad_qkv, _config(ctx.config), dqkv, ctx.plans)
        return dqkv, drpb if rpb_grad else None, None, None, None, None, None


def na_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: Tuple[int, ...],
             dilation: Tuple[int, ...], rpb: Optional[torch.Tensor], scale: float,
             config: Optional[Config] = None, qkv: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``cuda`` backend of ``na1d`` / ``na2d``: arguments as
    :func:`attnzoo.ops.neighborhood.na_reference` (already validated); ``config`` a
    :class:`Config` forcing every kernel's, or ``None`` (the autotuner's choice among
    :func:`configs`). The bias is rounded to q's dtype, as the reference casts it, by the
    kernels (no cast here; its gradient comes back in its own dtype). ``qkv``: the packed
    tensor whose ``unbind(-3)`` q, k and v are (``na2d_qkv``): an eager call that needs
    gradients then takes it as its one input (:class:`_NAPacked`)."""
    if rpb is not None:
        rpb = rpb.contiguous()
    ints = [] if config is None else [*config.tiling, config.num_warps, config.num_stages]
    one_d = len(kernel_size) == 1  # 1-D is 2-D with H = 1
    if one_d:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        qkv = None if qkv is None else qkv.unsqueeze(1)
        rpb = None if rpb is None else rpb.unsqueeze(1)
        kernel_size, dilation = (1, *kernel_size), (1, *dilation)
    if eager(q):
        args = (tuple(kernel_size), tuple(dilation), float(scale))
        if forward_ad._current_level >= 0 or torch.is_grad_enabled() and (
                q.requires_grad or k.requires_grad or v.requires_grad
                or rpb is not None and rpb.requires_grad):  # (forward AD: the Function refuses)
            out = (_NA.apply(q, k, v, rpb, *args, ints) if qkv is None else
                   _NAPacked.apply(qkv, rpb, (q, k, v), *args, ints))
        else:  # nothing to save for a backward
            out = _forward(q, k, v, rpb, *args, _config(ints))[0]
    else:
        out, _ = _na_op(q, k, v, rpb, list(kernel_size), list(dilation), float(scale), ints)
    return out.squeeze(1) if one_d else out
