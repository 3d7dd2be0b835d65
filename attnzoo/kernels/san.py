"""SAN's footprint ops (:mod:`attnzoo.ops.san`) fused in Triton: the ``cuda`` backend of
``san_subtraction``, ``san_subtraction2`` and ``san_aggregation``.

Semantics and layouts are those of the torch reference (module docstring of
:mod:`attnzoo.ops.san`): output ``(h, w)`` reads tap ``(i, j)`` at ``(h*s - p + i*d, w*s - p +
j*d)``, reflected (``nn.ReflectionPad2d``) or zero outside the map. Every kernel reads its taps
from the input directly, computing each tap's reflected index in registers: no padded copy, no
unfold, one launch per op and direction whatever the footprint (the reference aggregates tap by
tap, ``kh * kw`` launches).

A program owns a ``TH x TW`` tile of a block of up to ``MAX_BC`` channels of one sample
(:func:`~.tiling.program_tile`, :func:`~.tiling.tile_positions`, tiles innermost so that
neighbouring programs share their halos in L2): the channels share the tile's index arithmetic
(reflection, strides, which output reads which pixel). It loops over the footprint's taps;
products accumulate in fp32.

* forward: a tile of outputs, each tap gathered from the input;
* ``weight`` gradient of the aggregation: a tile of outputs of weight channel ``cw``, per tap
  the sum over the channels ``cw, cw + Cw, ...`` that share it (the interleaved sharing);
* input gradients: a tile of *input* pixels gathers, from every output whose footprint reads
  it, the gradient that output sends there (the transpose of the forward's gather; no atomics,
  so the result is deterministic). A pixel is read through its own position and, with
  reflection, through its mirror images across each border (``-r`` and ``2(H-1) - r`` per
  axis, where they fall inside the padding): up to 3 x 3 images, each tested per tile and
  skipped when no pixel of the tile has it (interior tiles visit one).
"""
from __future__ import annotations

import functools
from typing import List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import (KernelLimits, allocation, eager, kernel_op, launch_on_device,
               narrow_offsets, once_differentiable)
from .tiling import pow2, program_tile, tile_positions

