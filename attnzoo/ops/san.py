"""SAN's local vector-attention primitives (Zhao, Jia, Koltun, CVPR 2020), with backend dispatch.

Footprint: output ``(h, w)`` of a ``k x k`` footprint with dilation ``d`` and stride ``s`` taps the
input at ``(h*s - p + kh*d, w*s - p + kw*d)``, ``p = d * (k - 1) // 2`` (per axis), tap index
``kk = kh * k_w + kw`` (``k_w`` the footprint's width); so the centre tap reads ``(h*s, w*s)``,
never padded, and the output map is ``ceil(H / s) x ceil(W / s)`` (``L = Ho * Wo`` positions).
Taps outside the map are *reflected* like ``nn.ReflectionPad2d`` (``-i`` below 0, ``2(H-1) - i``
beyond the end; the edge is not repeated), which needs ``p < H`` and ``p < W``;
``padding_mode='zeros'`` reads zeros there instead (the official code's ``pad_mode=0``).

Layouts (the official CUDA ops', which the SAM's 1x1 convs work on directly):

* :func:`san_subtraction` ``x [N, C, H, W] -> [N, C, kk, L]``: ``x(centre) - x(tap)``. SAN's
  relative position encoding.
* :func:`san_subtraction2` ``x1, x2 [N, C, H, W] -> [N, C, kk, L]``: ``x1(centre) - x2(tap)``.
  SAN's subtraction relation ``phi(x_i) - psi(x_j)``.
* :func:`san_aggregation` ``x [N, C, H, W]``, ``weight [N, Cw, kk, L] -> [N, C, Ho, Wo]``:
  ``y_c(i) = sum_j weight_{c mod Cw}(i, j) * x_c(j)``: the weights are shared *interleaved*
  (channel ``c`` uses weight channel ``c % Cw``, not ``c // (C / Cw)``).

The torch reference (any device and float dtype, differentiable) gathers the footprint with
``F.unfold`` for the subtractions, whose outputs are ``kk``-times larger than their inputs
anyway, and aggregates tap by tap over shifted views of the padded input, forward and (a
hand-written autograd Function) backward, so it never builds the ``kk``-times larger unfolded
copy of ``x``; under torch.compile those loops are custom ops (one opaque call each way), and
without autograd the aggregation is the unfolded product, which Inductor fuses. NATTEN has no
such ops. The ``cuda`` backend is attnzoo's fused Triton kernels (:mod:`attnzoo.kernels.san`):
one launch per op and direction, each tap read from the input directly; ``auto`` takes them
only on GPU architectures where they were verified.

MACs (:func:`attnzoo.profiling.count_macs`): the aggregation ``N * C * L * kk`` multiply-adds,
the subtractions one per output element (as SAN's official counter counts them).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .. import backends, kernels
from ._args import as_ints

__all__ = ["san_aggregation", "san_subtraction", "san_subtraction2", "san_neighbours",
           "PADDING_MODES"]

IntOrPair = Union[int, Sequence[int]]
PADDING_MODES = ("reflect", "zeros")


# --------------------------------------------------------------------------------------------
# argument checking
# --------------------------------------------------------------------------------------------

def _pair(value: IntOrPair, name: str, fn: str) -> Tuple[int, int]:
    ints = as_ints(value, 2)  # (NumPy integers too)
    if ints is not None:
        return ints
    raise TypeError(f"{fn}: {name} must be an int or a pair of ints, got {value!r}")


def _check_map(fn: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{fn}: {name} must be a 4-D NCHW map [N, C, H, W], got shape "
                         f"{tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{fn}: {name} must be a floating-point tensor, got {t.dtype}")
    if 0 in t.shape[1:]:
        raise ValueError(f"{fn}: only the batch of {name} may be empty (C, H, W >= 1), got shape "
                         f"{tuple(t.shape)}")
    return t


class Footprint(NamedTuple):
    # plain fields, no properties or methods: torch 2.4's Dynamo cannot trace those on a tuple
    kernel_size: Tuple[int, int]
    dilation: Tuple[int, int]
    stride: Tuple[int, int]
    padding_mode: str
    padding: Tuple[int, int]   # dilation * (kernel_size - 1) // 2 per axis
    taps: int                  # kh * kw


def _out_size(fp: Footprint, H: int, W: int) -> Tuple[int, int]:
    return (H - 1) // fp.stride[0] + 1, (W - 1) // fp.stride[1] + 1


def _footprint_of(kernel_size, dilation, stride, padding_mode) -> Footprint:
    """The footprint of validated (or schema-typed: lists) arguments."""
    ks, dil = tuple(kernel_size), tuple(dilation)
    return Footprint(ks, dil, tuple(stride), padding_mode,
                     tuple(d * (k - 1) // 2 for k, d in zip(ks, dil)), ks[0] * ks[1])


def _footprint(fn: str, x: torch.Tensor, kernel_size, dilation, stride,
               padding_mode) -> Footprint:
    ks = _pair(kernel_size, "kernel_size", fn)
    dil = _pair(dilation, "dilation", fn)
    st = _pair(stride, "stride", fn)
    if any(k < 1 or k % 2 == 0 for k in ks):
        raise ValueError(f"{fn}: kernel_size must be odd and >= 1 (the footprint is centred on "
                         f"the output position), got {kernel_size!r}")
    if min(dil) < 1:
        raise ValueError(f"{fn}: dilation must be >= 1, got {dilation!r}")
    if min(st) < 1:
        raise ValueError(f"{fn}: stride must be >= 1, got {stride!r}")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"{fn}: padding_mode must be one of {PADDING_MODES}, got "
                         f"{padding_mode!r}")
    fp = _footprint_of(ks, dil, st, padding_mode)
    H, W = x.shape[-2:]
    if padding_mode == "reflect" and (fp.padding[0] >= H or fp.padding[1] >= W):
        raise ValueError(
            f"{fn}: reflection padding by dilation * (kernel_size - 1) / 2 = {fp.padding} needs "
            f"a map larger than that on both axes (at least {fp.padding[0] + 1}x"
            f"{fp.padding[1] + 1}), got {H}x{W}; use a larger input or padding_mode='zeros'")
    return fp


def _same(fn: str, a: torch.Tensor, b: torch.Tensor, names: str) -> None:
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"{fn}: {names} must share dtype and device; got {a.dtype} on "
                         f"{a.device} and {b.dtype} on {b.device}")


# --------------------------------------------------------------------------------------------
# torch reference
# --------------------------------------------------------------------------------------------

def _cpu_half_reflection() -> bool:
    try:  # torch < 2.5 has no float16 reflection padding on CPU
        F.pad(torch.zeros(1, 1, 2, 2, dtype=torch.float16), (1, 1, 1, 1), mode="reflect")
        return True
    except RuntimeError:
        return False


_CPU_HALF_REFLECTION = _cpu_half_reflection()


def _reflect_in_float32(x: torch.Tensor) -> bool:
    return (not _CPU_HALF_REFLECTION and x.dtype == torch.float16
            and x.device.type == "cpu")


def _reflection_index(H: int, W: int, fp: Footprint, device: torch.device) -> torch.Tensor:
    """The reflection-padded map's positions as positions of the row-major flattened map,
    ``[(H + 2 ph) * (W + 2 pw)]``."""
    def axis(n, p):
        return _reflected(torch.arange(-p, n + p, device=device), n)
    return (axis(H, fp.padding[0]).view(-1, 1) * W + axis(W, fp.padding[1])).reshape(-1)


def _deterministic_reflection(fp: Footprint) -> bool:
    # F.pad's reflection has no deterministic backward on CUDA (torch refuses it under
    # torch.use_deterministic_algorithms); a gather's backward (index_add) has one
    return fp.padding_mode == "reflect" and torch.are_deterministic_algorithms_enabled()


def _pad(x: torch.Tensor, fp: Footprint) -> torch.Tensor:
    ph, pw = fp.padding
    if fp.padding_mode != "reflect":
        return F.pad(x, (pw, pw, ph, ph))
    if _deterministic_reflection(fp):
        N, C, H, W = x.shape
        index = _reflection_index(H, W, fp, x.device)
        return x.flatten(2).index_select(2, index).view(N, C, H + 2 * ph, W + 2 * pw)
    if _reflect_in_float32(x):
        return F.pad(x.float(), (pw, pw, ph, ph), mode="reflect").to(x.dtype)
    return F.pad(x, (pw, pw, ph, ph), mode="reflect")


def _centre(x: torch.Tensor, fp: Footprint) -> torch.Tensor:
    """``x`` at every output position's centre tap, ``[N, C, 1, L]``."""
    sh, sw = fp.stride
    # no slice at stride 1: an exported graph would keep it (two slice nodes, each some ten
    # ONNX nodes of shape arithmetic before the optimizer folds them)
    centre = x if sh == sw == 1 else x[:, :, ::sh, ::sw]
    return centre.reshape(x.shape[0], x.shape[1], 1, centre.shape[-2] * centre.shape[-1])


