"""Fused neighborhood attention (NA / dilated NA, 1-D and 2-D, optional RPB) in Triton.

Semantics are those of :func:`attnzoo.ops.neighborhood.na_reference` (clamped windows per
dilation group, ``q`` scaled, ``rpb`` added unscaled). Layout heads-last ``[B, H, W, heads, d]``
with any strides; 1-D runs as 2-D with ``H = 1``.

Forward (one program per tile of queries, see :mod:`.tiling`): streams the tile's key region in
blocks with an online softmax in base 2, fp32 accumulation, and saves the log-sum-exp.
Backward, FlashAttention-2 style, recomputing the probabilities from the log-sum-exp:

* query-centric pass: ``delta = rowsum(dO * O)``, ``dQ``, and the rpb gradient. Each block's
  ``dS`` is gathered by relative x-offset (``tl.gather``), then folded into relative rows with a
  one-hot ``tl.dot``, so a program reduces its whole tile into one ``(2K-1)^2`` table in
  registers and writes it once; the tables of all programs are summed afterwards
  (deterministic, no contended atomics);
* key-centric pass: a tile of keys streams the queries whose (clamped) windows reach it and
  accumulates ``dK`` and ``dV`` in registers: overlapping windows need no atomics.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from . import interpreter_enabled
from .tiling import (LOG2E, Tiling, block_positions, block_shape, dot, grid_tiles,
                     group_length, load_rows, na_query_region, na_tile_region, na_window_start,
                     online_softmax_step, pow2, program_tile, store_rows, tile_positions,
                     to_source)

__all__ = ["NeighborhoodAttention", "na_fused", "support", "default_tiling", "capture_launches",
           "INTERPRETED", "MAX_KERNEL_SIZE", "MAX_HEAD_DIM", "DTYPES"]

MAX_KERNEL_SIZE = 13
MAX_HEAD_DIM = 128
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
def _rpb_table(RPB, h, KH: tl.constexpr, KW: tl.constexpr, NREL: tl.constexpr):
    """Head ``h``'s bias table, flat and padded to ``NREL`` (a power of two), times log2(e):
    held in registers and indexed with tl.gather, not re-read from memory per block (a global
    gather per logit doubled the forward's registers)."""
    n = (2 * KH - 1) * (2 * KW - 1)
    r = tl.arange(0, NREL)
    table = tl.load(RPB + h * n + r, mask=r < n, other=0.)
    return table.to(tl.float32) * 1.4426950408889634


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
def _region_block(A, B, n, y0, x0, rows, cols, n_cols, gy, gx, DIL_Y, DIL_X,
                  say, sax, sac, sby, sbx, sbc, CA, CB, BCA: tl.constexpr, BCB: tl.constexpr,
                  ROWS: tl.constexpr, COLS: tl.constexpr):
    """Block ``n`` of the region at (y0, x0) of ``rows x cols`` positions (group coordinates):
    the positions, their mask and source positions, and the rows of the two tensors ``A`` and
    ``B`` there (keys and values, or queries and output gradients)."""
    py, px = block_positions(y0, x0, n, n_cols, ROWS, COLS)
    valid = (py < y0 + rows) & (px < x0 + cols)
    sy = to_source(py, gy, DIL_Y)
    sx = to_source(px, gx, DIL_X)
    a = load_rows(A, sy, sx, say, sax, sac, valid, CA, BCA)
    b = load_rows(B, sy, sx, sby, sbx, sbc, valid, CB, BCB)
    return py, px, valid, sy, sx, a, b


@triton.jit
def _key_block(q, qy, qx, wy, wx, valid_q, K, V, n, y0, x0, rows, cols, n_cols, gy, gx, DIL_Y,
               DIL_X, sky, skx, skd, svy, svx, svd, D, DV, table, qk_scale,
               KH: tl.constexpr, KW: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
               ROWS: tl.constexpr, COLS: tl.constexpr, HAS_RPB: tl.constexpr,
               PRECISION: tl.constexpr):
    """Block ``n`` of a query tile's key region (the query-centric passes): its keys and values,
    and the tile's base-2 logits ``(q.k * scale + rpb) * log2(e)`` [len(q), len(k)], -inf
    outside each query's window (queries at (qy, qx), windows starting at (wy, wx))."""
    ky, kx, valid_k, _, _, k, v = _region_block(K, V, n, y0, x0, rows, cols, n_cols, gy, gx,
                                                DIL_Y, DIL_X, sky, skx, skd, svy, svx, svd, D,
                                                DV, BD, BDV, ROWS, COLS)
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
        ROWS: tl.constexpr, COLS: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
        HAS_RPB: tl.constexpr, NREL: tl.constexpr, PRECISION: tl.constexpr):
    bh, b, h, gy, gx, LY, LX, ty0, tx0, qy, qx, valid_q, y, x = _program(
        heads, H, W, DIL_Y, DIL_X, tiles_y, tiles_x, TH, TW)
    q = load_rows(Q + b * sqb + h * sqh, y, x, sqy, sqx, sqd, valid_q, D, BD)
    wy = na_window_start(qy, LY, KH)
    wx = na_window_start(qx, LX, KW)
    table = _rpb_table(RPB, h, KH, KW, NREL)
    y0, rows = na_tile_region(ty0, TH, LY, KH)
    x0, cols = na_tile_region(tx0, TW, LX, KW)
    n_cols = tl.cdiv(cols, COLS)
    m_i = tl.full([TH * TW], -1e30, tl.float32)
    l_i = tl.zeros([TH * TW], tl.float32)
    acc = tl.zeros([TH * TW, BDV], tl.float32)
    for n in range(0, tl.cdiv(rows, ROWS) * n_cols):
        k, v, s = _key_block(q, qy, qx, wy, wx, valid_q, K + b * skb + h * skh,
                             V + b * svb + h * svh, n, y0, x0, rows, cols, n_cols, gy, gx, DIL_Y,
                             DIL_X, sky, skx, skd, svy, svx, svd, D, DV, table, qk_scale, KH, KW,
                             BD, BDV, ROWS, COLS, HAS_RPB, PRECISION)
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, v, PRECISION)

    l_i = tl.where(l_i > 0, l_i, 1.)  # only padding queries of a partial tile have l = 0
    store_rows(O + b * sob + h * soh, acc / l_i[:, None], y, x, soy, sox, sod, valid_q, DV, BDV)
    tl.store(LSE + (bh.to(tl.int64) * H + y) * W + x, m_i + tl.log2(l_i), mask=valid_q)


