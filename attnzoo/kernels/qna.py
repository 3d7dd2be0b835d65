"""Fused QnA (learned-query window attention, :func:`attnzoo.ops.qna2d`) in Triton.

Semantics are those of :func:`attnzoo.ops.qna.qna2d_reference`. QnA's queries are shared by
every window, so a key's score is one precomputed number per learned query (``logits``): there is
no query-key product to tile with tl.dot, only each window's ``k x k`` taps to stream. A program
owns a tile of ``TH x TW`` outputs of one (batch, head) (:func:`~.tiling.program_tile`) and
visits the window's taps once: each tap's values are read once for all ``L`` learned queries,
each query with its own online softmax in base 2 (the rpb added, out-of-map taps excluded, the
window weights in the numerator only), accumulating in fp32. Each window's own running maximum
stabilises it, so any logits are exact: no exponent-range fallback as the reference's
convolution form needs. The forward saves each window's log-sum-exp per learned query.

Backward, recomputing the probabilities from the log-sum-exp
(``dz = p * (w * <g_l, v> - D_l)``, ``D_l = <g_l, out_l>``):

* output-centric pass: ``D_l`` per output and learned query, summed over the window's taps
  (with ``sum_queries`` the per-query results ``out_l`` are never stored); and the rpb and
  window-weight gradients, one number per (learned query, head, tap), summed per program over
  its tile of outputs into a table per program;
* key-centric pass: a tile of keys visits, per tap, the one output (if any) whose window holds
  it there (stride 2: a key is a tap of fewer windows), reads that output's gradient once for
  every query (with ``sum_queries`` they share it), and accumulates the gradients of its
  logits and value in registers: overlapping windows need no atomics. A few more programs of
  this launch sum the first pass's tables (deterministic).
"""
from __future__ import annotations

import functools
from typing import List, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import (Allocation, KernelLimits, allocation, eager, kernel_op, launch_on_device,
               narrow_offsets, once_differentiable)
from .tiling import (load_rows, pow2, program_tile, store_rows, sum_programs, sum_tables,
                     tile_positions, to_base2)

__all__ = ["qna_fused", "support", "not_supported_reasons", "call_reasons", "LIMITS"]

MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LIMITS = KernelLimits("attnzoo's Triton QnA kernels", DTYPES, MAX_HEAD_DIM)
NUM_WARPS = 4


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _program(heads, Hp, Wp, TH: tl.constexpr, TW: tl.constexpr):
    """Program -> batch (int64), head, and its tile's positions (y, x) on a ``Hp x Wp`` map
    with their mask."""
    tiles_y = tl.cdiv(Hp, TH)
    tiles_x = tl.cdiv(Wp, TW)
    bh, _, _, ty, tx = program_tile(tl.program_id(0), tiles_y, tiles_x, 1, 1)
    y, x = tile_positions(ty, tx, TH, TW)
    return (bh // heads).to(tl.int64), bh % heads, y, x, (y < Hp) & (x < Wp)


@triton.jit
def _queries(L, heads, h, K: tl.constexpr, LP: tl.constexpr):
    """The learned queries ``l`` (``[LP]``, padded to a power of two) with their mask, and where
    each one's ``K x K`` table of rpb / window weights starts for head ``h``."""
    q = tl.arange(0, LP)
    return q, q < L, (q * heads + h) * K * K


@triton.jit
def _tap(oy, ox, t, H, W, STRIDE: tl.constexpr, K: tl.constexpr):
    """The key at tap ``t`` (row-major over the ``K x K`` window) of outputs (oy, ox), and
    whether it lies in the map."""
    ky = oy * STRIDE + t // K - (K - 1) // 2
    kx = ox * STRIDE + t % K - (K - 1) // 2
    return ky, kx, (ky >= 0) & (ky < H) & (kx >= 0) & (kx < W)


@triton.jit
def _per_query(base, q, sq, y, x, sy, sx):
    """``[LP, len(y)]`` pointers to each query's number (a logit) at positions (y, x)."""
    return base + q[:, None] * sq + (y * sy + x * sx)[None, :]


@triton.jit
def _query_rows(base, q, sq, y, x, sy, sx, sd, mask, D, BD: tl.constexpr):
    """``[LP, len(y), BD]`` pointers to each query's row of ``D`` channels at (y, x), and their
    mask (``mask``: ``[LP, len(y)]``)."""
    d = tl.arange(0, BD)
    ptr = (base + q[:, None, None] * sq + (y * sy + x * sx)[None, :, None]
           + d[None, None, :] * sd)
    return ptr, mask[:, :, None] & (d < D)[None, None, :]


@triton.jit
def _qna_fwd_kernel(
        LOGITS, V, RPB, WS, O, LSE,
        slb, sly, slx, sll, slh, svb, svy, svx, svh, svd, sob, soy, sox, sol, soh, sod,
        heads, H, W, Ho, Wo, L, D,
        K: tl.constexpr, STRIDE: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
        BD: tl.constexpr, LP: tl.constexpr, SUM_QUERIES: tl.constexpr):
    b, h, oy, ox, valid = _program(heads, Ho, Wo, TH, TW)
    q, q_ok, table = _queries(L, heads, h, K, LP)
    m_i = tl.full([LP, TH * TW], -1e30, tl.float32)
    l_i = tl.zeros([LP, TH * TW], tl.float32)
    acc = tl.zeros([LP, TH * TW, BD], tl.float32)
    for t in range(0, K * K):
        ky, kx, inside = _tap(oy, ox, t, H, W, STRIDE, K)
        inside = inside & valid
        ok = q_ok[:, None] & inside[None, :]
        z = tl.load(_per_query(LOGITS + b * slb + h * slh, q, sll, ky, kx, sly, slx), mask=ok,
                    other=0.).to(tl.float32)
        rpb = tl.load(RPB + table + t, mask=q_ok, other=0.)
        s = tl.where(ok, to_base2(z + rpb[:, None]), float("-inf"))
        # the tap's values, read once for every learned query
        v = load_rows(V + b * svb + h * svh, ky, kx, svy, svx, svd, inside, D,
                      BD).to(tl.float32)
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        w = tl.load(WS + table + t, mask=q_ok, other=0.)
        acc = acc * alpha[:, :, None] + (p * w[:, None])[:, :, None] * v[None, :, :]
        m_i = m_new
    l_i = tl.where(l_i > 0, l_i, 1.)  # padding queries and positions of a partial tile: l = 0
    row_ok = q_ok[:, None] & valid[None, :]
    lse_rows = ((b * Ho + oy) * Wo + ox) * L * heads + h
    tl.store(LSE + q[:, None] * heads + lse_rows[None, :], m_i + tl.log2(l_i), mask=row_ok)
    out = acc / l_i[:, :, None]
    if SUM_QUERIES:
        store_rows(O + b * sob + h * soh, tl.sum(out, 0), oy, ox, soy, sox, sod, valid, D, BD)
    else:
        ptr, mask = _query_rows(O + b * sob + h * soh, q, sol, oy, ox, soy, sox, sod, row_ok,
                                D, BD)
        tl.store(ptr, out.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _gradient_rows(G, b, sgb, h, sgh, q, sgl, y, x, sgy, sgx, sgd, seen, q_ok, D,
                   BD: tl.constexpr, SUM_QUERIES: tl.constexpr):
    """The output gradient at outputs (y, x) in fp32: ``[1, len(y), BD]``, the one every query
    got, with ``sum_queries``; else ``[LP, len(y), BD]``, each query's own."""
    if SUM_QUERIES:
        g = load_rows(G + b * sgb + h * sgh, y, x, sgy, sgx, sgd, seen, D, BD)[None, :, :]
    else:
        ptr, mask = _query_rows(G + b * sgb + h * sgh, q, sgl, y, x, sgy, sgx, sgd,
                                q_ok[:, None] & seen[None, :], D, BD)
        g = tl.load(ptr, mask=mask, other=0.)
    return g.to(tl.float32)


@triton.jit
def _qna_bwd_delta_kernel(
        LOGITS, V, RPB, WS, G, LSE, DELTA, TABLES,
        slb, sly, slx, sll, slh, svb, svy, svx, svh, svd, sgb, sgy, sgx, sgl, sgh, sgd,
        heads, H, W, Ho, Wo, L, D,
        K: tl.constexpr, STRIDE: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
        BD: tl.constexpr, LP: tl.constexpr, SUM_QUERIES: tl.constexpr, KKP: tl.constexpr):
    """``D_l = <g_l, out_l> = sum_t p_l(t) w_l(t) <g_l, v(t)>`` per output and learned query,
    each tap's values read once for every query; and this program's tables of the rpb and
    window-weight gradients, summed over its outputs: per (query, tap), ``S = sum_o p <g, v>``
    (the window weight's) and ``w S - sum_o p D`` (the rpb's, ``sum_o dz``), the second sum
    once ``D`` is known, from the probabilities alone (no value read again)."""
    b, h, oy, ox, valid = _program(heads, Ho, Wo, TH, TW)
    q, q_ok, table = _queries(L, heads, h, K, LP)
    row_ok = q_ok[:, None] & valid[None, :]
    lse_rows = ((b * Ho + oy) * Wo + ox) * L * heads + h
    g = _gradient_rows(G, b, sgb, h, sgh, q, sgl, oy, ox, sgy, sgx, sgd, valid, q_ok, D, BD,
                       SUM_QUERIES)
    lse = tl.load(LSE + q[:, None] * heads + lse_rows[None, :], mask=row_ok, other=0.)
    taps = tl.arange(0, KKP)[None, :]  # a query's K*K table entries, in registers
    delta = tl.zeros([LP, TH * TW], tl.float32)
    p_gv = tl.zeros([LP, KKP], tl.float32)
    for t in range(0, K * K):
        ky, kx, inside = _tap(oy, ox, t, H, W, STRIDE, K)
        inside = inside & valid
        ok = q_ok[:, None] & inside[None, :]
        z = tl.load(_per_query(LOGITS + b * slb + h * slh, q, sll, ky, kx, sly, slx), mask=ok,
                    other=0.).to(tl.float32)
        rpb = tl.load(RPB + table + t, mask=q_ok, other=0.)
        p = tl.where(ok, tl.exp2(to_base2(z + rpb[:, None]) - lse), 0.)
        v = load_rows(V + b * svb + h * svh, ky, kx, svy, svx, svd, inside, D,
                      BD).to(tl.float32)
        w = tl.load(WS + table + t, mask=q_ok, other=0.)
        pgv = p * tl.sum(g * v[None, :, :], 2)
        delta += w[:, None] * pgv
        p_gv += tl.where(taps == t, tl.sum(pgv, 1)[:, None], 0.)  # S, entry t
    tl.store(DELTA + q[:, None] * heads + lse_rows[None, :], delta, mask=row_ok)
    p_delta = tl.zeros([LP, KKP], tl.float32)
    for t in range(0, K * K):
        ky, kx, inside = _tap(oy, ox, t, H, W, STRIDE, K)
        ok = q_ok[:, None] & (inside & valid)[None, :]
        z = tl.load(_per_query(LOGITS + b * slb + h * slh, q, sll, ky, kx, sly, slx), mask=ok,
                    other=0.).to(tl.float32)
        rpb = tl.load(RPB + table + t, mask=q_ok, other=0.)
        p = tl.where(ok, tl.exp2(to_base2(z + rpb[:, None]) - lse), 0.)
        p_delta += tl.where(taps == t, tl.sum(p * delta, 1)[:, None], 0.)  # sum_o p D, entry t
    # TABLES [2, batch, tile, L, heads, K*K]: the rpb's, then the window weights' (the tile
    # program_tile's, innermost); summed over batch and tile by the keys launch
    n_tiles = tl.cdiv(Ho, TH) * tl.cdiv(Wo, TW)
    entries = table[:, None] + taps
    entry_ok = q_ok[:, None] & (taps < K * K)
    DRPB = TABLES + (b * n_tiles + tl.program_id(0) % n_tiles) * L * heads * K * K
    DWS = DRPB + tl.num_programs(0).to(tl.int64) * L * K * K
    w = tl.load(WS + entries, mask=entry_ok, other=0.)
    tl.store(DRPB + entries, w * p_gv - p_delta, mask=entry_ok)
    tl.store(DWS + entries, p_gv, mask=entry_ok)


@triton.jit
def _qna_bwd_keys_kernel(
        LOGITS, V, RPB, WS, G, LSE, DELTA, DLOGITS, DV, TABLES, TABLE_GRADS,
        slb, sly, slx, sll, slh, svb, svy, svx, svh, svd, sgb, sgy, sgx, sgl, sgh, sgd,
        sdlb, sdly, sdlx, sdll, sdlh, sdvb, sdvy, sdvx, sdvh, sdvd, key_programs, tables,
        heads, H, W, Ho, Wo, L, D,
        K: tl.constexpr, STRIDE: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
        BD: tl.constexpr, LP: tl.constexpr, SUM_QUERIES: tl.constexpr):
    """Programs below ``key_programs``: a tile of keys. The programs after them sum
    the delta launch's tables (``TABLES``, written before this launch on the stream) into
    ``TABLE_GRADS`` (``[2, L, heads, K, K]``): the reduction rides this launch instead of
    another."""
    if tl.program_id(0) < key_programs:
        _keys_tile(LOGITS, V, RPB, WS, G, LSE, DELTA, DLOGITS, DV, slb, sly, slx, sll, slh, svb,
                   svy, svx, svh, svd, sgb, sgy, sgx, sgl, sgh, sgd, sdlb, sdly, sdlx, sdll,
                   sdlh, sdvb, sdvy, sdvx, sdvh, sdvd, heads, H, W, Ho, Wo, L, D, K, STRIDE, TH,
                   TW, BD, LP, SUM_QUERIES)
    else:  # ``tables`` per half, of L * heads * K*K entries
        sum_tables(TABLES, TABLE_GRADS, tl.program_id(0) - key_programs, 2, 1, tables,
                   L * heads * K * K)


@triton.jit
def _keys_tile(
        LOGITS, V, RPB, WS, G, LSE, DELTA, DLOGITS, DV,
        slb, sly, slx, sll, slh, svb, svy, svx, svh, svd, sgb, sgy, sgx, sgl, sgh, sgd,
        sdlb, sdly, sdlx, sdll, sdlh, sdvb, sdvy, sdvx, sdvh, sdvd,
        heads, H, W, Ho, Wo, L, D,
        K: tl.constexpr, STRIDE: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
        BD: tl.constexpr, LP: tl.constexpr, SUM_QUERIES: tl.constexpr):
    """A tile of keys: per tap, the output whose window holds the key there (``key = out *
    stride + tap - r``), every query's probability recomputed from its log-sum-exp."""
    b, h, ky, kx, valid = _program(heads, H, W, TH, TW)
    q, q_ok, table = _queries(L, heads, h, K, LP)
    key_ok = q_ok[:, None] & valid[None, :]
    v = load_rows(V + b * svb + h * svh, ky, kx, svy, svx, svd, valid, D, BD).to(tl.float32)
    z = tl.load(_per_query(LOGITS + b * slb + h * slh, q, sll, ky, kx, sly, slx), mask=key_ok,
                other=0.).to(tl.float32)
    dv = tl.zeros([TH * TW, BD], tl.float32)
    dz_total = tl.zeros([LP, TH * TW], tl.float32)
    for t in range(0, K * K):
        ny = ky - t // K + (K - 1) // 2   # out * stride
        nx = kx - t % K + (K - 1) // 2
        oy = tl.where(ny >= 0, ny, 0) // STRIDE
        ox = tl.where(nx >= 0, nx, 0) // STRIDE
        seen = (valid & (ny >= 0) & (nx >= 0) & (ny % STRIDE == 0) & (nx % STRIDE == 0)
                & (oy < Ho) & (ox < Wo))
        ok = q_ok[:, None] & seen[None, :]
        rows = q[:, None] * heads + (((b * Ho + oy) * Wo + ox) * L * heads + h)[None, :]
        lse = tl.load(LSE + rows, mask=ok, other=float("inf"))  # p = 0 where unseen
        delta = tl.load(DELTA + rows, mask=ok, other=0.)
        w = tl.load(WS + table + t, mask=q_ok, other=0.)
        rpb = tl.load(RPB + table + t, mask=q_ok, other=0.)
        p = tl.where(ok, tl.exp2(to_base2(z + rpb[:, None]) - lse), 0.)
        # the gradient read after p: read before it, ptxas spilled 4 B at head dim 256 on sm90
        g = _gradient_rows(G, b, sgb, h, sgh, q, sgl, oy, ox, sgy, sgx, sgd, seen, q_ok, D, BD,
                           SUM_QUERIES)
        gv = tl.sum(g * v[None, :, :], 2)
        dz_total += p * (w[:, None] * gv - delta)
        dv += tl.sum((p * w[:, None])[:, :, None] * g, 0)
    tl.store(_per_query(DLOGITS + b * sdlb + h * sdlh, q, sdll, ky, kx, sdly, sdlx),
             dz_total.to(DLOGITS.dtype.element_ty), mask=key_ok)
    store_rows(DV + b * sdvb + h * sdvh, dv, ky, kx, sdvy, sdvx, sdvd, valid, D, BD)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------

def not_supported_reasons(device: str, dtype: torch.dtype, head_dim: int) -> List[str]:
    """Every reason these kernels cannot run such a call on ``device`` ("cuda:1", "cpu"), empty
    if none. They keep no tile of keys in shared memory, so no shared-memory bound applies."""
    return LIMITS.reasons(device, dtype, (head_dim,))


def call_reasons(dtype: torch.dtype, head_dim: int) -> List[str]:
    """The reasons of :func:`not_supported_reasons` that the call alone decides, on any
    machine (dtype, head dim), empty if none."""
    return LIMITS.call_reasons(dtype, (head_dim,))


def support(device: str, dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """``None`` if these kernels can run such a call, else every reason why not."""
    return "; ".join(not_supported_reasons(device, dtype, head_dim)) or None


def tile(queries: int, head_dim: int) -> tuple:
    """Outputs (or keys) per program: 8 x 8, fewer (down to a row of 8) where the queries'
    accumulators, ``queries x outputs x head_dim`` fp32 values, would pass 2048 (16 registers
    per thread): at head dim 256 more spill (scripts/compile_kernels.py)."""
    outputs = max(8, min(64, 2048 // (pow2(queries, 1) * pow2(head_dim, 1))))
    return outputs // 8, 8


class _Geometry(NamedTuple):
    """A call's launch: its kernels' last arguments, positional (after their tensors and
    strides; ~15 keywords cost some 1.5 us a launch to pass), grids, and its tensors'
    allocations (:func:`~attnzoo.kernels.allocation`: as :func:`_forward_outputs` and
    :func:`_backward_outputs` make them for a trace)."""
    args: tuple     # heads, H, W, Ho, Wo, L, D, K, STRIDE, TH, TW, BD, LP, SUM_QUERIES
    delta_args: tuple  # args, then KKP (the K*K taps padded to a power of two)
    keys_args: tuple   # the keys' programs, the tables per half, then args
    outputs: tuple  # the forward's and delta's grid: a program per tile of outputs
    keys: tuple     # the keys kernel's: a program per tile of keys, then the tables' sums
    o: Allocation
    lse: Allocation  # and delta, laid out as it
    dlogits: Allocation
    dv: Allocation
    tables: Allocation  # the delta kernel's rpb and window-weight tables (see there)
    table_grads: Allocation  # their sums, [2, L, heads, K, K]


def _geometry(logits, v, kernel_size, stride, sum_queries) -> _Geometry:
    """The call's :class:`_Geometry` (computed once per call key; read only)."""
    return _geometry_of(logits.shape, v.shape[-1], kernel_size, stride, sum_queries,
                        logits.dtype, v.dtype, v.device)


@functools.lru_cache(maxsize=1024)
def _geometry_of(shape, D, kernel_size, stride, sum_queries, logits_dtype, dtype,
                 device) -> _Geometry:
    B, H, W, L, heads = shape
    o, lse = _output_shapes(tuple(shape), D, stride, sum_queries)
    Ho, Wo = lse[1:3]
    th, tw = tile(L, D)
    output_tiles = -(-Ho // th) * -(-Wo // tw)
    args = (heads, H, W, Ho, Wo, L, D, kernel_size, stride, th, tw, pow2(D, 1), pow2(L, 1),
            sum_queries)
    k2 = kernel_size * kernel_size
    key_programs = B * heads * -(-H // th) * -(-W // tw)
    return _Geometry(args, args + (pow2(k2, 1),), (key_programs, B * output_tiles) + args,
                     (B * heads * output_tiles,),
                     (key_programs + sum_programs(2, L * heads * k2),),
                     allocation(o, dtype, device), allocation(lse, torch.float32, device),
                     allocation(shape, logits_dtype, device),
                     allocation((B, H, W, heads, D), dtype, device),
                     allocation((2, B, output_tiles, L, heads, kernel_size, kernel_size),
                                torch.float32, device),
                     allocation((2, L, heads, kernel_size, kernel_size), torch.float32, device))


def _output_shapes(shape: tuple, D, stride: int, sum_queries: bool) -> tuple:
    """The output's shape ``[B, Ho, Wo, (L,) heads, D]`` and the log-sum-exp's
    ``[B, Ho, Wo, L, heads]``, of a call on logits of ``shape`` (sizes symbolic in a trace)."""
    B, H, W, L, heads = shape
    Ho, Wo = (H - 1) // stride + 1, (W - 1) // stride + 1
    return (B, Ho, Wo) + ((heads,) if sum_queries else (L, heads)) + (D,), (B, Ho, Wo, L, heads)


_OPTIONS = dict(num_warps=NUM_WARPS)


def _g_strides(g: torch.Tensor, sum_queries: bool) -> tuple:
    """(b, y, x, l, h, d) strides of an output (or its gradient); l's is 0 when summed."""
    if sum_queries:
        sb, sy, sx, sh, sd = g.stride()
        return sb, sy, sx, 0, sh, sd
    return g.stride()


# What each pass returns, as a trace is told (the custom ops' fake implementations): the very
# sizes, strides and dtypes that the host code's allocations (_Geometry) give the kernels,
# every output contiguous, whatever the inputs' strides.

def _forward_outputs(v, shapes):
    """The output in v's dtype and the log-sum-exp in float32, of ``shapes``
    (:func:`_output_shapes`)."""
    return v.new_empty(shapes[0]), v.new_empty(shapes[1], dtype=torch.float32)


def _backward_outputs(logits, v, rpb):
    """The gradients of logits and v in their dtypes, and of the rpb and window weights
    (``[L, heads, k, k]``) in float32, stacked: ``[2, L, heads, k, k]`` (as the keys kernel
    sums them)."""
    return (torch.empty_like(logits, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            v.new_empty((2,) + rpb.shape, dtype=torch.float32))


def _forward(logits, v, rpb, ws, kernel_size, stride, sum_queries):
    """The output and the log-sum-exp, and the call's :class:`_Geometry` (for its backward)."""
    geo = _geometry(logits, v, kernel_size, stride, sum_queries)
    o, lse = geo.o(), geo.lse()
    launch_on_device(_qna_fwd_kernel, geo.outputs, logits, v, rpb, ws, o, lse, *logits.stride(),
                     *v.stride(), *_g_strides(o, sum_queries), *geo.args, **_OPTIONS)
    return o, lse, geo


def _backward(g, logits, v, rpb, ws, lse, kernel_size, stride, sum_queries, geo=None):
    """The gradients of :func:`_backward_outputs`; ``geo``: the forward's, or None."""
    g = narrow_offsets(g)
    if geo is None:
        geo = _geometry(logits, v, kernel_size, stride, sum_queries)
    g_strides = _g_strides(g, sum_queries)
    delta, tables = geo.lse(), geo.tables()
    launch_on_device(_qna_bwd_delta_kernel, geo.outputs, logits, v, rpb, ws, g, lse, delta,
                     tables, *logits.stride(), *v.stride(), *g_strides, *geo.delta_args,
                     **_OPTIONS)
    dlogits, dv, table_grads = geo.dlogits(), geo.dv(), geo.table_grads()
    launch_on_device(_qna_bwd_keys_kernel, geo.keys, logits, v, rpb, ws, g, lse, delta, dlogits,
                     dv, tables, table_grads, *logits.stride(), *v.stride(), *g_strides,
                     *dlogits.stride(), *dv.stride(), *geo.keys_args, **_OPTIONS)
    return dlogits, dv, table_grads


# The passes as custom ops (kernels.kernel_op), forward and backward.

def _qna_impl(logits, v, rpb, ws, kernel_size, stride, sum_queries):
    return _forward(logits, v, rpb, ws, kernel_size, stride, sum_queries)[:2]


_qna_op = kernel_op(
    "qna_fused", _qna_impl,
    "(Tensor logits, Tensor v, Tensor rpb, Tensor ws, int kernel_size, int stride, "
    "bool sum_queries) -> (Tensor, Tensor)",
    lambda logits, v, rpb, ws, kernel_size, stride, sum_queries: _forward_outputs(
        v, _output_shapes(logits.shape, v.shape[-1], stride, sum_queries)))
_qna_backward_op = kernel_op(
    "qna_fused_backward", _backward,
    "(Tensor g, Tensor logits, Tensor v, Tensor rpb, Tensor ws, Tensor lse, int kernel_size, "
    "int stride, bool sum_queries) -> (Tensor, Tensor, Tensor)",
    lambda g, logits, v, rpb, *_: _backward_outputs(logits, v, rpb))


def _setup_context(ctx, inputs, output):
    logits, v, rpb, ws, kernel_size, stride, sum_queries = inputs
    ctx.save_for_backward(logits, v, rpb, ws, output[1])
    ctx.args = (kernel_size, stride, sum_queries)


def _grads(g, saved, args, geo=None):
    """The gradients of logits, v, rpb and window weights from the forward's saved tensors;
    ``geo``: the forward's :class:`_Geometry`, where it ran eagerly."""
    if eager(g):
        dlogits, dv, tables = _backward(g, *saved, *args, geo)
    else:  # traced: the op
        dlogits, dv, tables = _qna_backward_op(g, *saved, *args)
    return (dlogits, dv, *tables.unbind(0))


def _autograd_backward(ctx, g, _):
    return _grads(g, ctx.saved_tensors, ctx.args) + (None,) * 3


_qna_op.register_autograd(_autograd_backward, setup_context=_setup_context)


class _QnA(torch.autograd.Function):
    """The eager path (:func:`~attnzoo.kernels.eager`): the host code called directly."""

    @staticmethod
    def forward(ctx, logits, v, rpb, ws, kernel_size, stride, sum_queries):
        out, lse, ctx.geo = _forward(logits, v, rpb, ws, kernel_size, stride, sum_queries)
        ctx.save_for_backward(logits, v, rpb, ws, lse)
        ctx.args = (kernel_size, stride, sum_queries)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return _grads(g, ctx.saved_tensors, ctx.args, ctx.geo) + (None,) * 3


def qna_fused(logits: torch.Tensor, v: torch.Tensor, rpb: Optional[torch.Tensor],
              window_weights: Optional[torch.Tensor], kernel_size: int, stride: int,
              sum_queries: bool) -> torch.Tensor:
    """The ``cuda`` backend of ``qna2d``: arguments as :func:`attnzoo.ops.qna.qna2d_reference`
    (already validated). The rpb and window weights are used in float32, as the reference's
    compute dtype for half-precision inputs; their gradients come back in their own dtype."""
    if rpb is None or window_weights is None:
        shape = (*logits.shape[-2:], kernel_size, kernel_size)
        rpb = logits.new_zeros(shape) if rpb is None else rpb
        window_weights = logits.new_ones(shape) if window_weights is None else window_weights
    rpb, ws = rpb.float().contiguous(), window_weights.float().contiguous()
    if eager(logits):
        return _QnA.apply(logits, v, rpb, ws, kernel_size, stride, sum_queries)
    return _qna_op(logits, v, rpb, ws, kernel_size, stride, sum_queries)[0]