def footprint_positions(n, n_out, kernel_size: int, dilation: int, stride: int, reflect: bool,
                        device: torch.device) -> torch.Tensor:
    """One axis of the footprint: the ``kernel_size`` tap positions of each of ``n_out`` output
    positions on an axis of ``n``, ``[kernel_size, n_out]``; reflected at the borders as
    ``F.pad``'s reflection (``-1 -> 1``, ``n -> n - 2``) or, for zero padding, as they are (some
    outside ``[0, n)``). Tensor ops of the sizes only."""
    pos = torch.arange(kernel_size, device=device).view(-1, 1) * dilation \
        - dilation * (kernel_size - 1) // 2 + torch.arange(n_out, device=device) * stride
    return _reflected(pos, n) if reflect else pos


def _reflected(pos: torch.Tensor, n: int) -> torch.Tensor:
    """Positions on an axis of ``n`` reflected into it as ``F.pad``'s reflection does (``-1 ->
    1``, ``n -> n - 2``; within one reflection of the ends)."""
    pos = pos.abs()
    return torch.where(pos > n - 1, 2 * (n - 1) - pos, pos)


def _footprint_index(H, W, fp: Footprint, device: torch.device) -> torch.Tensor:
    """Every output position's footprint as positions of the row-major flattened map,
    ``[kk * Ho * Wo]`` (tap-major, as ``F.unfold``'s rows); reflected at the borders, or with
    ``'zeros'`` padding one position in front that reads 0 (index 0), the map's after it.
    Tensor ops of the sizes only, so an exported graph derives it from the input's shape."""
    reflect = fp.padding_mode == "reflect"
    (kh, kw), (dh, dw), (sh, sw) = fp.kernel_size, fp.dilation, fp.stride
    Ho, Wo = _out_size(fp, H, W)
    y = footprint_positions(H, Ho, kh, dh, sh, reflect, device).view(kh, 1, -1, 1)
    x = footprint_positions(W, Wo, kw, dw, sw, reflect, device).view(1, kw, 1, -1)
    flat = y * W + x                                                         # [kh, kw, Ho, Wo]
    if not reflect:
        flat = torch.where((y >= 0) & (y < H) & (x >= 0) & (x < W), flat + 1, 0)
    return flat.reshape(-1)


