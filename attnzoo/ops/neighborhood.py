"""Neighborhood attention (NA / dilated NA), 1-D and 2-D, with backend dispatch.

Semantics (Hassani et al., NAT / DiNAT), per axis of length ``L`` with odd kernel ``K``,
``r = K // 2`` and dilation ``d``: query ``i`` belongs to dilation group ``g = i % d`` with in-group
index ``ip = i // d``; the group has ``Lg = ceil((L - g) / d)`` positions; the window starts at
``min(max(ip - r, 0), Lg - K)`` and its keys are ``(start + t) * d + g``, ``t < K``. Near a
border the window is *clamped* (shifted inward), never zero-padded, so every query sees exactly
``K`` (``K*K`` in 2-D) keys; this needs ``K * d <= L``. The optional relative positional bias
``rpb`` (``[heads, 2K-1]`` / ``[heads, 2K-1, 2K-1]``) adds ``rpb[h, (key - query) / d + K - 1]``
to the logit, unscaled; ``q`` is scaled by ``scale`` (default ``head_dim ** -0.5``).

Layout is NATTEN's heads-last ``[B, *spatial, heads, head_dim]``.

The torch reference never forms the full ``N x N`` attention for large maps: it splits each
dilation group into tiles of ``T`` queries per axis, whose windows all lie inside one
``T + K - 1`` key region (window starts are monotone with steps of at most one), and runs one
small masked attention per tile, all tiles batched. Small maps use one tile per group, i.e. a
dense masked attention. The index tables depend only on the shape and are cached.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .. import backends, kernels
from ._args import as_ints

__all__ = ["na1d", "na2d", "na1d_qkv", "na2d_qkv", "na1d_qk", "na1d_av", "na2d_qk", "na2d_av",
           "na_window_positions", "na_reference", "na_export"]

IntOrTuple = Union[int, Sequence[int]]


# --------------------------------------------------------------------------------------------
# argument checking
# --------------------------------------------------------------------------------------------

def _finite(x) -> bool:
    """``math.isfinite(x)`` by comparisons, which a symbolic float (Dynamo's with
    ``dynamic=True``) takes without a graph break."""
    return x == x and abs(x) != math.inf


def _as_tuple(value: IntOrTuple, n: int, name: str, fn: str = "") -> Tuple[int, ...]:
    ints = as_ints(value, n)
    if ints is not None:
        return ints
    raise TypeError(f"{fn + ': ' if fn else ''}{name} must be an int or a tuple of {n} ints, "
                    f"got {value!r}")


def _check_tensors(fn: str, n: int, last: str, **tensors: torch.Tensor) -> None:
    """Each tensor is a floating-point ``n + 3``-D tensor (:func:`_layout` ``(n, last)``); all
    share dtype and device."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != n + 3:
            raise ValueError(f"{fn}: {name} must be {n + 3}-D {_layout(n, last)}, got shape "
                             f"{tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{fn}: {name} must be a floating-point tensor, got {t.dtype}")
    ts = list(tensors.values())
    if any(t.dtype != ts[0].dtype or t.device != ts[0].device for t in ts[1:]):
        names = ", ".join(tensors)
        raise ValueError(f"{fn}: {names} must share dtype and device; got "
                         f"{'/'.join(str(t.dtype) for t in ts)} on "
                         f"{'/'.join(str(t.device) for t in ts)}")


def _check_window(fn: str, n: int, kernel_size, dilation, spatial: Tuple[int, ...]):
    """Returns (kernel_size, dilation) as tuples: odd kernels, dilations >= 1, windows that fit."""
    ks = _as_tuple(kernel_size, n, "kernel_size", fn)
    dil = _as_tuple(dilation, n, "dilation", fn)
    for K, d, L in zip(ks, dil, spatial):
        if K < 1 or K % 2 == 0:
            raise ValueError(f"{fn}: kernel_size must be odd and >= 1, got {kernel_size!r}")
        if d < 1:
            raise ValueError(f"{fn}: dilation must be >= 1, got {dilation!r}")
        if K * d > L:
            raise ValueError(
                f"{fn}: kernel_size * dilation must not exceed the input size on every axis; "
                f"got kernel_size={ks}, dilation={dil}, spatial size {spatial} "
                "(pad the input, as NAT does for small images)")
    return ks, dil


def _check_rpb(fn: str, rpb, heads: int, ks: Tuple[int, ...], device: torch.device) -> None:
    if rpb is None:
        return
    expected = (heads,) + tuple(2 * K - 1 for K in ks)
    if not isinstance(rpb, torch.Tensor) or not rpb.is_floating_point():
        raise TypeError(f"{fn}: rpb must be a floating-point torch.Tensor or None, got "
                        f"{rpb.dtype if isinstance(rpb, torch.Tensor) else type(rpb).__name__}")
    if tuple(rpb.shape) != expected:
        raise ValueError(f"{fn}: rpb must have shape [heads, 2K-1, ...] = {expected}, "
                         f"got {tuple(rpb.shape)}")
    if rpb.device != device:
        raise ValueError(f"{fn}: rpb is on {rpb.device} but q is on {device}")


def _layout(n: int, last: str = "head_dim") -> str:
    return f"[B, L, heads, {last}]" if n == 1 else f"[B, H, W, heads, {last}]"


def _check_call(q, k, v, kernel_size, dilation, rpb, scale, n: int, fn: str):
    """Validate an NA call of public op ``fn``; returns (kernel_size, dilation) as tuples."""
    _check_tensors(fn, n, "head_dim", q=q, k=k, v=v)
    if q.shape != k.shape or q.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{fn}: q and k must have the same shape and v the same [B, *spatial, "
                         f"heads]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] < 1:
        raise ValueError(f"{fn}: q and k need a head_dim >= 1, got shape {tuple(q.shape)}")
    ks, dil = _check_window(fn, n, kernel_size, dilation, tuple(q.shape[1:1 + n]))
    _check_rpb(fn, rpb, q.shape[-2], ks, q.device)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"{fn}: scale must be a float or None, got {scale!r}")
    if scale is not None and not _finite(scale):
        raise ValueError(f"{fn}: scale must be finite (None: head_dim ** -0.5), got {scale!r}")
    return ks, dil


# --------------------------------------------------------------------------------------------
# torch reference
# --------------------------------------------------------------------------------------------

class _AxisPlan(NamedTuple):
    q_index: torch.Tensor    # [d, nT, T]     source position of each tiled query
    k_index: torch.Tensor    # [d, nT, R]     source position of each key in the tile's region
    onehot: torch.Tensor     # [2K-1, d, nT, T, R]  one-hot rpb offset of a neighbour (0 outside)
    inside: torch.Tensor     # [d, nT, T, R]  key inside the query's window
    slot: torch.Tensor       # [3, L]         (g, tile, t) holding each position's output


def _tile_sizes(spatial: Tuple[int, ...], dil: Tuple[int, ...]) -> Tuple[int, ...]:
    """Queries per tile along each axis. A tile of T queries reads T + K - 1 keys per axis: small
    tiles waste least attention work ((T + K - 1)^2 keys per query against K^2) but duplicate
    keys most ((T + K - 1)^2 / T^2 copies) and make many tiny attention problems. Measured on
    CPU (fp32, K=7, NAT-tiny's and DiNAT's stages at batch 8, process time of one thread):
    balanced tiles of at most 8 are fastest at every stage (56x56: T=8 49 ms, T=4 93 ms, dense
    one tile per group wins below 8). Huge maps grow T to keep at most ~1024 tiles."""
    groups = [math.ceil(L / d) for L, d in zip(spatial, dil)]
    for T in (8, 16, 32, 64):
        sizes = tuple(math.ceil(g / math.ceil(g / T)) for g in groups)
        if math.prod(d * math.ceil(g / t) for d, g, t in zip(dil, groups, sizes)) <= 1024:
            break
    return sizes


