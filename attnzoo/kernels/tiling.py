"""Tiling shared by attnzoo's windowed-attention kernels: NA's (everything below), QnA's and
SAN's (program tiles, tile positions, strided row loads and stores, block sizes).

The scheme: a program owns a 2-D tile of ``TH x TW`` outputs (queries) of one *dilation group*
(positions ``g + d * i`` along each axis; a dilated window is a plain window inside its group).
Windows whose start is monotone in the query index (NA's clamped windows, strided windows)
cover, for a tile, one rectangular key *region*; the program streams that region's positions in
row-major order, ``BN`` at a time (a *block*), so it never forms the attention matrix of the
tile, only ``tile x block`` pieces of it. A key-centric pass (gradients of keys and values, no
atomics) does the converse: a tile of keys streams the region of queries whose windows reach it.

Work: a program computes ``TH * TW * BN`` logits per block, however many of them fall inside a
window. :func:`logit_work` counts them for a launch (host side, exactly as the kernels loop) and
:func:`rank_tilings` orders the tilings by it: small tiles have small regions (a 4 x 4 tile of
7 x 7 windows reads 10 x 10 keys, an 8 x 8 tile 14 x 14), and blocks follow the region's
row-major order, so only its last block is padded. Tiles and blocks of at least 16 positions
(tl.dot's operands) bound what is possible: any 16 queries' 7 x 7 windows cover at least
10 x 10 keys, 7 blocks of 16, so an interior tile is at most 49 / 112 = 44% useful at K = 7;
large maps (56 x 56 and up) stay just under 50%, the borders' clamped windows helping.

Coordinates inside a group ("group coordinates") are what the helpers take; ``to_source``
maps them back to positions in the tensor. Tensors are heads-last, ``[B, H, W, heads, dim]``
(any strides), addressed as ``base + y * stride_y + x * stride_x + c * stride_c``.

Precision (:func:`dot_precision`, one rule for every kernel): fp16/bf16 operands use the tensor
cores; fp32 operands use TF32 tensor cores only where ``torch.get_float32_matmul_precision()``
allows it ("high" or "medium", as for torch's own matmuls), exact fp32 otherwise (the default,
"highest"). Accumulation is always fp32.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from typing import Iterator, List, NamedTuple, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2E = 1.4426950408889634  # softmax runs in base 2 (exp2 is one instruction)


@triton.jit
def to_base2(x):
    """``x * log2(e)``: a natural-log logit as the base-2 logit the kernels' softmax takes."""
    return x * 1.4426950408889634


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
def region_block(y0, x0, rows, cols, n, BN: tl.constexpr):
    """Block ``n`` of a ``rows x cols`` region at (y0, x0): the group coordinates of its
    positions ``n * BN ..`` in row-major order and their mask (the last block is partial)."""
    i = n * BN + tl.arange(0, BN)
    return y0 + i // cols, x0 + i % cols, i < rows * cols


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
def _round_to_tf32(x):
    """fp32 -> the nearest TF32 value (10 explicit mantissa bits, ties away from zero, as
    ``cvt.rna.tf32.f32``), still stored as fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` -> the nearest ``DTYPE`` value (ties to even, as torch's ``.to(dtype)``),
    still stored as fp32. bf16 by its bits: the interpreter's fp32 -> bf16 cast truncates."""
    if DTYPE == tl.bfloat16:  # (a NaN stays NaN: its bits could carry over to +0)
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32,
                                                                         bitcast=True)
        return tl.where(x == x, rounded, x)
    elif DTYPE == tl.float32:
        return x
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``PRECISION`` (:func:`dot_precision`): tl.dot's input
    precision ("ieee": exact fp32; "tf32": TF32 tensor cores for fp32 operands, the tensor
    cores' own precision for fp16/bf16), or, for Triton's interpreter only, whose tl.dot is an
    exact matmul of what it is given: "upcast", bf16 operands cast to fp32 first (it would
    multiply bf16 bit patterns: it stores bf16 as uint16, triton-lang/triton#11584; the result
    is a bf16 tensor-core dot's up to summation order), and "tf32-rounded", fp32 operands
    rounded to TF32 first, which is what TF32 tensor cores compute."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif PRECISION == "tf32-rounded":
        return tl.dot(_round_to_tf32(a), _round_to_tf32(b), input_precision="ieee")
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


# Sums of per-program tables (a gradient summed over the programs that each wrote a part of it,
# NA's rpb and QnA's rpb and window weights): a few programs per table, appended to a later
# launch of the same backward (its stream runs it after the tables are written). Each loads
# blocks of many tables, so that a long sum takes few dependent steps; 128 tables a step made
# ptxas spill 4-8 B in some of NA's launches' dK/dV tiles, on every arch
# (scripts/compile_kernels.py).
SUM_ENTRIES = tl.constexpr(16)
SUM_ROWS = tl.constexpr(32)


@triton.jit
def sum_tables(PARTIAL, OUT, r, groups, batch, rows, N):
    """Reduction program ``r``: ``SUM_ENTRIES`` entries of one group's table, the sum over
    every batch and row of ``PARTIAL`` (``[batch, groups, rows, N]``, float32) in a fixed order
    (deterministic), stored into ``OUT`` (``[groups, N]``) in its dtype. Programs: ``groups *
    cdiv(N, SUM_ENTRIES)``."""
    blocks = (N + SUM_ENTRIES - 1) // SUM_ENTRIES
    g = r // blocks
    cols = (r % blocks) * SUM_ENTRIES + tl.arange(0, SUM_ENTRIES)
    total = batch * rows  # this group's tables, (batch, row) flattened
    acc = tl.zeros([SUM_ROWS, SUM_ENTRIES], tl.float32)
    for f0 in range(0, total, SUM_ROWS):
        f = f0 + tl.arange(0, SUM_ROWS)
        table = ((f // rows) * groups + g).to(tl.int64) * rows + f % rows
        acc += tl.load(PARTIAL + table[:, None] * N + cols[None, :],
                       mask=(f[:, None] < total) & (cols[None, :] < N), other=0.)
    tl.store(OUT + g * N + cols, tl.sum(acc, 0), mask=cols < N)


def sum_programs(groups: int, N: int) -> int:
    """The programs of :func:`sum_tables` for ``groups`` tables of ``N`` entries."""
    return groups * -(-N // SUM_ENTRIES.value)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------

# The kernels were built for Triton's interpreter (TRITON_INTERPRET set at their first import).
INTERPRETED = isinstance(group_length, InterpretedFunction)


def _skip_the_interpreters_dead_work() -> None:
    """Two things Triton's interpreter (3.6-3.8) does that change no result, skipped: 2.6x
    faster kernels on CPU, where CI proves them (tests/test_kernels_*, gpu_verify --dry-run).

    - At each call of a ``@triton.jit`` helper inside a kernel it patches ``triton.language``
      again (``_patch_lang``: ``inspect`` scans of tl, tl.tensor and tl.math, ~2 ms a call), in
      a scope nobody restores; where the language modules the helper sees (tl, tl.core) are
      already patched (their builtins are the interpreter's wrappers), that patch would only
      wrap the wrappers. Any other call is patched as before.
    - It checks every int32 add, sub and mul for overflow (a cast to int64, the operation again
      and two comparisons: half its time) for a ``device_assert`` that it drops, debug being
      off in its options.

    A Triton without these internals is left as it is."""
    from triton.runtime import interpreter
    patch, scope = getattr(interpreter, "_patch_lang", None), getattr(
        interpreter, "_LangPatchScope", None)
    if patch is not None and scope is not None and tl.core.is_builtin(tl.core.full):
        def patch_unless_patched(fn):
            langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
            if langs and not any(tl.core.is_builtin(lang.full) for lang in langs):
                return scope()
            return patch(fn)

        interpreter._patch_lang = patch_unless_patched
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "debug", True) is False:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


if INTERPRETED:
    _skip_the_interpreters_dead_work()


def pow2(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum) (tl.arange and tl.dot shapes)."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def dot_precision(dtype: torch.dtype, interpreted: bool) -> str:
    """The ``PRECISION`` constexpr of :func:`dot` for operands of ``dtype``, read at launch.
    fp32: TF32 only where ``torch.get_float32_matmul_precision()`` is "high" or "medium"."""
    if dtype == torch.float32:
        if torch.get_float32_matmul_precision() == "highest":
            return "ieee"
        return "tf32-rounded" if interpreted else "tf32"
    return "upcast" if interpreted and dtype == torch.bfloat16 else "tf32"


class Tiling(NamedTuple):
    """Block shapes of one launch (powers of two; tile and block >= 16 positions, the smallest
    tl.dot operand dimension of 16-bit inputs)."""
    TH: int      # tile rows (group coordinates)
    TW: int      # tile columns
    BN: int      # region positions per streamed block


def grid_tiles(spatial: Tuple[int, int], dilation: Tuple[int, int],
               tile: Tuple[int, int]) -> Tuple[int, int]:
    """Tiles per dilation group along (y, x): the longest group's length / tile size."""
    return tuple(math.ceil(math.ceil(L / d) / t) for L, d, t in zip(spatial, dilation, tile))


# Host mirrors of na_tile_region / na_query_region: the extents the kernels stream.
def _window_start(i: int, length: int, K: int) -> int:
    return min(max(i - K // 2, 0), length - K)


def _tile_extent(i0: int, T: int, length: int, K: int) -> int:
    if i0 >= length:
        return 0
    return _window_start(min(i0 + T - 1, length - 1), length, K) + K - _window_start(i0, length, K)


def _query_extent(j0: int, T: int, length: int, K: int) -> int:
    if j0 >= length:
        return 0
    last = min(j0 + T - 1, length - 1)
    lo = 0 if j0 < K else j0 - K // 2
    hi = length - 1 if last >= length - K else last + K // 2
    return hi + 1 - lo


def region_extents(L: int, K: int, d: int, T: int, key_pass: bool) -> Counter:
    """Multiset of the region extents along one axis (length ``L``, window ``K``, dilation
    ``d``, tiles of ``T``) over every (group, tile) of the launch grid."""
    extent = _query_extent if key_pass else _tile_extent
    n_tiles = math.ceil(math.ceil(L / d) / T)
    return Counter(extent(t * T, T, (L - g + d - 1) // d, K) for g in range(d)
                   for t in range(n_tiles))


class Work(NamedTuple):
    """Logits of one launch per (batch, head): computed by the programs, and needed (each
    query's window)."""
    computed: int
    needed: int
    steps: int     # blocks streamed, summed over programs (the loop trips)

    @property
    def useful(self) -> float:
        return self.needed / self.computed


def logit_work(spatial: Tuple[int, int], kernel_size: Tuple[int, int],
               dilation: Tuple[int, int], tiling: Tiling, key_pass: bool = False) -> Work:
    """Logits a launch computes per (batch, head), as the kernels loop: every program (tile)
    streams ``ceil(rows * cols / BN)`` blocks of its region and computes ``TH * TW * BN`` logits
    per block. ``key_pass``: the key-centric pass (tiles of keys, regions of queries)."""
    (H, W), (KH, KW), (dy, dx) = spatial, kernel_size, dilation
    ys = region_extents(H, KH, dy, tiling.TH, key_pass)
    xs = region_extents(W, KW, dx, tiling.TW, key_pass)
    steps = sum(ny * nx * math.ceil(ey * ex / tiling.BN)
                for ey, ny in ys.items() for ex, nx in xs.items())
    return Work(steps * tiling.TH * tiling.TW * tiling.BN, H * W * KH * KW, steps)


def tilings(spatial: Tuple[int, int], max_tile: int, max_logits: int) -> Iterator[Tiling]:
    """Candidate tilings: tiles of 16 .. ``max_tile`` positions (one row where H = 1, i.e.
    1-D), blocks of 16 .. 64, at most ``max_logits`` logits per (tile, block) piece."""
    sides = [1 << i for i in range(7)]
    for TH in ([1] if spatial[0] == 1 else sides):
        for TW in sides:
            for BN in (16, 32, 64):
                if 16 <= TH * TW <= max_tile and TH * TW * BN <= max_logits:
                    yield Tiling(TH, TW, BN)


@functools.lru_cache(maxsize=1024)
def rank_tilings(spatial: Tuple[int, int], kernel_size: Tuple[int, int],
                 dilation: Tuple[int, int], key_pass: bool, max_tile: int = 64,
                 max_logits: int = 1024) -> List[Tuple[int, Tiling]]:
    """(logits computed, tiling) for every candidate tiling, fewest logits first (then fewer
    loop trips, then larger tiles: fewer programs for the same work)."""
    scored = []
    for t in tilings(spatial, max_tile, max_logits):
        work = logit_work(spatial, kernel_size, dilation, t, key_pass)
        scored.append((work.computed, work.steps, -t.TH * t.TW, t))
    return [(work, t) for work, _, _, t in sorted(scored)]