def _neighbours(x: torch.Tensor, fp: Footprint) -> torch.Tensor:
    """Every output position's footprint of ``x``, ``[N, C, kk, L]``.

    While exporting: one ``index_select`` of the flattened map (:func:`_footprint_index`, once
    per size in a torch.export trace: :func:`attnzoo.backends.export_memo`), where ``F.unfold``
    is some 35 ONNX nodes per call for the dynamo exporter to translate and optimize."""
    # (is_scripting() first: TorchScript compiles neither the check nor the export branch)
    if not torch.jit.is_scripting():
        if backends.exporting():
            index = backends.export_memo(("san", x.shape[2], x.shape[3], fp, x.device), x,
                                         _footprint_index, x.shape[2], x.shape[3], fp, x.device)
            flat = x.flatten(2)
            if fp.padding_mode != "reflect":
                flat = F.pad(flat, (1, 0))
            return flat.index_select(2, index).unflatten(2, (fp.taps, -1))
    cols = F.unfold(_pad(x, fp), fp.kernel_size, dilation=fp.dilation, stride=fp.stride)
    return cols.view(x.shape[0], x.shape[1], fp.taps, cols.shape[-1])


def subtraction_reference(x: torch.Tensor, fp: Footprint) -> torch.Tensor:
    return _centre(x, fp) - _neighbours(x, fp)


def subtraction2_reference(x1: torch.Tensor, x2: torch.Tensor, fp: Footprint) -> torch.Tensor:
    return _centre(x1, fp) - _neighbours(x2, fp)