@functools.lru_cache(maxsize=256)
def _axis_plan(L: int, K: int, d: int, T: int) -> _AxisPlan:
    r = K // 2
    lg_max = math.ceil(L / d)
    n_tiles = math.ceil(lg_max / T)
    g = torch.arange(d).view(d, 1, 1)
    lg = torch.div(L - g + d - 1, d, rounding_mode="floor")  # true length of each group
    tiled = torch.arange(n_tiles * T).view(1, n_tiles, T)
    # Padded queries (beyond their group) duplicate the group's last query: never an all-masked
    # row (which would give NaN), and their outputs are dropped.
    ip = torch.minimum(tiled, lg - 1)
    start = torch.clamp(ip - r, min=0).minimum(lg - K)
    # A tile's windows span [start of its first query, start of its last + K): at most T + K - 1
    # keys, fewer where windows are clamped at a border. R is the widest span over all tiles.
    R = min(int((start[:, :, -1] - start[:, :, 0]).max()) + K, lg_max)
    region = torch.clamp(start[:, :, :1], max=lg_max - R)               # [d, nT, 1]
    key_ip = region + torch.arange(R).view(1, 1, R)                      # [d, nT, R]
    off = key_ip.unsqueeze(2) - start.unsqueeze(3)                       # [d, nT, T, R]
    inside = (off >= 0) & (off < K)
    rel = key_ip.unsqueeze(2) - ip.unsqueeze(3) + K - 1                  # rpb offset, 0..2K-2
    onehot = (rel == torch.arange(2 * K - 1).view(-1, 1, 1, 1, 1)) & inside
    # Keys past a short group's end are never neighbours; clamp only to keep the gather in range.
    k_index = (key_ip * d + g).clamp(max=L - 1)
    pos = torch.arange(L)
    slot = torch.stack([pos % d, pos // d // T, pos // d % T])
    return _AxisPlan(ip * d + g, k_index, onehot, inside, slot)


class _Plan(NamedTuple):
    q_index: Optional[torch.Tensor]    # [tiles * Tq] flat spatial index of each tiled query
    k_index: Optional[torch.Tensor]    # [tiles * Rk] flat spatial index of each region key
    onehot: Tuple[torch.Tensor, ...]   # per axis [2K-1, d, nT, T, R] (see _AxisPlan)
    mask: torch.Tensor                 # [tiles, Tq, Rk] additive 0 / -inf mask
    out_index: Optional[torch.Tensor]  # [N] slot of each position in the [tiles * Tq] output
    tiles: int
    tq: int
    rk: int


def _place(t: torch.Tensor, positions: Sequence[int], ndim: int) -> torch.Tensor:
    """View ``t`` so that its dims land at ``positions`` of an ``ndim``-dim broadcastable shape."""
    shape = [1] * ndim
    for size, p in zip(t.shape, positions):
        shape[p] = size
    return t.reshape(shape)


def _unless_identity(index: torch.Tensor, size: int) -> Optional[torch.Tensor]:
    # Dense maps without dilation need no gather at all; skipping it is a large win at 14x14.
    flat = index.reshape(-1)
    if flat.numel() == size and torch.equal(flat, torch.arange(size)):
        return None
    return flat


@functools.lru_cache(maxsize=128)
def _plan(spatial: Tuple[int, ...], ks: Tuple[int, ...], dil: Tuple[int, ...],
          device: torch.device, dtype: torch.dtype) -> _Plan:
    # Cached plans outlive the call: never make them inference tensors, which autograd refuses
    # to save when the same shape is trained after an inference_mode() forward.
    with torch.inference_mode(False):
        return _build_plan(spatial, ks, dil, device, dtype)


def _build_plan(spatial, ks, dil, device, dtype) -> _Plan:
    n = len(spatial)
    axes = [_axis_plan(L, K, d, T)
            for L, K, d, T in zip(spatial, ks, dil, _tile_sizes(spatial, dil))]
    strides = [math.prod(spatial[a + 1:]) for a in range(n)]
    # Dims are ordered (g_0.., j_0..) = the tile, then in-tile (t_0..) or region (r_0..) dims.
    q_index = sum(_place(ax.q_index * s, (a, n + a, 2 * n + a), 3 * n)
                  for a, (ax, s) in enumerate(zip(axes, strides)))
    k_index = sum(_place(ax.k_index * s, (a, n + a, 2 * n + a), 3 * n)
                  for a, (ax, s) in enumerate(zip(axes, strides)))
    inside = functools.reduce(torch.logical_and, [
        _place(ax.inside, (a, n + a, 2 * n + a, 3 * n + a), 4 * n) for a, ax in enumerate(axes)])
    tiles = math.prod(q_index.shape[:2 * n])
    tq = math.prod(q_index.shape[2 * n:])
    rk = math.prod(k_index.shape[2 * n:])
    # Output slot of each position: its (g, j, t) per axis, in the tile order above.
    slots = torch.arange(q_index.numel()).view(q_index.shape)
    out_index = slots[tuple(_place(ax.slot[c], (a,), n) for c in range(3)
                            for a, ax in enumerate(axes))]
    mask = torch.zeros(inside.shape, dtype=dtype).masked_fill_(~inside, float("-inf"))
    size = math.prod(spatial)
    opt = lambda t: None if t is None else t.to(device)  # noqa: E731
    return _Plan(opt(_unless_identity(q_index, size)), opt(_unless_identity(k_index, size)),
                 tuple(ax.onehot.to(device=device, dtype=dtype) for ax in axes),
                 mask.reshape(tiles, tq, rk).to(device),
                 opt(_unless_identity(out_index, tiles * tq)), tiles, tq, rk)


def static_size(size) -> int:
    """``size`` as a plain int; under torch.compile with dynamic shapes, Dynamo specializes the
    graph on it, so that what depends on it stays a constant of the graph. Dynamo keeps
    ``int(size)`` symbolic, and an assume_constant_result call with a symbolic argument breaks
    the graph (NAT's broke once per block at a second input size). torch 2.14's Dynamo guards
    on ``len(range(size))``; where a Dynamo reads it unguarded, the comparison below asks for
    the guard (torch 2.4's still fails at a second map size, as it did with ``int()``)."""
    value = len(range(size))
    if size != value:  # never true: the comparison is the guard
        raise AssertionError(f"size {size} is not {value}")
    return value


# Under torch.compile the plan is a constant of the graph (it depends on static shapes only), so
# Dynamo neither traces its construction nor breaks the graph for it.
@torch.compiler.assume_constant_result
def _plan_constant(*args) -> _Plan:
    return _plan(*args)


# torch 2.4-2.5's Dynamo stores an assume_constant_result value in the compiled frame's globals
# under the function's __name__: a name no module uses keeps it from shadowing anything.
_plan_constant.__name__ = "_attnzoo_na_plan"


def _bias(plan: _Plan, rpb: Optional[torch.Tensor], heads: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention bias ``[1, heads * tiles, Tq, Rk]``: the window mask, plus the
    relative positional bias. The bias is a contraction of ``rpb`` with per-axis one-hot
    offsets: its gradient is a matmul, not an indexing backward (which is deterministic, hence
    serialised, on CUDA and dominated NAT's training step there)."""
    if rpb is None:
        bias = plan.mask.expand(heads, -1, -1, -1)
    else:
        table = rpb.to(dtype)
        if len(plan.onehot) == 1:
            rel = torch.einsum("ha,agjtr->hgjtr", table, plan.onehot[0])
        else:
            rel = torch.einsum("hab,agjtr,bGJTR->hgGjJtTrR", table, *plan.onehot)
        bias = rel.reshape(heads, plan.tiles, plan.tq, plan.rk) + plan.mask
    return bias.reshape(1, heads * plan.tiles, plan.tq, plan.rk)


def na_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: Tuple[int, ...],
                 dilation: Tuple[int, ...], rpb: Optional[torch.Tensor],
                 scale: float) -> torch.Tensor:
    """Pure-PyTorch NA on ``[B, *spatial, heads, d]`` (already validated); differentiable in q,
    k, v and rpb, any device and float dtype.

    One SDPA call over all tiles: its batch is B and its "heads" are (head, tile) pairs, so the
    bias (shared by the batch) broadcasts instead of being repeated B times."""
    n = len(kernel_size)
    B, spatial, heads = q.shape[0], tuple(static_size(s) for s in q.shape[1:1 + n]), q.shape[-2]
    plan = _plan_constant(spatial, tuple(kernel_size), tuple(dilation), q.device, q.dtype)

    N = math.prod(spatial)
    qt, kt, vt = (_tiled(q, plan.q_index, plan, N), _tiled(k, plan.k_index, plan, N),
                  _tiled(v, plan.k_index, plan, N))
    bias = _bias(plan, rpb, heads, q.dtype)
    if bias.requires_grad and q.device.type == "cpu":
        out = _cpu_attention_with_bias_grad(qt, kt, vt, bias, scale)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=scale)
    out = out.reshape(B * heads, plan.tiles * plan.tq, v.shape[-1])  # contiguous: fast gather
    if plan.out_index is not None:
        out = _gather_rows(out, plan.out_index)
    return out.view(B, heads, N, v.shape[-1]).transpose(1, 2).reshape(
        B, *spatial, heads, v.shape[-1])


def _tiled(x: torch.Tensor, index: Optional[torch.Tensor], plan: _Plan, N: int) -> torch.Tensor:
    """``[B, *spatial, heads, c]`` -> ``[B, heads * tiles, rows, c]``: each tile's query (or key
    region) rows, at ``index`` of the map flattened to ``N`` positions. Sizes are written out,
    never -1: an empty batch must reshape too."""
    B, heads, c = x.shape[0], x.shape[-2], x.shape[-1]
    rows = (N if index is None else index.numel()) // plan.tiles
    x = x.reshape(B, N, heads, c).transpose(1, 2)
    if index is None:  # tiles in natural order (a view when there is one tile)
        return x.reshape(B, heads * plan.tiles, rows, c)
    # Head-major first (one copy of the map), then one gather of the tile rows straight into
    # SDPA's layout: key regions overlap, so this moves ~3x less than the reverse.
    x = x.reshape(B * heads, N, c)
    return _gather_rows(x, index).view(B, heads * plan.tiles, rows, c)


def _untiled(g: torch.Tensor, index: Optional[torch.Tensor], like: torch.Tensor,
             N: int) -> torch.Tensor:
    """The transpose of :func:`_tiled` (its gradient): ``[B, heads * tiles, rows, c]`` rows
    summed back into a map shaped like ``like``, ``[B, *spatial, heads, c]``."""
    B, heads, c = like.shape[0], like.shape[-2], g.shape[-1]
    g = g.reshape(B * heads, g.shape[1] // heads * g.shape[2], c)
    if index is not None:
        g = _scatter_rows(g, index, N)
    return g.view(B, heads, N, c).transpose(1, 2).reshape(like.shape[:-1] + (c,))


# glibc serves allocations above its mmap threshold (at most 32 MiB) with fresh pages every time;
# faulting them in was ~25% of NAT-tiny's 56x56 stage in training (39 MB of scores at batch 8).
_MMAP_THRESHOLD_MAX = 32 << 20


def _cpu_attention_with_bias_grad(qt, kt, vt, bias, scale):
    """Attention with a bias that needs a gradient, on CPU. SDPA would run its math path here,
    with a softmax that also scans for fully masked rows (NA has none): the same math written
    out is ~25% faster. Scores over glibc's mmap threshold are computed in batch slices."""
    def attend(q, k, v):
        return (torch.matmul(q * scale, k.transpose(-1, -2)) + bias).softmax(-1) @ v

    B = qt.shape[0]
    scores = qt.numel() // qt.shape[-1] * kt.shape[-2] * qt.element_size()
    if scores <= _MMAP_THRESHOLD_MAX or B == 1 or torch.compiler.is_compiling():
        return attend(qt, kt, vt)
    slices = min(B, -(-2 * scores // _MMAP_THRESHOLD_MAX))  # at most half the threshold each
    step = -(-B // slices)
    return torch.cat([attend(*parts) for parts in zip(qt.split(step), kt.split(step),
                                                       vt.split(step))])


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[:, index]`` for ``x [G, M, r]``, as one gather along dim 0 of ``[G * M, r]``: on CPU
    ``index_select`` along an inner dim takes a serial path that is 10-20x slower (it was most of
    the NA reference's non-attention time), and so does its backward."""
    G, M, r = x.shape
    flat = (torch.arange(G, device=index.device) * M).unsqueeze(1) + index.unsqueeze(0)
    return x.reshape(G * M, r).index_select(0, flat.reshape(-1)).view(G, index.numel(), r)


def _scatter_rows(grad: torch.Tensor, index: torch.Tensor, M: int) -> torch.Tensor:
    """The gradient of :func:`_gather_rows`: rows of ``grad [G, len(index), r]`` summed into
    ``[G, M, r]`` at ``index`` (key regions overlap: a row can be read many times)."""
    G, _, r = grad.shape
    flat = (torch.arange(G, device=index.device) * M).unsqueeze(1) + index.unsqueeze(0)
    return grad.new_zeros(G * M, r).index_add_(0, flat.reshape(-1), grad.reshape(-1, r)).view(
        G, M, r)


def na_reference_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          kernel_size: Tuple[int, ...], dilation: Tuple[int, ...],
                          rpb: Optional[torch.Tensor], scale: float):
    """The gradients of :func:`na_reference` for ``grad`` of its output, written out: the
    attention is recomputed from q, k and v (nothing is kept from the forward pass), then the
    softmax's backward, and the gathers' and bias contraction's transposes. Returns (dq, dk, dv,
    drpb), drpb None without rpb."""
    n = len(kernel_size)
    B, spatial, heads = q.shape[0], tuple(q.shape[1:1 + n]), q.shape[-2]
    plan = _plan(spatial, tuple(kernel_size), tuple(dilation), q.device, q.dtype)
    N = math.prod(spatial)
    qt, kt, vt = (_tiled(q, plan.q_index, plan, N), _tiled(k, plan.k_index, plan, N),
                  _tiled(v, plan.k_index, plan, N))
    p = (torch.matmul(qt * scale, kt.transpose(-1, -2)) + _bias(plan, rpb, heads, q.dtype)
         ).softmax(-1)
    # the output's gather, transposed: padded queries' slots get no gradient
    g = grad.reshape(B, N, heads, grad.shape[-1]).transpose(1, 2).reshape(
        B * heads, N, grad.shape[-1])
    if plan.out_index is not None:
        g = _scatter_rows(g, plan.out_index, plan.tiles * plan.tq)
    g = g.reshape(B, heads * plan.tiles, plan.tq, grad.shape[-1])
    dv = _untiled(p.transpose(-1, -2) @ g, plan.k_index, v, N)
    dp = g @ vt.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # the softmax's backward
    dq = _untiled(ds @ kt * scale, plan.q_index, q, N)
    dk = _untiled(ds.transpose(-1, -2) @ qt * scale, plan.k_index, k, N)
    if rpb is None:
        return dq, dk, dv, None
    # the bias's contraction (see _bias), transposed onto rpb
    dbias = ds.sum(0).reshape([heads] + [ax.shape[i] for i in range(1, 5) for ax in plan.onehot])
    if n == 1:
        drpb = torch.einsum("hgjtr,agjtr->ha", dbias, plan.onehot[0])
    else:
        drpb = torch.einsum("hgGjJtTrR,agjtr,bGJTR->hab", dbias, *plan.onehot)
    return dq, dk, dv, drpb.to(rpb.dtype)


# Under torch.compile with autograd, the reference runs as two custom ops, one opaque call each
# way: AOT autograd and Inductor then never trace its gathers, bias contraction and softmax
# backward (NAT's first compiled training step took 1.7x swin_tiny's). Autocast is off inside:
# the op computes in the dtype autocast gave q, k and v.
_NA_ARGS = "int[] kernel_size, int[] dilation, float scale"


def _na_op_forward(q, k, v, rpb, kernel_size, dilation, scale):
    with torch.autocast(q.device.type, enabled=False):
        out = na_reference(q, k, v, tuple(kernel_size), tuple(dilation), rpb, scale)
    return out.contiguous()  # the fake's layout


def _na_op_backward(grad, q, k, v, rpb, kernel_size, dilation, scale):
    with torch.autocast(q.device.type, enabled=False):
        dq, dk, dv, drpb = na_reference_backward(grad, q, k, v, tuple(kernel_size),
                                                 tuple(dilation), rpb, scale)
    # a custom op returns no None: without rpb, an empty tensor stands for its gradient
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), (
        q.new_empty(0) if drpb is None else drpb)


_na_op = torch.library.custom_op(
    "attnzoo::na_reference", _na_op_forward, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor? rpb, {_NA_ARGS}) -> Tensor")
_na_backward_op = torch.library.custom_op(
    "attnzoo::na_reference_backward", _na_op_backward, mutates_args=(),
    schema=f"(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? rpb, {_NA_ARGS}) "
           "-> (Tensor, Tensor, Tensor, Tensor)")


@_na_op.register_fake
def _(q, k, v, rpb, kernel_size, dilation, scale):
    return v.new_empty(q.shape[:-1] + v.shape[-1:])


@_na_backward_op.register_fake
def _(grad, q, k, v, rpb, kernel_size, dilation, scale):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(0) if rpb is None else rpb.new_empty(rpb.shape))


def _na_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.args = inputs[4:]


def _na_autograd(ctx, grad):
    dq, dk, dv, drpb = _na_backward_op(grad, *ctx.saved_tensors, *ctx.args)
    return (dq, dk, dv, None if ctx.saved_tensors[3] is None else drpb) + (None,) * 3


_na_op.register_autograd(_na_autograd, setup_context=_na_setup)


def _na_torch(q, k, v, kernel_size, dilation, rpb, scale, qkv=None):
    """The torch backend: the reference, traced by torch.compile for inference (Inductor fuses
    it), one custom op each way when a compiled call needs gradients. (``qkv``: the packed input
    of :func:`na2d_qkv`, whose views q, k and v are; every backend but ``cuda`` takes the views.)"""
    if torch.compiler.is_compiling() and torch.is_grad_enabled():
        for size in q.shape[1:1 + len(kernel_size)]:  # the map size specializes, as traced
            static_size(size)
        return _na_op(q, k, v, rpb, list(kernel_size), list(dilation), float(scale))
    return na_reference(q, k, v, kernel_size, dilation, rpb, scale)


# --------------------------------------------------------------------------------------------
# export formula
# --------------------------------------------------------------------------------------------

def _axis_neighbours(L, K: int, d: int, device: torch.device, window: int = 0
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """For each position of an axis of length ``L`` (an int, or a size traced for export): its
    ``K`` key positions and their rpb offsets, ``[L, K]`` each; tensor ops only, so that an
    exported graph derives them from the input's shape. ``window``: the axis is zero-padded at
    its end to at least this length; keys at ``L`` and beyond are padding."""
    i = torch.arange(L, device=device)
    if d == 1:
        # L - K - i + i: the last start as a tensor, whether L is an int or a traced size
        last = L - K - i + i
        if window:
            last = torch.clamp(last, min=window - K)
        start = torch.minimum(torch.clamp(i - K // 2, min=0), last)
        key = start.unsqueeze(1) + torch.arange(K, device=device)
        return key, key - (i.unsqueeze(1) - (K - 1))
    # operands are >= 0: truncating division is floor division, and exports to one node
    g, ip = i % d, torch.div(i, d, rounding_mode="trunc")
    size = L if not window else torch.clamp(L - g + g, min=window)
    group_len = torch.div(size - g + d - 1, d, rounding_mode="trunc")
    start = torch.minimum(torch.clamp(ip - K // 2, min=0), group_len - K).unsqueeze(1)
    key_ip = start + torch.arange(K, device=device)
    return key_ip * d + g.unsqueeze(1), key_ip - (ip.unsqueeze(1) - (K - 1))


class _Rows(NamedTuple):
    """The rows an NA export graph gathers (:func:`_na_rows`)."""
    q: torch.Tensor               # [N]: each query's row
    k: torch.Tensor               # [N * K**n]: each query's keys' rows, query-major
    v: torch.Tensor               # [N * K**n]: the same keys' value rows
    bias: Optional[torch.Tensor]  # [N, K**n, heads]: each logit's entry of the flat rpb


_PADDING = -2 ** 40  # an axis term of a key in the padding: every sum with it stays below 0


def _na_rows(spatial, kernel_size: Tuple[int, ...], dilation: Tuple[int, ...],
             device: torch.device, padded: bool, stride: int, heads: Optional[int]) -> _Rows:
    """Where every query of the row-major flattened map finds itself, its ``K**n`` keys and
    values, and their relative biases, from the axes' :func:`_axis_neighbours`: the index
    tensors of :func:`na_export_rows`, tensor ops of the sizes only (an exported graph derives
    them from the input's shape).

    Token ``t`` owns rows ``stride * t`` on: q, k, v with ``stride`` 3 (one tensor holds the
    three), the same row of three tensors with ``stride`` 1. ``padded``: each axis is taken as
    zero-padded at its end to at least ``K * d``, token 0 stands for the padding (every key in
    it reads token 0) and the map's tokens follow. ``heads``: the bias rows' heads (None: no
    bias; a size traced by torch.jit.trace is a tensor, so only ``is None`` is asked of it)."""
    n, shift = len(spatial), int(padded)
    k_off, v_off = (1, 2) if stride == 3 else (0, 0)
    keys = bias = None
    key_step, table_step = stride, 1
    for a in reversed(range(n)):  # row-major: the last axis varies fastest
        L, K, d = spatial[a], kernel_size[a], dilation[a]
        key_a, rel_a = _axis_neighbours(L, K, d, device, K * d if padded else 0)  # [L, K]
        term = key_a * key_step
        if padded:
            term = torch.where(key_a < L, term, _PADDING)
        terms = [term] if heads is None else [term, rel_a * table_step if table_step > 1 else rel_a]
        for _ in range(n - 1 - a):  # [L, K] -> [L, 1 * (n - 1), K, 1 * (n - 1 - a)]
            terms = [t.unsqueeze(-1) for t in terms]
        for _ in range(n - 1):
            terms = [t.unsqueeze(1) for t in terms]
        keys = terms[0] if keys is None else keys + terms[0]
        if heads is not None:
            bias = terms[1] if bias is None else bias + terms[1]
        key_step, table_step = key_step * L, table_step * (2 * K - 1)
    k = keys + (stride * shift + k_off)
    if padded:  # a key in the padding: token 0's row
        k = torch.clamp(k, min=k_off)
    k = k.reshape(-1)
    v = k if v_off == k_off else k + (v_off - k_off)
    q = torch.arange(stride * shift, stride * (math.prod(spatial) + shift), stride,
                     device=device)
    if heads is not None:
        taps = math.prod(kernel_size)
        bias = bias.reshape(-1, taps, 1) \
            + torch.arange(0, heads * table_step, table_step, device=device)
    return _Rows(q, k, v, bias)


def _shared_rows(like: torch.Tensor, spatial, kernel_size: Tuple[int, ...],
                 dilation: Tuple[int, ...], padded: bool, stride: int,
                 heads: Optional[int]) -> _Rows:
    """:func:`_na_rows` once per torch.export trace and geometry
    (:func:`attnzoo.backends.export_memo`): a stage's blocks share them."""
    return backends.export_memo(("na", *spatial, kernel_size, dilation, padded, stride, heads,
                                 like.device), like, _na_rows, spatial, kernel_size, dilation,
                                like.device, padded, stride, heads)


def _na_export_core(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, rows: _Rows,
                    taps: int, rpb: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """NA's export formula: ``q [B, N, 1, heads, c]``, keys and values gathered by one
    ``index_select`` each from the rows ``[B, M, 1, heads, c]`` (``K**n`` copies, which
    inference affords), one softmax over each query's keys; returns ``[B, N, heads, c_v]``."""
    B, heads = q.shape[0], q.shape[-2]
    k = k_rows.index_select(1, rows.k).reshape(B, -1, taps, heads, k_rows.shape[-1])
    logits = ((q * scale if scale != 1 else q) * k).sum(-1)         # [B, N, K**n, heads]
    if rpb is not None:
        bias = rpb.reshape(-1)[rows.bias]
        logits = logits + (bias if bias.dtype == logits.dtype else bias.to(logits.dtype))
    # the softmax before the unsqueeze: onnxruntime's Softmax over a dim that is not the last
    # ran 6x slower on [B, N, K**n, heads, 1] than on [B, N, K**n, heads]
    p = logits.softmax(2).unsqueeze(-1)
    v = v_rows.index_select(1, rows.v).reshape(B, -1, taps, heads, v_rows.shape[-1])
    return (p * v).sum(2)


def na_export_rows(qkv: torch.Tensor, spatial, kernel_size: Tuple[int, ...],
                   dilation: Tuple[int, ...], rpb: Optional[torch.Tensor], scale: float,
                   padded: bool) -> torch.Tensor:
    """NA's export formula on one tensor of rows ``qkv [B, 3 * T, 1, heads, c]`` (rows
    ``3t, 3t + 1, 3t + 2``: token ``t``'s q, k and v; as a qkv projection's output reshapes),
    over the map of sizes ``spatial`` flattened row-major; returns ``[B, N, heads, c]``.

    ``padded``: each axis is taken as zero-padded at its end to at least ``K * d`` (as
    ``NeighborhoodAttention2d`` pads small inputs), and token 0 is the padding's, which every
    key in the padding reads: no shape holds the padded size (a max() of the size, which made
    every later shape's symbolic work slower)."""
    rows = _shared_rows(qkv, spatial, kernel_size, dilation, padded, 3,
                        qkv.shape[-2] if rpb is not None else None)
    return _na_export_core(qkv.index_select(1, rows.q), qkv, qkv, rows,
                           math.prod(kernel_size), rpb, scale)


def na_export(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: Tuple[int, ...],
              dilation: Tuple[int, ...], rpb: Optional[torch.Tensor],
              scale: float, qkv: Optional[torch.Tensor] = None) -> torch.Tensor:
    """NA as an export graph, one per axis count whatever the input size and kernel: each
    axis's window indices are computed from the input's shape and combined into one index of
    every query's ``K**n`` keys in the flattened map (:func:`_na_rows`, once per size and
    kernel in a torch.export trace: :func:`attnzoo.backends.export_memo`); keys and values are
    gathered by one ``index_select`` each and the softmax runs over each query's keys.

    Its node count is what the dynamo exporter's time follows: every node costs symbolic-shape
    work in torch.export and its decompositions, and again in the translation and onnxscript's
    optimizer (BENCHMARKS.md "ONNX export"). Hence the shared index, one gather per tensor,
    unsqueeze rather than reshape where the sizes come from the input, and no cast to the dtype
    a tensor already has (it would be two nodes)."""
    n = len(kernel_size)
    B, spatial, heads = q.shape[0], q.shape[1:1 + n], q.shape[-2]
    rows = _shared_rows(q, spatial, kernel_size, dilation, False, 1,
                        heads if rpb is not None else None)
    k_rows, v_rows = (x.reshape(B, -1, 1, heads, x.shape[-1]) for x in (k, v))
    out = _na_export_core(q.reshape(B, -1, 1, heads, q.shape[-1]), k_rows, v_rows, rows,
                          math.prod(kernel_size), rpb, scale)
    return out.reshape_as(v)  # v's shape (the TorchScript exporter reads it in two nodes)


# --------------------------------------------------------------------------------------------
# NATTEN backend
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _natten():
    """(module, api) with api "fused" (NATTEN >= 0.20: na{n}d, no RPB) or "legacy" (<= 0.17.5:
    na{n}d_qk / na{n}d_av with RPB); (None, reason) when NATTEN is not usable."""
    try:
        import natten
        import natten.functional as nf
    except ImportError as e:
        return None, (f"NATTEN is not installed ({e}); install it with "
                      "`pip install --no-build-isolation \"natten>=0.20\"` (after torch)")
    if hasattr(nf, "na2d_qk") and hasattr(nf, "na2d_av"):
        return nf, "legacy"
    if hasattr(natten, "na2d"):
        return natten, "fused"
    return None, f"NATTEN {getattr(natten, '__version__', '?')} has neither na2d nor na2d_qk"


class NACall(NamedTuple):
    """What backend selection needs to know about an NA call (hashable, cached)."""
    ndim: int
    device: str   # the torch device with its index ("cuda:1", "cpu"): support is per device
    dtype: torch.dtype
    head_dim: int
    rpb: bool
    grad: bool
    kernel_size: Tuple[int, ...] = ()  # () where unknown: no kernel-size limit is checked
    v_dim: int = 0                     # 0: same as head_dim
    wide: bool = False                 # beyond the kernels' offsets (kernels.wide_offsets)


def _device_type(call: NACall) -> str:
    return torch.device(call.device).type


_NATTEN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _natten_limits(call: NACall) -> Optional[str]:
    """What NATTEN >= 0.20 (the one that builds against today's torch) never runs."""
    if call.rpb:
        return "NATTEN >= 0.20 has no relative positional bias (rpb)"
    if call.kernel_size and min(call.kernel_size) < 2:
        return f"NATTEN >= 0.20 needs kernel_size >= 2, got {call.kernel_size}"
    if call.dtype not in _NATTEN_DTYPES:
        return f"NATTEN supports {', '.join(map(str, _NATTEN_DTYPES))}, not {call.dtype}"
    return None


def _natten_support(call: NACall) -> Optional[str]:
    module, api = _natten()
    if module is None:
        # what the NATTEN that installs today could not run either comes first: installing
        # it would not help (NATTEN <= 0.17.5, with rpb, builds only against older torch)
        limit = _natten_limits(call)
        return api if limit is None else f"{limit}, and NATTEN is not installed"
    if api == "legacy":
        return None
    limit = _natten_limits(call)
    if limit is not None:
        return limit
    if _device_type(call) == "cpu":
        # NATTEN >= 0.20 on CPU runs PyTorch's unfused FlexAttention: forward only, one
        # power-of-two head dim >= 8 for q, k and v (NATTEN 0.21 finds no CPU backend else).
        if call.grad:
            return "NATTEN's CPU path has no backward (inputs require grad)"
        if call.head_dim & (call.head_dim - 1) or call.head_dim < 8:
            return (f"NATTEN's CPU path needs a power-of-two head_dim >= 8, got "
                    f"{call.head_dim}")
        if call.v_dim not in (0, call.head_dim):
            return (f"NATTEN's CPU path needs v's head dim equal to q's, got {call.v_dim} and "
                    f"{call.head_dim}")
    elif _device_type(call) != "cuda":
        return f"NATTEN runs on CPU and CUDA tensors, not {_device_type(call)}"
    return None


def _na_natten(q, k, v, kernel_size, dilation, rpb, scale, qkv=None):
    module, api = _natten()
    n = len(kernel_size)
    ks = kernel_size if n > 1 else kernel_size[0]
    dil = dilation if n > 1 else dilation[0]
    if api == "fused":
        if not torch.is_grad_enabled():  # NATTEN refuses inputs that require grad on CPU
            q, k, v = q.detach(), k.detach(), v.detach()
        if scale == 0:  # NATTEN reads a scale of 0 as "the default": the same zero logits
            q, scale = q * 0, 1.0
        try:
            return getattr(module, f"na{n}d")(q, k, v, kernel_size=ks, dilation=dil, scale=scale)
        except NotImplementedError as e:
            raise backends.BackendUnsupportedError(
                f"backend 'natten' cannot run na{n}d here: {str(e).rstrip('.')}. Backends that "
                "can: 'torch', 'auto'.") from e
    # NATTEN <= 0.17.5: unfused QK (+RPB) / AV on heads-first [B, heads, *spatial, d] tensors.
    to_heads_first = lambda t: t.movedim(-2, 1)  # noqa: E731
    attn = getattr(module, f"na{n}d_qk")(to_heads_first(q) * scale, to_heads_first(k), ks, dil,
                                         rpb=rpb)
    out = getattr(module, f"na{n}d_av")(attn.softmax(dim=-1), to_heads_first(v), ks, dil)
    return out.movedim(1, -2)


# --------------------------------------------------------------------------------------------
# attnzoo Triton kernels (the "cuda" backend)
# --------------------------------------------------------------------------------------------

def _cuda_support(call: NACall) -> Optional[str]:
    reason = kernels.triton_missing()
    if reason is not None:
        return reason
    from ..kernels import neighborhood as kernel
    return kernels.joined(
        kernel.support(call.device, call.dtype, call.head_dim, call.v_dim or call.head_dim,
                       call.kernel_size, backward=call.grad),
        kernel.LIMITS.offsets_reason() if call.wide else None)


def _cuda_limits(call: NACall) -> Optional[str]:
    """The kernels' limits that the call alone decides; they are declared in the kernel
    module, which needs Triton: without it they go unchecked here (``support`` refuses)."""
    if kernels.triton_missing() is not None:
        return None
    from ..kernels import neighborhood as kernel
    return "; ".join(kernel.call_reasons(call.dtype, call.head_dim, call.v_dim or call.head_dim,
                                         call.kernel_size)) or None


def _na_cuda(q, k, v, kernel_size, dilation, rpb, scale, qkv=None):
    # the kernel module: imported by _cuda_support, which resolving the call's backend ran
    # first (an import statement here costs ~1 us a call)
    return kernels.neighborhood.na_fused(q, k, v, kernel_size, dilation, rpb, scale, qkv=qkv)


def _kernels_trusted(call: NACall) -> Optional[str]:
    """``auto`` runs our kernels only where a verification record covers the call's GPU
    architecture, dtype and Triton (:func:`attnzoo.kernels.verified`); an explicit
    ``backend="cuda"`` always runs them."""
    return kernels.unverified("neighborhood", call.device, call.dtype,
                              "the cuda NA kernels")


def _na_macs(q, k, v, kernel_size, dilation, rpb, scale, qkv=None) -> int:
    """QK and AV, ``B * heads * tokens * head_dim * kernel_area`` each (fvcore's convention)."""
    return q.shape[:-1].numel() * (q.shape[-1] + v.shape[-1]) * math.prod(kernel_size)


def _examples(n: int):
    """NAT-tiny's stage shapes (224 px, batch 8: 56/28/14/7, heads 2/4/8/16, head dim 32, K 7,
    RPB) and DiNAT's dilated ones; 1-D: a long sequence."""
    if n == 2:
        cases = [(f"nat_tiny s{i} 8x{56 >> i}x{56 >> i}x{2 << i}x32 k7",
                  (8, 56 >> i, 56 >> i, 2 << i, 32), 7, 1) for i in range(4)]
        cases += [("dinat s0 d8", (8, 56, 56, 2, 32), 7, 8),
                  ("dinat s2 d2", (8, 14, 14, 8, 32), 7, 2)]
    else:
        cases = [("1d 8x4096x4x32 k13", (8, 4096, 4, 32), 13, 1),
                 ("1d 8x4096x4x32 k13 d4", (8, 4096, 4, 32), 13, 4)]

    def examples(device, dtype):
        out = []
        for label, shape, K, d in cases:
            def run(backend, shape=shape, K=K, d=d):
                q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                           for _ in range(3))
                rpb = torch.zeros((shape[-2],) + (2 * K - 1,) * n, device=device, dtype=dtype,
                                  requires_grad=True)
                fn = na2d if n == 2 else na1d
                return fn(q, k, v, kernel_size=K, dilation=d, rpb=rpb, backend=backend)
            out.append((label, run))
        return out
    return examples


# Check cases: (label, [B, *spatial, heads, head_dim], kernel_size, dilation, rpb, scale, v_dim).
# Small enough for Triton's interpreter; between them: clamped windows at every border, dilation
# groups of unequal length, non-square kernels, kernel_size * dilation equal to the map, several
# reference tiles per group, kernel 1, batch 2, two heads, a scale, a value dim unlike the head
# dim, and calls without rpb at power-of-two head dims (which NATTEN's CPU path takes).
_CASES = {
    2: [("9x11 k3 d(2,1) rpb scale", (1, 9, 11, 1, 8), 3, (2, 1), True, 0.7, None),
        ("7x10 k(5,3) d(1,3)", (1, 7, 10, 1, 16), (5, 3), (1, 3), False, None, None),
        ("10x10 k5 d2=map rpb vdim12", (1, 10, 10, 1, 8), 5, 2, True, None, 12),
        ("17x6 k3 tiles", (1, 17, 6, 1, 8), 3, 1, False, None, None),
        ("5x6 k1 d(2,1) rpb h2", (1, 5, 6, 2, 4), 1, (2, 1), True, None, None)],
    1: [("40 k7 rpb h2 tiles", (1, 40, 2, 8), 7, 1, True, None, None),
        ("19 k5 d3 scale b2", (2, 19, 1, 16), 5, 3, False, 0.5, None),
        ("12 k3 d4=map rpb", (1, 12, 1, 4), 3, 4, True, None, None)],
}


def _cases(n: int):
    def cases(device, dtype):
        out = []
        for label, shape, kernel_size, dilation, rpb, scale, v_dim in _CASES[n]:
            ks = _as_tuple(kernel_size, n, "kernel_size")
            shapes = [shape, shape, shape[:-1] + (v_dim or shape[-1],)]
            if rpb:
                shapes.append((shape[-2],) + tuple(2 * K - 1 for K in ks))

            def call(q, k, v, rpb=None, *, backend, ks=ks, dil=dilation, scale=scale):
                return (na2d if n == 2 else na1d)(q, k, v, kernel_size=ks, dilation=dil,
                                                  rpb=rpb, scale=scale, backend=backend)
            out.append(backends.Case(label, backends.case_inputs(shapes, device, dtype), call))
        return out
    return cases


for _n in (1, 2):
    backends.register_op(
        f"na{_n}d", key_type=NACall, macs=_na_macs, examples=_examples(_n), cases=_cases(_n),
        export=na_export, backends={"torch": backends.Backend(_na_torch),
                  "natten": backends.Backend(_na_natten, _natten_support,
                                             limits=_natten_limits),
                  "cuda": backends.Backend(_na_cuda, _cuda_support, _kernels_trusted,
                                           _cuda_limits)})
backends.on_reset(_natten.cache_clear, kernels.triton_missing.cache_clear,
                  kernels.triton_version.cache_clear, kernels.records.cache_clear)


# --------------------------------------------------------------------------------------------
# public ops
# --------------------------------------------------------------------------------------------

def _checked_call(q, k, v, kernel_size, dilation, rpb, scale, n: int, qkv):
    """:func:`_check_call` once per call metadata (:func:`attnzoo.backends.checked_once`:
    ``qkv``'s, whose views q, k and v are, where the call is packed); returns (kernel_size,
    dilation, the call's keys without and with gradients, whether a tensor is empty). Int
    windows only: a tuple may hold a bool, which equals an int."""
    def check():
        ks, dil = _check_call(q, k, v, kernel_size, dilation, rpb, scale, n, _NAMES[n, packed])
        wide = kernels.wide_offsets(q, k, v)  # the output and gradients: as v, contiguous
        return ks, dil, tuple(NACall(n, str(q.device), q.dtype, q.shape[-1], rpb is not None,
                                     grad, ks, v.shape[-1], wide) for grad in (False, True)), (
            q.numel() == 0 or v.numel() == 0)

    packed = qkv is not None
    tensors = backends.tensors_key(qkv, rpb) if packed else backends.tensors_key(q, k, v, rpb)
    key = None
    if type(kernel_size) is int and type(dilation) is int and tensors is not None:
        # (a float scale's finiteness too: a NaN after a finite scale is still refused)
        key = ("na", n, packed, kernel_size, dilation, type(scale),
               isinstance(scale, float) and not _finite(scale), tensors)
    return backends.checked_once(key, check)


_NAMES = {(n, packed): f"na{n}d_qkv" if packed else f"na{n}d" for n in (1, 2)
          for packed in (False, True)}  # the public ops, for messages


def _autocast(*tensors):
    """Under autocast, NA computes in autocast's dtype, as F.scaled_dot_product_attention
    does, whatever the backend (the torch reference's matmuls cast, NATTEN and the kernels
    would not): floating tensors but fp64 are cast; rpb stays (each backend rounds it)."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in tensors)


def _na(n, q, k, v, kernel_size, dilation, rpb, scale, backend, qkv=None):
    if not isinstance(scale, (float, int)) and isinstance(scale, numbers.Real):
        scale = float(scale)  # (a NumPy float: the op's schema takes a Python float)
    if qkv is None and torch._C._is_any_autocast_enabled() and all(
            isinstance(t, torch.Tensor) for t in (q, k, v)):  # (else _check_call says why)
        q, k, v = _autocast(q, k, v)
    ks, dil, calls, empty = _checked_call(q, k, v, kernel_size, dilation, rpb, scale, n, qkv)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or rpb is not None and rpb.requires_grad)
    packed = () if qkv is None else (qkv,)  # (na2d's implementations take seven arguments)
    return backends.dispatch(_NAMES[n, False], calls[grad], backend, q, k, v, ks, dil, rpb,
                             scale, *packed, empty=empty)


def _na_qkv(n, qkv, kernel_size, dilation, rpb, scale, backend):
    fn = f"na{n}d_qkv"
    layout = "[B, L, 3, heads, head_dim]" if n == 1 else "[B, H, W, 3, heads, head_dim]"
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"{fn}: qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != n + 4 or qkv.shape[n + 1] != 3:
        raise ValueError(f"{fn}: qkv must be {n + 4}-D {layout}, got shape {tuple(qkv.shape)}")
    if not qkv.is_floating_point():
        raise TypeError(f"{fn}: qkv must be a floating-point tensor, got {qkv.dtype}")
    if torch._C._is_any_autocast_enabled():
        qkv, = _autocast(qkv)
    q, k, v = qkv.unbind(n + 1)
    return _na(n, q, k, v, kernel_size, dilation, rpb, scale, backend, qkv)


def na2d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kernel_size: IntOrTuple,
         dilation: IntOrTuple = 1, rpb: Optional[torch.Tensor] = None,
         scale: Optional[float] = None, backend: Optional[str] = None) -> torch.Tensor:
    """2-D (dilated) neighborhood attention.

    Args:
        q, k, v: ``[B, H, W, heads, head_dim]``.
        kernel_size: odd window size (int or ``(kh, kw)``); ``kernel_size * dilation <= H, W``.
        dilation: dilation (int or ``(dh, dw)``).
        rpb: optional relative positional bias ``[heads, 2kh-1, 2kw-1]``, added unscaled.
        scale: logit scale applied to q (default ``head_dim ** -0.5``).
        backend: one of :data:`attnzoo.backends.BACKENDS`; ``None`` follows
            :func:`attnzoo.use_backend` / :func:`attnzoo.set_backend` / ``ATTNZOO_BACKEND``.

    Returns:
        ``[B, H, W, heads, head_dim]``.

    Precision of ``backend="cuda"`` (attnzoo's Triton kernels): fp16 / bf16 inputs run on the
    tensor cores, accumulating in fp32. fp32 inputs use TF32 tensor cores only where
    ``torch.get_float32_matmul_precision()`` allows it (``"high"`` or ``"medium"``, as for
    torch's own fp32 matmuls); by default (``"highest"``) they are computed in exact fp32.
    The first call of each shape, kernel size, dilation, head dim and dtype on a GPU times a
    few launch configurations of each kernel (cached for the process). ``auto`` picks these
    kernels only where a verification record covers the GPU's architecture, the dtype and the
    Triton (:func:`attnzoo.kernels.verified`); ``backend="cuda"`` runs them on any supported GPU.
    """
    return _na(2, q, k, v, kernel_size, dilation, rpb, scale, backend)


def na1d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kernel_size: IntOrTuple,
         dilation: IntOrTuple = 1, rpb: Optional[torch.Tensor] = None,
         scale: Optional[float] = None, backend: Optional[str] = None) -> torch.Tensor:
    """1-D (dilated) neighborhood attention on ``[B, L, heads, head_dim]``; ``rpb`` is
    ``[heads, 2K-1]``. Same semantics and backends as :func:`na2d`."""
    return _na(1, q, k, v, kernel_size, dilation, rpb, scale, backend)


def na2d_qkv(qkv: torch.Tensor, *, kernel_size: IntOrTuple, dilation: IntOrTuple = 1,
             rpb: Optional[torch.Tensor] = None, scale: Optional[float] = None,
             backend: Optional[str] = None) -> torch.Tensor:
    """:func:`na2d` of q, k and v packed in one tensor ``qkv`` ``[B, H, W, 3, heads,
    head_dim]`` (a qkv projection's output, reshaped): ``na2d(*qkv.unbind(3), ...)``, the
    same on every backend. The ``cuda`` backend's eager calls then write q's, k's and v's
    gradients into one tensor of qkv's shape, where the three views' gradients would be stacked
    by ``unbind``'s backward: one copy of the projection's size and two allocations fewer per
    call (a compiled graph keeps the views and their stack, which Inductor generates)."""
    return _na_qkv(2, qkv, kernel_size, dilation, rpb, scale, backend)


def na1d_qkv(qkv: torch.Tensor, *, kernel_size: IntOrTuple, dilation: IntOrTuple = 1,
             rpb: Optional[torch.Tensor] = None, scale: Optional[float] = None,
             backend: Optional[str] = None) -> torch.Tensor:
    """1-D :func:`na2d_qkv`: ``qkv`` ``[B, L, 3, heads, head_dim]``."""
    return _na_qkv(1, qkv, kernel_size, dilation, rpb, scale, backend)


# --------------------------------------------------------------------------------------------
# unfused NA: NATTEN 0.17's two-step API (na{n}d_qk, then na{n}d_av)
# --------------------------------------------------------------------------------------------

def _key_rows(spatial, kernel_size, dilation, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every query's ``K**n`` keys as positions in the row-major flattened map, and their rows
    of the row-major rpb table, ``[N * K**n]`` each (:func:`_na_rows`, unpadded, one head)."""
    rows = _na_rows(spatial, kernel_size, dilation, device, False, 1, 1)  # one head's bias rows
    return rows.k, rows.bias.reshape(-1)


@functools.lru_cache(maxsize=64)
def _window_keys_cached(spatial, kernel_size, dilation, device):
    with torch.inference_mode(False):  # cached: never inference tensors (see _plan)
        return _key_rows(spatial, kernel_size, dilation, device)


@torch.compiler.assume_constant_result  # a constant of a compiled graph, as the plan
def _window_keys_constant(*args):
    return _window_keys_cached(*args)


_window_keys_constant.__name__ = "_attnzoo_na_window_keys"  # see _plan_constant


def _window_keys(spatial, kernel_size, dilation, like: torch.Tensor):
    """:func:`_key_rows`: cached per size in eager and compiled calls, and derived from the
    input's shape (once per trace) while exporting."""
    if backends.exporting():
        return backends.export_memo(("na", *spatial, kernel_size, dilation, False, like.device),
                                    like, _key_rows, spatial, kernel_size, dilation, like.device)
    return _window_keys_constant(tuple(static_size(s) for s in spatial), kernel_size, dilation,
                                 like.device)


def na_qk_reference(q: torch.Tensor, k: torch.Tensor, kernel_size: Tuple[int, ...],
                    dilation: Tuple[int, ...], rpb: Optional[torch.Tensor]) -> torch.Tensor:
    """Every query's window logits ``[B, *spatial, heads, K**n]`` (already validated): ``q . k``
    over the window's keys in row-major order, plus the unscaled ``rpb`` entry of each key's
    offset; no scale. One gather of the keys (``K**n`` copies of k), then a dot product."""
    n = len(kernel_size)
    B, spatial, heads, c = q.shape[0], q.shape[1:1 + n], q.shape[-2], q.shape[-1]
    key, rel = _window_keys(spatial, kernel_size, dilation, q)
    taps, N = math.prod(kernel_size), math.prod(spatial)  # sizes, never -1: a batch may be 0
    keys = k.reshape(B, N, heads, c).index_select(1, key).reshape(B, N, taps, heads, c)
    logits = torch.einsum("bnhc,bnthc->bnht", q.reshape(B, N, heads, c), keys)
    if rpb is not None:
        bias = rpb.to(logits.dtype).reshape(heads, -1).index_select(1, rel)
        logits = logits + bias.reshape(heads, N, taps).transpose(0, 1)
    return logits.reshape(*q.shape[:-1], taps)


def na_av_reference(attn: torch.Tensor, v: torch.Tensor, kernel_size: Tuple[int, ...],
                    dilation: Tuple[int, ...]) -> torch.Tensor:
    """``sum_t attn[..., t] * v[key t of the query's window]``, ``[B, *spatial, heads, d_v]``
    (already validated); the weights are used as given (no softmax)."""
    n = len(kernel_size)
    B, spatial, heads, c = v.shape[0], v.shape[1:1 + n], v.shape[-2], v.shape[-1]
    key, _ = _window_keys(spatial, kernel_size, dilation, v)
    taps, N = math.prod(kernel_size), math.prod(spatial)
    values = v.reshape(B, N, heads, c).index_select(1, key).reshape(B, N, taps, heads, c)
    out = torch.einsum("bnht,bnthc->bnhc", attn.reshape(B, N, heads, taps), values)
    return out.reshape(v.shape)


def _unfused_natten_limits(call: NACall) -> Optional[str]:
    return (f"NATTEN >= 0.20 has no unfused na{call.ndim}d_qk / na{call.ndim}d_av "
            "(they were removed in 0.20; NATTEN <= 0.17.5 has them)")


def _unfused_natten_support(call: NACall) -> Optional[str]:
    module, api = _natten()
    if module is None:
        return api
    return None if api == "legacy" else _unfused_natten_limits(call)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(-2, 1)  # [B, *spatial, heads, c] -> NATTEN 0.17's [B, heads, *spatial, c]


def _na_qk_natten(q, k, kernel_size, dilation, rpb):
    module, _ = _natten()
    n = len(kernel_size)
    fn = getattr(module, f"na{n}d_qk")
    out = fn(_heads_first(q), _heads_first(k), kernel_size if n > 1 else kernel_size[0],
             dilation if n > 1 else dilation[0], rpb=rpb)
    return out.movedim(1, -2)


def _na_av_natten(attn, v, kernel_size, dilation):
    module, _ = _natten()
    n = len(kernel_size)
    fn = getattr(module, f"na{n}d_av")
    out = fn(_heads_first(attn), _heads_first(v), kernel_size if n > 1 else kernel_size[0],
             dilation if n > 1 else dilation[0])
    return out.movedim(1, -2)


def _qk_macs(q, k, kernel_size, dilation, rpb) -> int:
    return q.shape[:-1].numel() * q.shape[-1] * math.prod(kernel_size)


def _av_macs(attn, v, kernel_size, dilation) -> int:
    return v.shape[:-1].numel() * v.shape[-1] * math.prod(kernel_size)


def _public(n: int, step: str):
    return globals()[f"na{n}d_{step}"]  # defined below


def _unfused_examples(n: int, step: str):
    """NAT-tiny's first and last 2-D stages (224 px, batch 8) and DiNAT's dilated first stage;
    1-D: a long sequence."""
    cases = ([("nat_tiny s0 8x56x56x2x32 k7", (8, 56, 56, 2, 32), 7, 1),
              ("nat_tiny s3 8x7x7x16x32 k7", (8, 7, 7, 16, 32), 7, 1),
              ("dinat s0 d8", (8, 56, 56, 2, 32), 7, 8)] if n == 2 else
             [("1d 8x4096x4x32 k13", (8, 4096, 4, 32), 13, 1)])

    def examples(device, dtype):
        out = []
        for label, shape, K, d in cases:
            def run(backend, shape=shape, K=K, d=d):
                q, k = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                        for _ in range(2))
                if step == "qk":
                    rpb = torch.zeros((shape[-2],) + (2 * K - 1,) * n, device=device,
                                      dtype=dtype, requires_grad=True)
                    return _public(n, "qk")(q, k, kernel_size=K, dilation=d, rpb=rpb,
                                            backend=backend)
                attn = torch.randn(shape[:-1] + (K ** n,), device=device, dtype=dtype,
                                   requires_grad=True)
                return _public(n, "av")(attn, k, kernel_size=K, dilation=d, backend=backend)
            out.append((label, run))
        return out
    return examples


def _unfused_cases(n: int, step: str):
    """The fused op's check cases (:data:`_CASES`: borders, dilation groups of unequal length,
    non-square kernels, kernel 1, value dims unlike the head dim), as qk or av calls."""
    def cases(device, dtype):
        out = []
        for label, shape, kernel_size, dilation, rpb, _, v_dim in _CASES[n]:
            ks = _as_tuple(kernel_size, n, "kernel_size")
            if step == "qk":
                shapes = [shape, shape] + ([(shape[-2],) + tuple(2 * K - 1 for K in ks)]
                                           if rpb else [])

                def call(q, k, rpb=None, *, backend, ks=ks, dil=dilation):
                    return _public(n, "qk")(q, k, kernel_size=ks, dilation=dil, rpb=rpb,
                                            backend=backend)
                label = label.replace(" vdim12", "").replace(" scale", "")
            else:
                shapes = [shape[:-1] + (math.prod(ks),), shape[:-1] + (v_dim or shape[-1],)]

                def call(attn, v, *, backend, ks=ks, dil=dilation):
                    return _public(n, "av")(attn, v, kernel_size=ks, dilation=dil,
                                            backend=backend)
                label = label.replace(" rpb", "").replace(" scale", "")
            out.append(backends.Case(label, backends.case_inputs(shapes, device, dtype), call))
        return out
    return cases


for _n in (1, 2):
    backends.register_op(
        f"na{_n}d_qk", key_type=NACall, macs=_qk_macs, examples=_unfused_examples(_n, "qk"),
        cases=_unfused_cases(_n, "qk"), backends={
            "torch": backends.Backend(na_qk_reference),
            "natten": backends.Backend(_na_qk_natten, _unfused_natten_support,
                                       limits=_unfused_natten_limits)})
    backends.register_op(
        f"na{_n}d_av", key_type=NACall, macs=_av_macs, examples=_unfused_examples(_n, "av"),
        cases=_unfused_cases(_n, "av"), backends={
            "torch": backends.Backend(na_av_reference),
            "natten": backends.Backend(_na_av_natten, _unfused_natten_support,
                                       limits=_unfused_natten_limits)})


def na_window_positions(spatial: Sequence[int], *, kernel_size: IntOrTuple,
                        dilation: IntOrTuple = 1,
                        device: Optional[torch.device] = None) -> torch.Tensor:
    """Where each query's window lies: ``[*spatial, K**n, n]`` (an int64 tensor), entry
    ``[*query, t]`` the position (``(y, x)`` in 2-D) of the key whose score is entry ``t`` of
    :func:`na2d_qk` (and of each layer's attention map)."""
    spatial = tuple(spatial)
    n = len(spatial)
    ks, dil = _check_window("na_window_positions", n, kernel_size, dilation, spatial)
    key = _na_rows(spatial, ks, dil, device or torch.device("cpu"), False, 1, None).k
    key = key.reshape(*spatial, math.prod(ks))
    axes = []
    for L in reversed(spatial):  # row-major flat index -> per-axis positions
        axes.append(key % L)
        key = torch.div(key, L, rounding_mode="floor")
    return torch.stack(axes[::-1], -1)


def _grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _na_qk(n, q, k, kernel_size, dilation, rpb, backend):
    fn = f"na{n}d_qk"
    _check_tensors(fn, n, "head_dim", q=q, k=k)
    if q.shape != k.shape:
        raise ValueError(f"{fn}: q and k must have the same shape; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    if q.shape[-1] < 1:
        raise ValueError(f"{fn}: q and k need a head_dim >= 1, got shape {tuple(q.shape)}")
    ks, dil = _check_window(fn, n, kernel_size, dilation, tuple(q.shape[1:1 + n]))
    _check_rpb(fn, rpb, q.shape[-2], ks, q.device)
    call = NACall(n, str(q.device), q.dtype, q.shape[-1], rpb is not None, _grad(q, k, rpb), ks)
    return backends.dispatch(fn, call, backend, q, k, ks, dil, rpb)


def _na_av(n, attn, v, kernel_size, dilation, backend):
    fn = f"na{n}d_av"
    _check_tensors(fn, n, "kernel_area", attn=attn, v=v)
    ks, dil = _check_window(fn, n, kernel_size, dilation, tuple(v.shape[1:1 + n]))
    if attn.shape[:-1] != v.shape[:-1] or attn.shape[-1] != math.prod(ks):
        raise ValueError(
            f"{fn}: attn must be [B, *spatial, heads, K**n] = "
            f"{tuple(v.shape[:-1]) + (math.prod(ks),)} for v {tuple(v.shape)} and kernel_size "
            f"{ks}, got {tuple(attn.shape)}")
    call = NACall(n, str(v.device), v.dtype, v.shape[-1], False, _grad(attn, v), ks)
    return backends.dispatch(fn, call, backend, attn, v, ks, dil)


def na2d_qk(q: torch.Tensor, k: torch.Tensor, *, kernel_size: IntOrTuple,
            dilation: IntOrTuple = 1, rpb: Optional[torch.Tensor] = None,
            backend: Optional[str] = None) -> torch.Tensor:
    """The first step of unfused 2-D NA, NATTEN 0.17's ``na2d_qk``: every query's scores
    against its window's keys.

    Args:
        q, k: ``[B, H, W, heads, head_dim]`` (heads-last, as :func:`na2d`). ``q`` is not scaled
            here: scale it first (``q * head_dim ** -0.5``) as NATTEN 0.17's callers do.
        kernel_size, dilation: as :func:`na2d`; the window of each query is :func:`na2d`'s
            (clamped at the borders, per dilation group).
        rpb: optional ``[heads, 2kh-1, 2kw-1]`` relative positional bias, added unscaled.
        backend: ``torch`` (any device and float dtype), ``natten`` (NATTEN <= 0.17.5 only), or
            ``auto``; as :func:`na2d`.

    Returns:
        ``[B, H, W, heads, kh*kw]``: entry ``a * kw + b`` is the window's key in row ``a``,
        column ``b`` (row-major, as NATTEN 0.17). ``softmax(-1)`` of it, given to
        :func:`na2d_av`, makes :func:`na2d`: ``na2d_av(na2d_qk(q * s, k, ..., rpb=rpb)
        .softmax(-1), v, ...) == na2d(q, k, v, ..., rpb=rpb, scale=s)``.

    NATTEN 0.17's tensors are heads-first, ``[B, heads, H, W, d]``: ``t.movedim(1, -2)``
    turns one into ours, and ``t.movedim(-2, 1)`` back.

    The semantics are NATTEN 0.17.5's (window start ``clamp(i // d - K // 2, 0, Lg - K) * d +
    i % d`` per axis: ``natten_cpu_commons.h``'s ``get_window_start``; the bias entry
    ``K - 1 + (key - query) / d``: ``get_pb_start``; the ``K*K`` axis row-major:
    ``pointwise_neighborhood_2d.hpp``). Where ours differs: heads-last tensors and keyword
    sizes; ``kernel_size`` 1 is accepted (NATTEN needs > 1); any float dtype on CPU (NATTEN's
    CPU path: float32/float64) and any strides (NATTEN: contiguous); no ``additional_keys``
    or ``is_causal``.
    """
    return _na_qk(2, q, k, kernel_size, dilation, rpb, backend)


def na2d_av(attn: torch.Tensor, v: torch.Tensor, *, kernel_size: IntOrTuple,
            dilation: IntOrTuple = 1, backend: Optional[str] = None) -> torch.Tensor:
    """The second step of unfused 2-D NA, NATTEN 0.17's ``na2d_av``: each query's weighted sum
    of its window's values.

    Args:
        attn: ``[B, H, W, heads, kh*kw]`` weights in :func:`na2d_qk`'s order, used as given
            (apply the softmax first).
        v: ``[B, H, W, heads, d_v]``; ``d_v`` may differ from the queries' head dim.
        kernel_size, dilation, backend: as :func:`na2d_qk`.

    Returns:
        ``[B, H, W, heads, d_v]``.
    """
    return _na_av(2, attn, v, kernel_size, dilation, backend)


def na1d_qk(q: torch.Tensor, k: torch.Tensor, *, kernel_size: IntOrTuple,
            dilation: IntOrTuple = 1, rpb: Optional[torch.Tensor] = None,
            backend: Optional[str] = None) -> torch.Tensor:
    """1-D :func:`na2d_qk`: ``[B, L, heads, head_dim]`` q and k, ``rpb`` ``[heads, 2K-1]``;
    returns ``[B, L, heads, K]``."""
    return _na_qk(1, q, k, kernel_size, dilation, rpb, backend)


def na1d_av(attn: torch.Tensor, v: torch.Tensor, *, kernel_size: IntOrTuple,
            dilation: IntOrTuple = 1, backend: Optional[str] = None) -> torch.Tensor:
    """1-D :func:`na2d_av`: ``[B, L, heads, K]`` weights and ``[B, L, heads, d_v]`` values."""
    return _na_av(1, attn, v, kernel_size, dilation, backend)