@triton.jit
def _rpb_grad_block(ds, qy, qx, yb, xb, ROWS: tl.constexpr, COLS: tl.constexpr,
                    KH: tl.constexpr, KW: tl.constexpr, RY: tl.constexpr, CX: tl.constexpr):
    """Fold ``ds`` [BQ, ROWS * COLS] (block rows yb.., columns xb..; zero outside windows) into
    a [RY, CX] table indexed by relative offset (ky - qy + KH - 1, kx - qx + KW - 1)."""
    BQ: tl.constexpr = qy.shape[0]
    # x: gather each query's 2KW-1 relative columns out of every block row
    m = tl.arange(0, ROWS * CX)
    r = m // CX
    c = m % CX
    col = qx[:, None] + c[None, :] - (KW - 1) - xb                  # [BQ, ROWS * CX]
    ok = (col >= 0) & (col < COLS) & (c[None, :] < 2 * KW - 1)
    w = tl.gather(ds, r[None, :] * COLS + tl.where(ok, col, 0), 1)
    w = tl.reshape(tl.where(ok, w, 0.), (BQ * ROWS, CX))
    # y: (query, block row) pairs -> relative row, as a one-hot matmul
    i = tl.arange(0, BQ * ROWS)
    ry = yb + i % ROWS - tl.reshape(tl.broadcast_to(qy[:, None], (BQ, ROWS)), (BQ * ROWS,)) \
        + KH - 1
    onehot = (tl.arange(0, RY)[:, None] == ry[None, :]).to(tl.float32)
    return tl.dot(onehot, w, input_precision="ieee")