def _taps(fp: Footprint, Ho: int, Wo: int):
    """Per tap ``kk``: the slices of the padded map that tap reads for every output position."""
    (kh_size, kw_size), (dh, dw), (sh, sw) = fp.kernel_size, fp.dilation, fp.stride
    for kh in range(kh_size):
        for kw in range(kw_size):
            yield kh * kw_size + kw, (slice(kh * dh, kh * dh + (Ho - 1) * sh + 1, sh),
                                      slice(kw * dw, kw * dw + (Wo - 1) * sw + 1, sw))


def _aggregate(x: torch.Tensor, weight: torch.Tensor, fp: Footprint) -> torch.Tensor:
    """The aggregation tap by tap over strided views of the padded input: no ``kk``-times
    larger unfolded copy of ``x``. Channel ``c = g * Cw + cw`` uses weight ``cw``."""
    N, C, H, W = x.shape
    Cw = weight.shape[1]
    Ho, Wo = _out_size(fp, H, W)
    xp = _pad(x, fp)
    xp = xp.reshape(N, C // Cw, Cw, *xp.shape[-2:])
    w = weight.reshape(N, 1, Cw, fp.taps, Ho, Wo)
    out = torch.zeros(N, C // Cw, Cw, Ho, Wo, dtype=x.dtype, device=x.device)
    for t, (rows, cols) in _taps(fp, Ho, Wo):
        out.addcmul_(w[:, :, :, t], xp[..., rows, cols])
    return out.view(N, C, Ho, Wo)


def _aggregate_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        fp: Footprint, need_x: bool = True, need_weight: bool = True):
    """``(grad_x, grad_weight)`` tap by tap (None where not needed), in differentiable ops
    (double backward works): autograd through the strided views would allocate a full-size
    gradient per tap."""
    N, C, H, W = x.shape
    Cw = weight.shape[1]
    Ho, Wo = _out_size(fp, H, W)
    ph, pw = fp.padding
    go = grad_out.reshape(N, C // Cw, Cw, Ho, Wo)
    grad_x = grad_w = None
    if need_weight:
        xp = _pad(x, fp)
        xp = xp.reshape(N, C // Cw, Cw, *xp.shape[-2:])
        grad_w = weight.new_empty(N, Cw, fp.taps, Ho, Wo)
        for t, (rows, cols) in _taps(fp, Ho, Wo):
            grad_w[:, :, t] = (go * xp[..., rows, cols]).sum(1)
        grad_w = grad_w.view(weight.shape)
    if need_x:
        w = weight.reshape(N, 1, Cw, fp.taps, Ho, Wo)
        gxp = x.new_zeros(N, C // Cw, Cw, H + 2 * ph, W + 2 * pw)
        for t, (rows, cols) in _taps(fp, Ho, Wo):
            gxp[..., rows, cols].addcmul_(w[:, :, :, t], go)
        gxp = gxp.view(N, C, H + 2 * ph, W + 2 * pw)
        if _deterministic_reflection(fp):  # fold the reflected taps back onto their sources
            grad_x = x.new_zeros(N, C, H * W).index_add_(
                2, _reflection_index(H, W, fp, x.device), gxp.flatten(2)).view(N, C, H, W)
        elif fp.padding_mode == "reflect":
            if _reflect_in_float32(x):
                grad_x = torch.ops.aten.reflection_pad2d_backward(
                    gxp.float(), x.float(), [pw, pw, ph, ph]).to(x.dtype)
            else:
                grad_x = torch.ops.aten.reflection_pad2d_backward(gxp, x, [pw, pw, ph, ph])
        else:
            grad_x = gxp[:, :, ph:ph + H, pw:pw + W]
    return grad_x, grad_w


class _Aggregation(torch.autograd.Function):
    """Eager autograd: the tap loops forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, fp: Footprint) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.fp = fp
        return _aggregate(x, weight, fp)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        return _aggregate_backward(grad_out, x, weight, ctx.fp, *ctx.needs_input_grad[:2]) + (
            None,)


# The same loops as custom ops, for torch.compile with autograd: Dynamo and AOT autograd see one
# opaque call each way instead of tracing kh*kw ops per call forward and backward (san10's first
# compiled training step took 6x swin_tiny's). Their backward is not differentiable again.
_FOOTPRINT_SCHEMA = "int[] kernel_size, int[] dilation, int[] stride, str padding_mode"


_aggregation_op = torch.library.custom_op(
    "attnzoo::san_aggregation_reference",
    lambda x, weight, *fp: _aggregate(x, weight, _footprint_of(*fp)), mutates_args=(),
    schema=f"(Tensor x, Tensor weight, {_FOOTPRINT_SCHEMA}) -> Tensor")
_aggregation_backward_op = torch.library.custom_op(
    "attnzoo::san_aggregation_reference_backward",
    lambda grad, x, weight, *fp: tuple(
        g.contiguous() for g in _aggregate_backward(grad, x, weight, _footprint_of(*fp))),
    mutates_args=(),
    schema=f"(Tensor grad, Tensor x, Tensor weight, {_FOOTPRINT_SCHEMA}) -> (Tensor, Tensor)")


@_aggregation_op.register_fake
def _(x, weight, kernel_size, dilation, stride, padding_mode):
    Ho, Wo = _out_size(_footprint_of(kernel_size, dilation, stride, padding_mode), *x.shape[-2:])
    return x.new_empty(x.shape[0], x.shape[1], Ho, Wo)


@_aggregation_backward_op.register_fake
def _(grad, x, weight, *fp):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _aggregation_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:2])
    ctx.fp = inputs[2:]


def _aggregation_autograd(ctx, grad):
    return _aggregation_backward_op(grad, *ctx.saved_tensors, *ctx.fp) + (None,) * 4


_aggregation_op.register_autograd(_aggregation_autograd, setup_context=_aggregation_setup)


def aggregation_reference(x: torch.Tensor, weight: torch.Tensor, fp: Footprint) -> torch.Tensor:
    # Under torch.compile: without autograd the unfolded product, one reduction Inductor fuses
    # (inference affords kk copies of x); with it the loops as opaque custom ops, whose backward
    # holds no kh*kw-times larger copy of x. Either way the graph does not grow with the taps.
    if torch.compiler.is_compiling():
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _aggregation_op(x, weight, list(fp.kernel_size), list(fp.dilation),
                                   list(fp.stride), fp.padding_mode)
        return aggregation_export(x, weight, fp)
    return _Aggregation.apply(x, weight, fp)


def aggregation_export(x: torch.Tensor, weight: torch.Tensor, fp: Footprint) -> torch.Tensor:
    """The aggregation as an export graph: the footprint unfolded (``kk`` copies of ``x``,
    which inference affords) and reduced in one product, so that the graph does not grow with
    the footprint as the tap-by-tap reference would, and its sizes follow the input's shape."""
    N, C, Cw = x.shape[0], x.shape[1], weight.shape[1]
    Ho, Wo = _out_size(fp, x.shape[2], x.shape[3])
    cols = _neighbours(x, fp).reshape(N, C // Cw, Cw, fp.taps, -1)
    return (cols * weight.unsqueeze(1)).sum(3).reshape(N, C, Ho, Wo)


# --------------------------------------------------------------------------------------------
# backends: torch reference, natten (none), cuda (attnzoo.kernels.san)
# --------------------------------------------------------------------------------------------

class SANCall(NamedTuple):
    """What backend selection needs to know about a SAN op call (hashable, cached)."""
    device: str  # the torch device with its index ("cuda:1", "cpu"): support is per device
    dtype: torch.dtype
    kernel_size: Tuple[int, int]
    dilation: Tuple[int, int]
    stride: Tuple[int, int]
    padding_mode: str
    grad: bool
    wide: bool = False  # beyond the kernels' offsets (kernels.wide_offsets)


def _natten_limits(op: str):
    def limits(call: SANCall) -> Optional[str]:
        return f"NATTEN has no {op}"
    return limits


def _natten_support(op: str):
    def support(call: SANCall) -> Optional[str]:
        return (f"{_natten_limits(op)(call)}: it implements (dot-product, softmax) "
                "neighborhood attention only, not SAN's vector attention with reflection "
                "padding")
    return support


def _unreachable(op: str, backend: str):
    def impl(*args):  # pragma: no cover - the support checks refuse every call
        raise backends.BackendUnsupportedError(f"backend {backend!r} cannot run {op}")
    return impl


def _cuda_support(call: SANCall) -> Optional[str]:
    reason = kernels.triton_missing()
    if reason is not None:
        return reason
    from ..kernels import san as kernel
    return kernels.joined(kernel.support(call.device, call.dtype),
                          kernel.LIMITS.offsets_reason() if call.wide else None)


def _cuda_limits(call: SANCall) -> Optional[str]:
    """The kernels' limits that the call alone decides (unchecked without Triton, which their
    module needs; ``support`` then refuses)."""
    if kernels.triton_missing() is not None:
        return None
    from ..kernels import san as kernel
    return "; ".join(kernel.call_reasons(call.dtype)) or None


def _cuda(op: str):
    name = f"{op}_fused"

    def impl(*args):
        # (imported by _cuda_support, as neighborhood._na_cuda says)
        return getattr(kernels.san, name)(*args)
    return impl


def _kernels_trusted(call: SANCall) -> Optional[str]:
    """``auto`` runs the SAN kernels only where a verification record covers the call's GPU
    architecture, dtype and Triton (:func:`attnzoo.kernels.verified`); ``backend="cuda"``
    always runs them."""
    return kernels.unverified("san", call.device, call.dtype,
                              "the cuda SAN kernels")


def _subtraction_macs(x: torch.Tensor, fp: Footprint) -> int:
    """One subtraction per output element, as SAN's official counter (util/complexity.py)."""
    return x.shape[0] * x.shape[1] * fp.taps * _positions(x, fp)


def _subtraction2_macs(x1: torch.Tensor, x2: torch.Tensor, fp: Footprint) -> int:
    return _subtraction_macs(x1, fp)


def _aggregation_macs(x: torch.Tensor, weight: torch.Tensor, fp: Footprint) -> int:
    """One multiply-accumulate per (output element, tap): ``N * C * L * kk``."""
    return _subtraction_macs(x, fp)


def _positions(x: torch.Tensor, fp: Footprint) -> int:
    Ho, Wo = _out_size(fp, *x.shape[-2:])
    return Ho * Wo


def _examples(op: str):
    """Calls at SAN's real shapes (batch 8 at 224 px): stage 0 (112x112, k 3, 64 channels:
    rel 4, mid 16, Cw 2), stage 1 (56x56, k 7, 256: rel 16, mid 64, Cw 8) and stage 3 (14x14,
    k 7, 1024: rel 64, mid 256, Cw 32)."""
    stages = [("s0 112x112 k3", 112, 3, 64), ("s1 56x56 k7", 56, 7, 256),
              ("s3 14x14 k7", 14, 7, 1024)]

    def examples(device, dtype):
        def new(*shape):
            return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

        out = []
        for label, hw, k, c in stages:
            rel, mid, taps = c // 16, c // 4, k * k
            if op == "san_aggregation":
                def run(backend, hw=hw, k=k, mid=mid, taps=taps):
                    return san_aggregation(new(8, mid, hw, hw), new(8, mid // 8, taps, hw * hw),
                                           kernel_size=k, backend=backend)
                out.append((f"{label} 8x{mid}x{hw}x{hw} Cw {mid // 8}", run))
            elif op == "san_subtraction2":
                def run(backend, hw=hw, k=k, rel=rel):
                    return san_subtraction2(new(8, rel, hw, hw), new(8, rel, hw, hw),
                                            kernel_size=k, backend=backend)
                out.append((f"{label} 8x{rel}x{hw}x{hw}", run))
            else:
                def run(backend, hw=hw, k=k):  # the position encoding: one 2-channel map
                    return san_subtraction(new(1, 2, hw, hw), kernel_size=k, backend=backend)
                out.append((f"{label} position 1x2x{hw}x{hw}", run))
        return out
    return examples


# Check cases: (label, (N, C, Cw, H, W), kernel_size, dilation, stride, padding_mode); the same
# footprints for the three ops. Between them: kernels 3, 5, 7 and non-square, dilation and
# stride 1 and 2 per axis, odd and non-square maps, maps just large enough for one reflection,
# and zero padding on maps smaller than the footprint.
_CASES = [
    ("2x4x7x9 k3", (2, 4, 2, 7, 9), 3, 1, 1, "reflect"),
    ("6x9x8 k5 d2 s2", (1, 6, 3, 9, 8), 5, 2, 2, "reflect"),
    ("4x5x8 k(3,5) d(2,1) s(1,2)", (1, 4, 2, 5, 8), (3, 5), (2, 1), (1, 2), "reflect"),
    ("8x4x7 k7 minimal", (1, 8, 4, 4, 7), 7, 1, 1, "reflect"),
    ("2x4x5x6 k7 zeros", (2, 4, 2, 5, 6), 7, 1, 1, "zeros"),
    ("6x3x7 k5 d2 s2 zeros", (1, 6, 2, 3, 7), 5, 2, 2, "zeros"),
]


def _cases(op: str):
    def cases(device, dtype):
        out = []
        for label, (N, C, Cw, H, W), k, d, s, mode in _CASES:
            geometry = dict(kernel_size=k, dilation=d, stride=s, padding_mode=mode)
            if op == "san_aggregation":
                (kh, kw), (sh, sw) = _pair(k, "kernel_size", op), _pair(s, "stride", op)
                taps = (N, Cw, kh * kw, -(-H // sh) * -(-W // sw))
                shapes, fn = [(N, C, H, W), taps], san_aggregation
            else:
                fn = san_subtraction2 if op == "san_subtraction2" else san_subtraction
                shapes = [(N, C, H, W)] * (2 if op == "san_subtraction2" else 1)

            def call(*tensors, backend, fn=fn, geometry=geometry):
                return fn(*tensors, backend=backend, **geometry)
            out.append(backends.Case(label, backends.case_inputs(shapes, device, dtype), call))
        return out
    return cases


for _name, _impl, _macs in (("san_aggregation", aggregation_reference, _aggregation_macs),
                            ("san_subtraction", subtraction_reference, _subtraction_macs),
                            ("san_subtraction2", subtraction2_reference, _subtraction2_macs)):
    backends.register_op(
        _name, key_type=SANCall, macs=_macs, examples=_examples(_name), cases=_cases(_name),
        export=aggregation_export if _name == "san_aggregation" else None,
        backends={"torch": backends.Backend(_impl),
                  "natten": backends.Backend(_unreachable(_name, "natten"), _natten_support(_name),
                                             limits=_natten_limits(_name)),
                  "cuda": backends.Backend(_cuda(_name), _cuda_support, _kernels_trusted,
                                           _cuda_limits)})


# --------------------------------------------------------------------------------------------
# public ops
# --------------------------------------------------------------------------------------------

def _calls(x: torch.Tensor, fp: Footprint, *tensors: torch.Tensor,
           taps: int = 1) -> Tuple[SANCall, SANCall]:
    """The call's keys without and with gradients. ``taps``: an output sample's per channel and
    output position (the subtractions' one per footprint tap)."""
    out = 0 if x.numel() * taps <= kernels.INT32_MAX else (  # at most x's size times taps
        x.shape[1] * taps * math.prod(_out_size(fp, *x.shape[-2:])))
    wide = kernels.wide_offsets(x, *tensors, elements=out)
    return tuple(SANCall(str(x.device), x.dtype, fp.kernel_size, fp.dilation, fp.stride,
                         fp.padding_mode, grad, wide) for grad in (False, True))


def _exact(value) -> bool:
    """An int, or a tuple of ints, by exact type (a bool equals an int; a list is no key)."""
    return type(value) is int or type(value) is tuple and all(type(v) is int for v in value)


def _checked(fn: str, check, options: tuple, *tensors: torch.Tensor):
    """``check()`` once per call metadata (:func:`attnzoo.backends.checked_once`): the op's
    name, its ``options`` (kernel_size, dilation, stride, padding_mode) and its tensors'."""
    key = backends.tensors_key(*tensors)
    exact = key is not None and all(map(_exact, options[:3])) and type(options[3]) is str
    return backends.checked_once((fn, *options, key) if exact else None, check)


def _dispatch(fn: str, checked, backend: Optional[str], *tensors: torch.Tensor) -> torch.Tensor:
    fp, calls, empty = checked
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return backends.dispatch(fn, calls[grad], backend, *tensors, fp, empty=empty)


def san_subtraction(x: torch.Tensor, *, kernel_size: IntOrPair, dilation: IntOrPair = 1,
                    stride: IntOrPair = 1, padding_mode: str = "reflect",
                    backend: Optional[str] = None) -> torch.Tensor:
    """``out[n, c, kk, i] = x[n, c, centre(i)] - x[n, c, tap_kk(i)]`` (module docstring).

    Args:
        x: ``[N, C, H, W]``.
        kernel_size: odd footprint size (int or ``(kh, kw)``).
        dilation, stride: int or pair.
        padding_mode: ``'reflect'`` (SAN's; needs ``H, W > dilation * (kernel_size - 1) / 2``)
            or ``'zeros'``.
        backend: one of :data:`attnzoo.backends.BACKENDS`; ``None`` follows
            :func:`attnzoo.use_backend` / :func:`attnzoo.set_backend` / ``ATTNZOO_BACKEND``.

    Returns:
        ``[N, C, kh*kw, Ho*Wo]``, ``Ho, Wo = ceil(H / stride), ceil(W / stride)``.
    """
    fn = "san_subtraction"

    def check():
        fp = _footprint(fn, _check_map(fn, "x", x), kernel_size, dilation, stride, padding_mode)
        return fp, _calls(x, fp, taps=fp.taps), x.numel() == 0

    options = (kernel_size, dilation, stride, padding_mode)
    return _dispatch(fn, _checked(fn, check, options, x), backend, x)


def san_subtraction2(x1: torch.Tensor, x2: torch.Tensor, *, kernel_size: IntOrPair,
                     dilation: IntOrPair = 1, stride: IntOrPair = 1,
                     padding_mode: str = "reflect",
                     backend: Optional[str] = None) -> torch.Tensor:
    """``out[n, c, kk, i] = x1[n, c, centre(i)] - x2[n, c, tap_kk(i)]``; ``x1`` and ``x2`` are
    ``[N, C, H, W]`` of one shape. Arguments and result as :func:`san_subtraction`."""
    fn = "san_subtraction2"

    def check():
        _check_map(fn, "x1", x1)
        _check_map(fn, "x2", x2)
        if x1.shape != x2.shape:
            raise ValueError(f"{fn}: x1 and x2 must have the same shape, got "
                             f"{tuple(x1.shape)} and {tuple(x2.shape)}")
        _same(fn, x1, x2, "x1 and x2")
        fp = _footprint(fn, x1, kernel_size, dilation, stride, padding_mode)
        return fp, _calls(x1, fp, x2, taps=fp.taps), x1.numel() == 0

    options = (kernel_size, dilation, stride, padding_mode)
    return _dispatch(fn, _checked(fn, check, options, x1, x2), backend, x1, x2)


def san_aggregation(x: torch.Tensor, weight: torch.Tensor, *, kernel_size: IntOrPair,
                    dilation: IntOrPair = 1, stride: IntOrPair = 1,
                    padding_mode: str = "reflect",
                    backend: Optional[str] = None) -> torch.Tensor:
    """``y[n, c, i] = sum_kk weight[n, c % Cw, kk, i] * x[n, c, tap_kk(i)]``.

    Args:
        x: the values, ``[N, C, H, W]``.
        weight: ``[N, Cw, kh*kw, Ho*Wo]``; ``C`` must be a multiple of ``Cw`` (channel ``c``
            uses weight channel ``c % Cw``).
        kernel_size, dilation, stride, padding_mode, backend: as :func:`san_subtraction`.

    Returns:
        ``[N, C, Ho, Wo]``.
    """
    fn = "san_aggregation"

    def check():
        _check_map(fn, "x", x)
        _check_map(fn, "weight", weight)
        _same(fn, x, weight, "x and weight")
        fp = _footprint(fn, x, kernel_size, dilation, stride, padding_mode)
        N, C = x.shape[:2]
        Ho, Wo = _out_size(fp, *x.shape[-2:])
        Cw = weight.shape[1]
        if weight.shape[0] != N or weight.shape[2:] != (fp.taps, Ho * Wo) or Cw < 1 or C % Cw:
            raise ValueError(
                f"{fn}: weight must be [N, Cw, kh*kw, Ho*Wo] = [{N}, Cw, {fp.taps}, {Ho * Wo}] "
                f"with C = {C} a multiple of Cw; got {tuple(weight.shape)}")
        return fp, _calls(x, fp, weight), x.numel() == 0 or weight.numel() == 0

    options = (kernel_size, dilation, stride, padding_mode)
    return _dispatch(fn, _checked(fn, check, options, x, weight), backend, x, weight)


def san_neighbours(x: torch.Tensor, *, kernel_size: IntOrPair, dilation: IntOrPair = 1,
                   stride: IntOrPair = 1, padding_mode: str = "reflect") -> torch.Tensor:
    """``out[n, c, kk, i] = x[n, c, tap_kk(i)]``, ``[N, C, kh*kw, Ho*Wo]``: the footprint gather
    the patchwise SAM and the non-subtraction relations need (plain PyTorch, no backends: a
    gather computes nothing)."""
    fn = "san_neighbours"
    fp = _footprint(fn, _check_map(fn, "x", x), kernel_size, dilation, stride, padding_mode)
    return _neighbours(x, fp)
