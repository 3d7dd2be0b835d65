"""Tiling shared by attnzoo's windowed-attention kernels (NA now; QnA's and SAN's windowed
aggregations are meant to reuse it).

The scheme: a program owns a 2-D tile of ``TH x TW`` outputs (queries) of one *dilation group*
(positions ``g + d * i`` along each axis; a dilated window is a plain window inside its group).
Windows whose start is monotone in the query index (NA's clamped windows, strided windows)
cover, for a tile, one rectangular key *region*; the program streams that region in blocks of
``ROWS x COLS`` keys (a block = a few region rows times a power-of-two column chunk), so it never
forms the attention matrix of the tile, only ``tile x block`` pieces of it. A key-centric pass
(gradients of keys and values, no atomics) does the converse: a tile of keys streams the region
of queries whose windows reach it.

Coordinates inside a group ("group coordinates") are what the helpers take; ``to_source``
maps them back to positions in the tensor. Tensors are heads-last, ``[B, H, W, heads, dim]``
(any strides), addressed as ``base + y * stride_y + x * stride_x + c * stride_c``.

Host-side, :func:`block_shape` picks the power-of-two block shapes (``tl.dot`` needs every operand
dimension >= 16 on sm80/sm90) and :func:`grid_tiles` counts the tiles.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Tuple

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax runs in base 2 (exp2 is one instruction)


# ---------------------------------------------------------------------------------------------
# window arithmetic (group coordinates)
# ---------------------------------------------------------------------------------------------

@triton.jit
def group_length(L, g, d):
    """Positions in dilation group ``g`` of an axis of length ``L``: ceil((L - g) / d)."""
    return (L - g + d - 1) // d


@triton.jit
def to_source(i, g, d):
    """Group coordinate -> position along the axis of the tensor."""
    return i * d + g


@triton.jit
def na_window_start(i, length, K: tl.constexpr):
    """NA's clamped window start: the window shifts inward at a border, never shrinks."""
    return tl.minimum(tl.maximum(i - K // 2, 0), length - K)


@triton.jit
def na_tile_region(i0, T: tl.constexpr, length, K: tl.constexpr):
    """Key region (start, extent) read by queries ``i0 .. i0 + T - 1`` (clipped to the group):
    from the first query's window start to the last one's end; extent 0 for an empty tile."""
    last = tl.minimum(i0 + T - 1, length - 1)
    start = na_window_start(i0, length, K)
    extent = na_window_start(last, length, K) + K - start
    return start, tl.where(i0 < length, extent, 0)


@triton.jit
def na_query_region(j0, T: tl.constexpr, length, K: tl.constexpr):
    """Queries (start, extent) whose clamped windows contain a key of ``j0 .. j0 + T - 1``.
    Windows start at ``clamp(i - K//2, 0, length - K)``, so key ``j`` is seen by queries
    ``j - K//2 .. j + K//2`` in the interior and by every query whose window is clamped onto it
    at a border (up to ``K//2`` more): all queries if ``j < K`` (resp. ``j >= length - K``)."""
    last = tl.minimum(j0 + T - 1, length - 1)
    lo = tl.where(j0 < K, 0, j0 - K // 2)
    hi = tl.where(last >= length - K, length - 1, last + K // 2)
    return lo, tl.where(j0 < length, hi + 1 - lo, 0)


# ---------------------------------------------------------------------------------------------
# tiles and blocks
# ---------------------------------------------------------------------------------------------

@triton.jit
def program_tile(pid, tiles_y, tiles_x, DIL_Y, DIL_X):
    """Program id -> (batch * heads + head, group y, group x, tile y, tile x), tiles innermost:
    neighbouring programs then share their key halos in L2."""
    n_tiles = tiles_y * tiles_x
    tile = pid % n_tiles
    rest = pid // n_tiles
    g = rest % (DIL_Y * DIL_X)
    return rest // (DIL_Y * DIL_X), g // DIL_X, g % DIL_X, tile // tiles_x, tile % tiles_x


@triton.jit
def tile_positions(ty, tx, TH: tl.constexpr, TW: tl.constexpr):
    """Group coordinates (y, x) of the ``TH * TW`` positions of tile (ty, tx), row-major."""
    i = tl.arange(0, TH * TW)
    return ty * TH + i // TW, tx * TW + i % TW


@triton.jit
def block_positions(y0, x0, n, n_cols, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Group coordinates of block ``n`` of a region at (y0, x0) streamed in ``ROWS x COLS``
    blocks, ``n_cols`` column chunks per band of rows."""
    i = tl.arange(0, ROWS * COLS)
    y = y0 + (n // n_cols) * ROWS + i // COLS
    x = x0 + (n % n_cols) * COLS + i % COLS
    return y, x


@triton.jit
def load_rows(base, y, x, sy, sx, sc, mask, C, BC: tl.constexpr):
    """``[len(y), BC]`` block of a heads-last tensor at source positions (y, x): channels
    ``< C`` (the rest, and masked rows, read as 0)."""
    c = tl.arange(0, BC)
    ptr = base + y[:, None] * sy + x[:, None] * sx + c[None, :] * sc
    return tl.load(ptr, mask=mask[:, None] & (c[None, :] < C), other=0.)


@triton.jit
def store_rows(base, value, y, x, sy, sx, sc, mask, C, BC: tl.constexpr):
    c = tl.arange(0, BC)
    ptr = base + y[:, None] * sy + x[:, None] * sx + c[None, :] * sc
    tl.store(ptr, value.to(base.dtype.element_ty), mask=mask[:, None] & (c[None, :] < C))


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``PRECISION``: tl.dot's input precision ("ieee" for exact
    fp32, "tf32" where the operands are fp16/bf16 and it does not apply), or "upcast": compute
    on operands cast to fp32, for the Triton interpreter only, whose tl.dot multiplies bfloat16
    bit patterns (it stores bf16 as uint16; triton-lang/triton#11584). The operands were already
    rounded to bf16, so the result is what a bf16 tensor-core dot gives up to summation order."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v, PRECISION: tl.constexpr):
    """One block of a streaming softmax-weighted sum (base-2 logits ``s``, -inf where masked):
    rescale the running max ``m_i``, sum ``l_i`` and accumulator ``acc``, add ``p @ v``.
    ``m_i`` starts at a finite -1e30 so that an all-masked block gives p = 0, not NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION)
    return m_new, l_i, acc


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------

def pow2(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum) (tl.arange and tl.dot shapes)."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def block_shape(rows: int, cols: int, target: int = 32) -> Tuple[int, int]:
    """(ROWS, COLS) blocks streaming a ``rows x cols`` region: COLS 16 or 32, whichever wastes
    fewer padded columns (each block also costs a fixed loop overhead, counted here as 16
    columns), ROWS a power of two so that a block holds about ``target`` keys. Blocks of more
    than 32 keys need more shared memory than an A100 has at fp32 / head dim 128."""
    best = min((16, 32), key=lambda c: (math.ceil(cols / c) * (c + 16), c))
    r = 1
    while r * 2 * best <= target and r * 2 <= rows:
        r *= 2
    return r, best


class Tiling(NamedTuple):
    """Block shapes of one launch (all powers of two; tile and blocks >= 16 positions)."""
    TH: int      # tile rows (group coordinates)
    TW: int      # tile columns
    ROWS: int    # region rows per streamed block
    COLS: int    # region columns per streamed block


def grid_tiles(spatial: Tuple[int, int], dilation: Tuple[int, int],
               tile: Tuple[int, int]) -> Tuple[int, int]:
    """Tiles per dilation group along (y, x): the longest group's length / tile size."""
    return tuple(math.ceil(math.ceil(L / d) / t) for L, d, t in zip(spatial, dilation, tile))