__all__ = ["support", "not_supported_reasons", "call_reasons", "LIMITS",
           "san_subtraction_fused", "san_subtraction2_fused", "san_aggregation_fused"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LIMITS = KernelLimits("attnzoo's Triton SAN kernels", DTYPES, max_head_dim=0)
TILE = (4, 32)     # outputs or input pixels per program: a row of 32 reads 128 B of fp32
MAX_BC = 8         # channels per program: they share the tile's index arithmetic
NUM_WARPS = 4


# ---------------------------------------------------------------------------------------------
# index arithmetic
# ---------------------------------------------------------------------------------------------

@triton.jit
def _block_tile(channels, rows, cols, BC: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr):
    """Program -> its sample n (int64), its block of ``BC`` channels ``c`` (int64, ``[BC, 1]``)
    with their mask, and its tile's positions (y, x) (``[1, TH * TW]``) on a ``rows x cols``
    map with their mask."""
    plane, _, _, ty, tx = program_tile(tl.program_id(0), tl.cdiv(rows, TH), tl.cdiv(cols, TW),
                                       1, 1)
    blocks = tl.cdiv(channels, BC)
    c = (plane % blocks).to(tl.int64) * BC + tl.arange(0, BC)[:, None]
    y, x = tile_positions(ty, tx, TH, TW)
    return ((plane // blocks).to(tl.int64), c, c < channels, y[None, :], x[None, :],
            ((y < rows) & (x < cols))[None, :])


@triton.jit
def _tap_source(o, i, STRIDE: tl.constexpr, DIL: tl.constexpr, PAD: tl.constexpr, L,
                REFLECT: tl.constexpr):
    """Input position (along one axis) that tap ``i`` of output ``o`` reads, and whether it
    reads the map (always with reflection; zero padding reads 0 outside)."""
    u = o * STRIDE - PAD + i * DIL
    if REFLECT:
        u = tl.where(u < 0, -u, u)
        u = tl.where(u > L - 1, 2 * (L - 1) - u, u)
        return u, u == u
    return u, (u >= 0) & (u < L)


@triton.jit
def _mirror(r, a: tl.constexpr, L, PAD: tl.constexpr):
    """Image ``a`` of input position ``r`` in the padded axis: 0 itself, 1 across the start
    (``-r``, inside the padding if ``1 <= r <= PAD``), 2 across the end (``2(L-1) - r``)."""
    if a == 0:
        return r, r == r
    elif a == 1:
        return -r, (r >= 1) & (r <= PAD)
    else:
        return 2 * (L - 1) - r, (r <= L - 2) & (r >= L - 1 - PAD)


@triton.jit
def _output_of(u, i, STRIDE: tl.constexpr, DIL: tl.constexpr, PAD: tl.constexpr, Lo):
    """The output (along one axis) whose tap ``i`` reads padded position ``u``, and whether
    there is one (``o * STRIDE = u + PAD - i * DIL``, in range)."""
    n = u + PAD - i * DIL
    o = tl.where(n >= 0, n, 0) // STRIDE
    return o, (n >= 0) & (n % STRIDE == 0) & (o < Lo)


@triton.jit
def _gather_back(A, sat, sal, B, sby, sbx, y, x, mask, H, W, Ho, Wo,
                 KH: tl.constexpr, KW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                 SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
                 REFLECT: tl.constexpr, WEIGHTED: tl.constexpr, acc):
    """For input pixels (y, x) (``[1, P]``) of a block of channels (``A``, ``B``: their
    ``[BC, 1]`` bases; ``mask``: ``[BC, P]``): ``acc`` (fp32, ``[BC, P]``) plus the sum over
    every (tap t, output l) whose footprint reads the pixel of ``A[t * sat + l * sal]`` (times
    ``B`` at output l's (ho, wo) when ``WEIGHTED``)."""
    for a in tl.static_range(3 if REFLECT else 1):
        uy, vy = _mirror(y, a, H, PH)
        for b in tl.static_range(3 if REFLECT else 1):
            ux, vx = _mirror(x, b, W, PW)
            image = mask & vy & vx
            if tl.max(tl.max(image.to(tl.int32), 1), 0) > 0:  # most tiles have no border pixel
                for i in range(KH):
                    oy, ok_y = _output_of(uy, i, SH, DH, PH, Ho)
                    for j in range(KW):
                        ox, ok_x = _output_of(ux, j, SW, DW, PW, Wo)
                        ok = image & ok_y & ok_x
                        term = tl.load(A + (i * KW + j) * sat + (oy * Wo + ox) * sal, mask=ok,
                                       other=0.).to(tl.float32)
                        if WEIGHTED:
                            term *= tl.load(B + oy * sby + ox * sbx, mask=ok,
                                            other=0.).to(tl.float32)
                        acc += term
    return acc


@triton.jit
def _centre_sum(g, sgt, sgl, y, x, valid, Wo, KH: tl.constexpr, KW: tl.constexpr,
                SH: tl.constexpr, SW: tl.constexpr):
    """Per input pixel (y, x): the sum of ``g`` over the taps of the output centred there (if
    any), in fp32."""
    centred = valid & (y % SH == 0) & (x % SW == 0)
    l = (y // SH) * Wo + x // SW
    acc = tl.zeros(valid.shape, tl.float32)
    for t in range(KH * KW):
        acc += tl.load(g + t * sgt + l * sgl, mask=centred, other=0.).to(tl.float32)
    return acc


# ---------------------------------------------------------------------------------------------
# kernels (outputs and input gradients contiguous; inputs through their strides)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _subtraction_fwd_kernel(
        X1, X2, OUT, sxn, sxc, sxy, sxx, C, H, W, Ho, Wo,
        KH: tl.constexpr, KW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
        SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
        REFLECT: tl.constexpr, BC: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr):
    """``OUT[n, c, t, l] = X1[n, c, centre(l)] - X2[n, c, tap_t(l)]``."""
    n, c, c_ok, oy, ox, inside = _block_tile(C, Ho, Wo, BC, TH, TW)
    valid = c_ok & inside
    base = n * sxn + c * sxc
    centre = tl.load(X1 + base + (oy * SH) * sxy + (ox * SW) * sxx, mask=valid,
                     other=0.).to(tl.float32)
    out = OUT + (n * C + c) * (KH * KW) * Ho * Wo + oy * Wo + ox
    for i in range(KH):
        iy, in_y = _tap_source(oy, i, SH, DH, PH, H, REFLECT)
        for j in range(KW):
            ix, in_x = _tap_source(ox, j, SW, DW, PW, W, REFLECT)
            tap = tl.load(X2 + base + iy * sxy + ix * sxx, mask=valid & in_y & in_x,
                          other=0.).to(tl.float32)
            tl.store(out + (i * KW + j) * Ho * Wo, (centre - tap).to(OUT.dtype.element_ty),
                     mask=valid)


@triton.jit
def _subtraction_bwd_kernel(
        G, DX1, DX2, sgn, sgc, sgt, sgl, C, H, W, Ho, Wo,
        KH: tl.constexpr, KW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
        SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
        REFLECT: tl.constexpr, SAME: tl.constexpr, BC: tl.constexpr, TH: tl.constexpr,
        TW: tl.constexpr):
    """Per input pixel: ``DX1`` = the sum of G over the taps of the output centred there (if
    any), ``DX2`` = minus the sum of G over every (tap, output) reading it; ``SAME`` (one input,
    ``san_subtraction``): their sum, into DX1."""
    n, c, c_ok, y, x, inside = _block_tile(C, H, W, BC, TH, TW)
    valid = c_ok & inside
    g = G + n * sgn + c * sgc
    pixel = (n * C + c) * H * W + y * W + x
    # (the order of the two sums in each branch is the one ptxas spills nothing in, with
    # Triton 3.6 and 3.8: scripts/compile_kernels.py)
    if SAME:  # one accumulator: dx1 - (the gathered sum), summed from -dx1 and negated
        dx1 = _centre_sum(g, sgt, sgl, y, x, valid, Wo, KH, KW, SH, SW)
        dx = -_gather_back(g, sgt, sgl, g, 0, 0, y, x, valid, H, W, Ho, Wo, KH, KW, DH, DW, SH,
                           SW, PH, PW, REFLECT, False, -dx1)
        tl.store(DX1 + pixel, dx.to(DX1.dtype.element_ty), mask=valid)
    else:
        dx2 = -_gather_back(g, sgt, sgl, g, 0, 0, y, x, valid, H, W, Ho, Wo, KH, KW, DH, DW, SH,
                            SW, PH, PW, REFLECT, False, tl.zeros(valid.shape, tl.float32))
        dx1 = _centre_sum(g, sgt, sgl, y, x, valid, Wo, KH, KW, SH, SW)
        tl.store(DX1 + pixel, dx1.to(DX1.dtype.element_ty), mask=valid)
        tl.store(DX2 + pixel, dx2.to(DX2.dtype.element_ty), mask=valid)


@triton.jit
def _aggregation_fwd_kernel(
        X, WGT, OUT, sxn, sxc, sxy, sxx, swn, swc, swt, swl, C, Cw, H, W, Ho, Wo,
        KH: tl.constexpr, KW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
        SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
        REFLECT: tl.constexpr, BC: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr):
    """``OUT[n, c, ho, wo] = sum_t WGT[n, c % Cw, t, l] * X[n, c, tap_t(l)]``."""
    n, c, c_ok, oy, ox, inside = _block_tile(C, Ho, Wo, BC, TH, TW)
    valid = c_ok & inside
    x = X + n * sxn + c * sxc
    w = WGT + n * swn + (c % Cw) * swc + (oy * Wo + ox) * swl
    acc = tl.zeros(valid.shape, tl.float32)
    for i in range(KH):
        iy, in_y = _tap_source(oy, i, SH, DH, PH, H, REFLECT)
        for j in range(KW):
            ix, in_x = _tap_source(ox, j, SW, DW, PW, W, REFLECT)
            tap = tl.load(x + iy * sxy + ix * sxx, mask=valid & in_y & in_x, other=0.)
            acc += tl.load(w + (i * KW + j) * swt, mask=valid, other=0.).to(tl.float32) * \
                tap.to(tl.float32)
    tl.store(OUT + (n * C + c) * Ho * Wo + oy * Wo + ox, acc.to(OUT.dtype.element_ty),
             mask=valid)


@triton.jit
def _aggregation_bwd_weight_kernel(
        X, GO, DWGT, sxn, sxc, sxy, sxx, sgn, sgc, sgy, sgx, C, Cw, H, W, Ho, Wo,
        KH: tl.constexpr, KW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
        SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
        REFLECT: tl.constexpr, BC: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr):
    """``DWGT[n, cw, t, l] = sum_{c = cw mod Cw} GO[n, c, l] * X[n, c, tap_t(l)]``: a block of
    weight channels cw."""
    n, cw, c_ok, oy, ox, inside = _block_tile(Cw, Ho, Wo, BC, TH, TW)
    valid = c_ok & inside
    out = DWGT + (n * Cw + cw) * (KH * KW) * Ho * Wo + oy * Wo + ox
    for i in range(KH):
        iy, in_y = _tap_source(oy, i, SH, DH, PH, H, REFLECT)
        for j in range(KW):
            ix, in_x = _tap_source(ox, j, SW, DW, PW, W, REFLECT)
            acc = tl.zeros(valid.shape, tl.float32)
            for g in range(0, C // Cw):
                c = g * Cw + cw
                go = tl.load(GO + n * sgn + c * sgc + oy * sgy + ox * sgx, mask=valid, other=0.)
                tap = tl.load(X + n * sxn + c * sxc + iy * sxy + ix * sxx,
                              mask=valid & in_y & in_x, other=0.)
                acc += go.to(tl.float32) * tap.to(tl.float32)
            tl.store(out + (i * KW + j) * Ho * Wo, acc.to(DWGT.dtype.element_ty), mask=valid)


@triton.jit
def _aggregation_bwd_input_kernel(
        WGT, GO, DX, swn, swc, swt, swl, sgn, sgc, sgy, sgx, C, Cw, H, W, Ho, Wo,
        KH: tl.constexpr, KW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
        SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
        REFLECT: tl.constexpr, BC: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr):
    """``DX[n, c, p] = sum over (t, l) reading p of WGT[n, c % Cw, t, l] * GO[n, c, l]``."""
    n, c, c_ok, y, x, inside = _block_tile(C, H, W, BC, TH, TW)
    valid = c_ok & inside
    dx = _gather_back(WGT + n * swn + (c % Cw) * swc, swt, swl, GO + n * sgn + c * sgc, sgy, sgx,
                      y, x, valid, H, W, Ho, Wo, KH, KW, DH, DW, SH, SW, PH, PW, REFLECT, True,
                      tl.zeros(valid.shape, tl.float32))
    tl.store(DX + (n * C + c) * H * W + y * W + x, dx.to(DX.dtype.element_ty), mask=valid)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------

def not_supported_reasons(device: str, dtype: torch.dtype) -> List[str]:
    """Every reason these kernels cannot run a call on ``device`` ("cuda:1", "cpu") in
    ``dtype``, empty if none. Any footprint, dilation, stride and padding mode the ops accept
    is supported, and they hold nothing in shared memory."""
    return LIMITS.reasons(device, dtype, ())


def call_reasons(dtype: torch.dtype) -> List[str]:
    """The reasons of :func:`not_supported_reasons` that the call alone decides, on any
    machine (its dtype), empty if none."""
    return LIMITS.call_reasons(dtype, ())


def support(device: str, dtype: torch.dtype) -> Optional[str]:
    """``None`` if these kernels can run such a call, else every reason why not."""
    return "; ".join(not_supported_reasons(device, dtype)) or None


@functools.lru_cache(maxsize=1024)
def _geometry(fp, channels: int) -> dict:
    """The launch's constexprs (``fp``: :class:`attnzoo.ops.san.Footprint`; ``channels``:
    those the grid's channel blocks cover); computed once per call key, read only."""
    (KH, KW), (DH, DW), (SH, SW), (PH, PW) = fp.kernel_size, fp.dilation, fp.stride, fp.padding
    return dict(KH=KH, KW=KW, DH=DH, DW=DW, SH=SH, SW=SW, PH=PH, PW=PW,
                REFLECT=fp.padding_mode == "reflect", BC=min(MAX_BC, pow2(channels, 1)),
                TH=TILE[0], TW=TILE[1], num_warps=NUM_WARPS)


def _grid(N: int, channels: int, rows: int, cols: int) -> tuple:
    blocks = -(-channels // min(MAX_BC, pow2(channels, 1)))
    return (N * blocks * -(-rows // TILE[0]) * -(-cols // TILE[1]),)


def _out_size(fp, H: int, W: int):
    return (H - 1) // fp.stride[0] + 1, (W - 1) // fp.stride[1] + 1


# What each pass returns, allocated here for the kernels and for the custom ops' fake
# implementations alike, so that a compiled graph is told the very sizes, strides and dtypes the
# kernels return: every output contiguous, whatever the inputs' strides. ``new(like, shape)``:
# ``like.new_empty(shape)`` in a trace (sizes symbolic), _new for the kernels.

def _new(like: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``like.new_empty(shape)``, contiguous, through kernels.allocation (cached per shape: on
    meta tensors ``new_empty`` is a Python meta function)."""
    return allocation(shape, like.dtype, like.device)()


def _output(x, fp, channels: int, taps: int = 0, new=_new):
    """An output of ``x``'s batch on ``fp``'s output grid: [N, channels, taps, Ho * Wo], or
    [N, channels, Ho, Wo] without taps."""
    N, _, H, W = x.shape
    Ho, Wo = _out_size(fp, H, W)
    return new(x, (N, channels, taps, Ho * Wo) if taps else (N, channels, Ho, Wo))


def _subtraction_grads_out(g, shape, same: bool, new=_new):
    """dx1, and dx2 (empty with ``same``: the kernel sums both gradients into dx1)."""
    return new(g, shape), new(g, (0,) if same else shape)


def _aggregation_grads_out(x, weight, x_grad: bool, weight_grad: bool, new=_new):
    """dx and dweight, each empty where not asked for."""
    return new(x, x.shape if x_grad else (0,)), new(weight, weight.shape if weight_grad else (0,))


def _traced(like: torch.Tensor, shape: tuple) -> torch.Tensor:
    return like.new_empty(shape)


def _subtraction_forward(x1, x2, fp):
    N, C, H, W = x1.shape
    Ho, Wo = _out_size(fp, H, W)
    out = _output(x1, fp, C, fp.taps)
    if x1.stride() != x2.stride():  # the kernel addresses both with one set of strides
        x1, x2 = x1.contiguous(), x2.contiguous()
    launch_on_device(_subtraction_fwd_kernel, _grid(N, C, Ho, Wo), x1, x2, out, *x1.stride(),
                     C, H, W, Ho, Wo, **_geometry(fp, C))
    return out


def _subtraction_backward(g, shape, fp, same: bool):
    g = narrow_offsets(g)
    N, C, H, W = shape
    Ho, Wo = _out_size(fp, H, W)
    dx1, dx2 = _subtraction_grads_out(g, shape, same)
    launch_on_device(_subtraction_bwd_kernel, _grid(N, C, H, W), g, dx1, dx1 if same else dx2,
                     *g.stride(), C, H, W, Ho, Wo, SAME=same, **_geometry(fp, C))
    return dx1, dx2


def _aggregation_forward(x, weight, fp):
    N, C, H, W = x.shape
    Ho, Wo = _out_size(fp, H, W)
    out = _output(x, fp, C)
    launch_on_device(_aggregation_fwd_kernel, _grid(N, C, Ho, Wo), x, weight, out, *x.stride(),
                     *weight.stride(), C, weight.shape[1], H, W, Ho, Wo, **_geometry(fp, C))
    return out


def _aggregation_backward(go, x, weight, fp, x_grad: bool, weight_grad: bool):
    """(dx, dweight), each empty where not asked for."""
    go = narrow_offsets(go)
    N, C, H, W = x.shape
    Cw = weight.shape[1]
    Ho, Wo = _out_size(fp, H, W)
    dx, dw = _aggregation_grads_out(x, weight, x_grad, weight_grad)  # dw [N, Cw, taps, Ho * Wo]
    if weight_grad:
        launch_on_device(_aggregation_bwd_weight_kernel, _grid(N, Cw, Ho, Wo), x, go, dw,
                         *x.stride(), *go.stride(), C, Cw, H, W, Ho, Wo, **_geometry(fp, Cw))
    if x_grad:
        launch_on_device(_aggregation_bwd_input_kernel, _grid(N, C, H, W), weight, go, dx,
                         *weight.stride(), *go.stride(), C, Cw, H, W, Ho, Wo, **_geometry(fp, C))
    return dx, dw


# The passes as custom ops (kernels.kernel_op), forward and backward.
# A footprint travels as its fields (custom ops take plain types).

class _Footprint(NamedTuple):  # the fields of attnzoo.ops.san.Footprint these kernels read
    kernel_size: Tuple[int, int]
    dilation: Tuple[int, int]
    stride: Tuple[int, int]
    padding_mode: str
    padding: Tuple[int, int]
    taps: int


_FOOTPRINT = "int[] kernel_size, int[] dilation, int[] stride, str padding_mode, int[] padding"


def _footprint(kernel_size, dilation, stride, padding_mode, padding) -> _Footprint:
    return _Footprint(tuple(kernel_size), tuple(dilation), tuple(stride), padding_mode,
                      tuple(padding), kernel_size[0] * kernel_size[1])


def _fields(fp) -> tuple:
    return (list(fp.kernel_size), list(fp.dilation), list(fp.stride), fp.padding_mode,
            list(fp.padding))


def _subtraction_impl(x1, x2, *footprint):
    return _subtraction_forward(x1, x1 if x2 is None else x2, _footprint(*footprint))


def _subtraction_backward_impl(g, shape, same, *footprint):
    return _subtraction_backward(g, tuple(shape), _footprint(*footprint), same)


def _subtraction_fake(x1, x2, *footprint):
    fp = _footprint(*footprint)
    return _output(x1, fp, x1.shape[1], fp.taps, _traced)


_subtraction_op = kernel_op("san_subtraction_fused", _subtraction_impl,
                            f"(Tensor x1, Tensor? x2, {_FOOTPRINT}) -> Tensor", _subtraction_fake)
_subtraction_backward_op = kernel_op(
    "san_subtraction_fused_backward", _subtraction_backward_impl,
    f"(Tensor g, int[] shape, bool same, {_FOOTPRINT}) -> (Tensor, Tensor)",
    lambda g, shape, same, *_: _subtraction_grads_out(g, shape, same, _traced))


def _subtraction_setup(ctx, inputs, output):
    x1, x2, *footprint = inputs
    ctx.args = (list(x1.shape), x2 is None, *footprint)


def _subtraction_grads(ctx, g):
    backward = _subtraction_backward_impl if eager(g) else _subtraction_backward_op  # traced: op
    dx1, dx2 = backward(g, *ctx.args)
    return (dx1, None if ctx.args[1] else dx2) + (None,) * 5


_subtraction_op.register_autograd(_subtraction_grads, setup_context=_subtraction_setup)


def _aggregation_impl(x, weight, *footprint):
    return _aggregation_forward(x, weight, _footprint(*footprint))


def _aggregation_backward_impl(go, x, weight, x_grad, weight_grad, *footprint):
    return _aggregation_backward(go, x, weight, _footprint(*footprint), x_grad, weight_grad)


_aggregation_op = kernel_op(
    "san_aggregation_fused", _aggregation_impl,
    f"(Tensor x, Tensor weight, {_FOOTPRINT}) -> Tensor",
    lambda x, weight, *footprint: _output(x, _footprint(*footprint), x.shape[1],
                                          new=_traced))
_aggregation_backward_op = kernel_op(
    "san_aggregation_fused_backward", _aggregation_backward_impl,
    f"(Tensor go, Tensor x, Tensor weight, bool x_grad, bool weight_grad, {_FOOTPRINT}) "
    "-> (Tensor, Tensor)",
    lambda go, x, weight, x_grad, weight_grad, *_: _aggregation_grads_out(
        x, weight, x_grad, weight_grad, _traced))


def _aggregation_setup(ctx, inputs, output):
    x, weight, *footprint = inputs
    ctx.save_for_backward(x, weight)
    ctx.footprint = footprint


def _aggregation_grads(ctx, go):
    need_x, need_w = ctx.needs_input_grad[:2]
    backward = _aggregation_backward_impl if eager(go) else _aggregation_backward_op
    dx, dw = backward(go, *ctx.saved_tensors, need_x, need_w, *ctx.footprint)
    return (dx if need_x else None, dw if need_w else None) + (None,) * 5


_aggregation_op.register_autograd(_aggregation_grads, setup_context=_aggregation_setup)


# The eager paths (kernels.eager): the host code called directly, without the custom ops'
# dispatch; their setup and backward are the ops'.

class _Subtraction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1, x2, *footprint):
        _subtraction_setup(ctx, (x1, x2, *footprint), None)
        return _subtraction_impl(x1, x2, *footprint)

    # (the kernels' gradients have no graph: a double backward raises)
    backward = staticmethod(once_differentiable(_subtraction_grads))


class _Aggregation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, *footprint):
        _aggregation_setup(ctx, (x, weight, *footprint), None)
        return _aggregation_impl(x, weight, *footprint)

    backward = staticmethod(once_differentiable(_aggregation_grads))


def san_subtraction_fused(x, fp):
    """The ``cuda`` backend of ``san_subtraction`` (arguments validated by the op)."""
    return san_subtraction2_fused(x, None, fp)


def san_subtraction2_fused(x1, x2, fp):
    """The ``cuda`` backend of ``san_subtraction2``."""
    if eager(x1):
        return _Subtraction.apply(x1, x2, *_fields(fp))
    return _subtraction_op(x1, x2, *_fields(fp))


def san_aggregation_fused(x, weight, fp):
    """The ``cuda`` backend of ``san_aggregation``."""
    if eager(x):
        return _Aggregation.apply(x, weight, *_fields(fp))
    return _aggregation_op(x, weight, *_fields(fp))