@triton.jit
def _na_bwd_dq_kernel(
        Q, K, V, RPB, O, DO, LSE, DELTA, DQ, DRPB,
        sqb, sqy, sqx, sqh, sqd, skb, sky, skx, skh, skd, svb, svy, svx, svh, svd,
        sob, soy, sox, soh, sod, sdob, sdoy, sdox, sdoh, sdod, sdqb, sdqy, sdqx, sdqh, sdqd,
        heads, H, W, D, DV, DIL_Y, DIL_X, tiles_y, tiles_x, qk_scale, scale,
        KH: tl.constexpr, KW: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
        ROWS: tl.constexpr, COLS: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
        RY: tl.constexpr, CX: tl.constexpr, HAS_RPB: tl.constexpr, NREL: tl.constexpr,
        RPB_GRAD: tl.constexpr, PRECISION: tl.constexpr):
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
    table = _rpb_table(RPB, h, KH, KW, NREL)
    y0, rows = na_tile_region(ty0, TH, LY, KH)
    x0, cols = na_tile_region(tx0, TW, LX, KW)
    n_cols = tl.cdiv(cols, COLS)
    dq = tl.zeros([TH * TW, BD], tl.float32)
    drpb = tl.zeros([RY, CX], tl.float32)
    for n in range(0, tl.cdiv(rows, ROWS) * n_cols):
        k, v, s = _key_block(q, qy, qx, wy, wx, valid_q, K + b * skb + h * skh,
                             V + b * svb + h * svh, n, y0, x0, rows, cols, n_cols, gy, gx, DIL_Y,
                             DIL_X, sky, skx, skd, svy, svx, svd, D, DV, table, qk_scale, KH, KW,
                             BD, BDV, ROWS, COLS, HAS_RPB, PRECISION)
        p = tl.exp2(s - lse[:, None])  # exactly 0 outside the window (s = -inf)
        dp = dot(do, tl.trans(v), PRECISION)
        ds = p * (dp - delta[:, None])
        dq += dot(ds.to(k.dtype), k, PRECISION)
        if RPB_GRAD:
            yb = y0 + (n // n_cols) * ROWS
            xb = x0 + (n % n_cols) * COLS
            drpb += _rpb_grad_block(ds, qy, qx, yb, xb, ROWS, COLS, KH, KW, RY, CX)

    store_rows(DQ + b * sdqb + h * sdqh, dq * scale, y, x, sdqy, sdqx, sdqd, valid_q, D, BD)
    if RPB_GRAD:
        r = tl.arange(0, RY)[:, None]
        c = tl.arange(0, CX)[None, :]
        table_out = DRPB + tl.program_id(0).to(tl.int64) * (2 * KH - 1) * (2 * KW - 1)
        tl.store(table_out + r * (2 * KW - 1) + c, drpb, mask=(r < 2 * KH - 1) & (c < 2 * KW - 1))


@triton.jit
def _na_bwd_dkdv_kernel(
        Q, K, V, RPB, DO, LSE, DELTA, DK, DV_,
        sqb, sqy, sqx, sqh, sqd, skb, sky, skx, skh, skd, svb, svy, svx, svh, svd,
        sdob, sdoy, sdox, sdoh, sdod, sdkb, sdky, sdkx, sdkh, sdkd, sdvb, sdvy, sdvx, sdvh, sdvd,
        heads, H, W, D, DV, DIL_Y, DIL_X, tiles_y, tiles_x, qk_scale, scale,
        KH: tl.constexpr, KW: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
        ROWS: tl.constexpr, COLS: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
        HAS_RPB: tl.constexpr, NREL: tl.constexpr, PRECISION: tl.constexpr):
    bh, b, h, gy, gx, LY, LX, ty0, tx0, ky, kx, valid_k, y, x = _program(
        heads, H, W, DIL_Y, DIL_X, tiles_y, tiles_x, TH, TW)
    rows_base = bh.to(tl.int64) * H  # this (batch, head)'s first row in LSE and DELTA
    k = load_rows(K + b * skb + h * skh, y, x, sky, skx, skd, valid_k, D, BD)
    v = load_rows(V + b * svb + h * svh, y, x, svy, svx, svd, valid_k, DV, BDV)
    table = _rpb_table(RPB, h, KH, KW, NREL)

    y0, rows = na_query_region(ty0, TH, LY, KH)
    x0, cols = na_query_region(tx0, TW, LX, KW)
    n_cols = tl.cdiv(cols, COLS)
    dk = tl.zeros([TH * TW, BD], tl.float32)
    dv = tl.zeros([TH * TW, BDV], tl.float32)
    for n in range(0, tl.cdiv(rows, ROWS) * n_cols):
        qy, qx, valid_q, sy, sx, q, do = _region_block(
            Q + b * sqb + h * sqh, DO + b * sdob + h * sdoh, n, y0, x0, rows, cols, n_cols, gy,
            gx, DIL_Y, DIL_X, sqy, sqx, sqd, sdoy, sdox, sdod, D, DV, BD, BDV, ROWS, COLS)
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


INTERPRETED = isinstance(_na_fwd_kernel, InterpretedFunction)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------

def support(device_type: str, dtype: torch.dtype, head_dim: int, v_dim: int,
            kernel_size: Tuple[int, ...]) -> Optional[str]:
    """``None`` if these kernels can run such a call, else why not (Triton itself is checked by
    :func:`attnzoo.kernels.triton_missing`)."""
    if device_type == "cpu":
        if not (INTERPRETED and interpreter_enabled()):
            return ("attnzoo's Triton kernels run on CUDA tensors; CPU tensors only under "
                    "Triton's interpreter (TRITON_INTERPRET=1 set before attnzoo's kernels are "
                    "first imported and while they run; for tests, it is slow)")
    elif device_type != "cuda":
        return f"attnzoo's Triton kernels run on CUDA tensors, not {device_type}"
    elif not INTERPRETED and torch.cuda.is_available() \
            and torch.cuda.get_device_capability() < (8, 0):
        major, minor = torch.cuda.get_device_capability()
        return (f"attnzoo's Triton kernels need a GPU of compute capability >= 8.0 (Ampere or "
                f"newer), this one is {major}.{minor}")
    if dtype not in DTYPES:
        return (f"attnzoo's Triton NA kernels support {', '.join(map(str, DTYPES))}, "
                f"not {dtype}")
    if max(head_dim, v_dim) > MAX_HEAD_DIM:
        return (f"attnzoo's Triton NA kernels support head_dim up to {MAX_HEAD_DIM}, got "
                f"{max(head_dim, v_dim)}")
    if any(K > MAX_KERNEL_SIZE for K in kernel_size):
        return (f"attnzoo's Triton NA kernels support kernel sizes up to {MAX_KERNEL_SIZE}, got "
                f"{tuple(kernel_size)}")
    return None


class _Launch(NamedTuple):
    grid: Tuple[int]
    tiling: Tiling
    args: dict      # geometry and constexprs every kernel takes


def default_tiling(spatial: Tuple[int, int], kernel_size: Tuple[int, int],
                   row_bytes: int = 128) -> Tiling:
    """2-D: 8x8 query tiles (at K=7 a 14x14 key region, streamed as 7 blocks of 2 x 16 keys);
    1-D (H = 1): runs of 64 queries. Half as many queries where a q row and an output row
    together take more than 512 bytes (fp32 at head dim 128), which otherwise spill registers
    (scripts/compile_kernels.py). The key-centric pass uses the same tiles for keys (its query
    regions are as wide, up to K//2 more at a clamped border)."""
    (H, _), (KH, KW) = spatial, kernel_size
    small = row_bytes > 512
    TH, TW = ((1, 32) if small else (1, 64)) if H == 1 else ((4, 8) if small else (8, 8))
    return Tiling(TH, TW, *block_shape(min(TH + KH - 1, H), TW + KW - 1))


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "ieee"  # not TF32: the fp32 path is the exact one
    return "upcast" if INTERPRETED and dtype == torch.bfloat16 else "tf32"


def _plan(q: torch.Tensor, v: torch.Tensor, kernel_size, dilation, has_rpb: bool,
          tiling: Optional[Tiling]) -> _Launch:
    B, H, W, heads, D = q.shape
    KH, KW = kernel_size
    BD, BDV = pow2(D), pow2(v.shape[-1])
    row_bytes = (BD + BDV) * q.element_size()
    t = tiling or default_tiling((H, W), kernel_size, row_bytes)
    if not (t.TH * t.TW >= 16 and t.ROWS * t.COLS >= 16 and all(n & (n - 1) == 0 for n in t)):
        raise ValueError(f"{t}: blocks must be powers of two of >= 16 positions (tl.dot)")
    tiles_y, tiles_x = grid_tiles((H, W), dilation, (t.TH, t.TW))
    # Wide rows (fp32, head dims > 32) spill registers at 4 warps (scripts/compile_kernels.py).
    warps = 4 if row_bytes <= 128 else 8
    args = dict(heads=heads, H=H, W=W, D=D, DV=v.shape[-1], DIL_Y=dilation[0],
                DIL_X=dilation[1], tiles_y=tiles_y, tiles_x=tiles_x, KH=KH, KW=KW,
                TH=t.TH, TW=t.TW, ROWS=t.ROWS, COLS=t.COLS, BD=BD, BDV=BDV, HAS_RPB=has_rpb,
                NREL=pow2((2 * KH - 1) * (2 * KW - 1), 1) if has_rpb else 1,
                PRECISION=_precision(q.dtype), num_warps=warps)
    return _Launch((B * heads * dilation[0] * dilation[1] * tiles_y * tiles_x,), t, args)


_captured: Optional[List[tuple]] = None  # the list capture_launches yields, while it is active


@contextlib.contextmanager
def capture_launches() -> Iterator[List[tuple]]:
    """Record the kernels' launches instead of running them: within it, each one is appended as
    ``(kernel, grid, args, kwargs)`` to the list it yields. scripts/compile_kernels.py runs the
    host code on meta tensors under it and compiles every launch for sm80/sm90 without a GPU."""
    global _captured
    previous, _captured = _captured, []
    try:
        yield _captured
    finally:
        _captured = previous


def _run(kernel, grid, *args, **kwargs):
    # The one launch point (see capture_launches). Triton launches on the current CUDA device:
    # guard it in eager mode (a compiled graph guards devices itself).
    if _captured is not None:
        _captured.append((kernel, grid, args, kwargs))
        return
    eager_cuda = args[0].is_cuda and not torch.compiler.is_compiling()
    with torch.cuda.device(args[0].device) if eager_cuda else contextlib.nullcontext():
        kernel[grid](*args, **kwargs)


def _forward(q, k, v, rpb, kernel_size, dilation, scale, tiling=None):
    B, H, W, heads, _ = q.shape
    plan = _plan(q, v, kernel_size, dilation, rpb is not None, tiling)
    o = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    lse = torch.empty((B, heads, H, W), device=q.device, dtype=torch.float32)
    _run(_na_fwd_kernel, plan.grid, q, k, v, q if rpb is None else rpb, o, lse,
         *q.stride(), *k.stride(), *v.stride(), *o.stride(), qk_scale=scale * LOG2E,
         **plan.args)
    return o, lse


def _backward(do, q, k, v, rpb, o, lse, kernel_size, dilation, scale, need_rpb_grad,
              need_kv_grad, tiling=None):
    plan = _plan(q, v, kernel_size, dilation, rpb is not None, tiling)
    KH, KW = kernel_size
    dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    delta = torch.empty_like(lse)
    n_rel = (2 * KH - 1) * (2 * KW - 1)
    # one rpb-gradient table per program, summed below
    partial = torch.empty((plan.grid[0] if need_rpb_grad else 1, n_rel), device=q.device,
                          dtype=torch.float32)
    rpb_arg = q if rpb is None else rpb
    _run(_na_bwd_dq_kernel, plan.grid, q, k, v, rpb_arg, o, do, lse, delta, dq, partial,
         *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride(),
         qk_scale=scale * LOG2E, scale=scale, RY=pow2(2 * KH - 1), CX=pow2(2 * KW - 1),
         RPB_GRAD=need_rpb_grad, **plan.args)
    if need_kv_grad:
        _run(_na_bwd_dkdv_kernel, plan.grid, q, k, v, rpb_arg, do, lse, delta, dk, dv,
             *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
             qk_scale=scale * LOG2E, scale=scale, **plan.args)
    drpb = None
    if need_rpb_grad:
        B, heads = q.shape[0], q.shape[3]
        drpb = partial.view(B, heads, -1, n_rel).sum((0, 2)).view(heads, 2 * KH - 1, 2 * KW - 1)
    return dq, (dk if need_kv_grad else None), (dv if need_kv_grad else None), drpb


class NeighborhoodAttention(torch.autograd.Function):
    """2-D NA on ``[B, H, W, heads, d]`` (1-D as ``H = 1``): ``apply(q, k, v, rpb, kernel_size,
    dilation, scale, tiling)``; ``rpb`` ``[heads, 2KH-1, 2KW-1]`` in q's dtype or ``None``;
    ``tiling`` a :class:`~.tiling.Tiling` or ``None`` (:func:`default_tiling`)."""

    @staticmethod
    def forward(ctx, q, k, v, rpb, kernel_size, dilation, scale, tiling=None):
        o, lse = _forward(q, k, v, rpb, kernel_size, dilation, scale, tiling)
        ctx.save_for_backward(q, k, v, rpb, o, lse)
        ctx.args = (kernel_size, dilation, scale, tiling)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, rpb, o, lse = ctx.saved_tensors
        kernel_size, dilation, scale, tiling = ctx.args
        need = ctx.needs_input_grad
        dq, dk, dv, drpb = _backward(do, q, k, v, rpb, o, lse, kernel_size, dilation, scale,
                                     rpb is not None and need[3], need[1] or need[2], tiling)
        return dq, dk, dv, drpb, None, None, None, None


def na_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: Tuple[int, ...],
             dilation: Tuple[int, ...], rpb: Optional[torch.Tensor], scale: float,
             tiling: Optional[Tiling] = None) -> torch.Tensor:
    """The ``cuda`` backend of ``na1d`` / ``na2d``: arguments as
    :func:`attnzoo.ops.neighborhood.na_reference` (already validated). The bias is cast to q's
    dtype first, as the reference does."""
    if rpb is not None:
        rpb = rpb.to(q.dtype).contiguous()
    if len(kernel_size) == 1:  # 1-D is 2-D with H = 1
        out = NeighborhoodAttention.apply(
            q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1),
            None if rpb is None else rpb.unsqueeze(1), (1,) + tuple(kernel_size),
            (1,) + tuple(dilation), float(scale), tiling)
        return out.squeeze(1)
    return NeighborhoodAttention.apply(q, k, v, rpb, tuple(kernel_size), tuple(dilation),
                                       float(scale), tiling)
