"""Independent reference math: one brute force per op (neighborhood attention, QnA, SAN's
footprint ops) and the pieces of the model-level oracles, written from the papers' and specs'
equations as plain loops and index arithmetic, sharing nothing with attnzoo but the tensors it is
handed (float64 recommended). The op tests check attnzoo's torch reference against these; the
reference then checks every other backend (tests/test_ops_registry.py)."""
from __future__ import annotations

import itertools
import math

import torch


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim: (x - mean) / sqrt(var + eps) * weight + bias (biased var)."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def gelu_exact(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x @ weight.T
    return y if bias is None else y + bias


def na_window(L: int, K: int, d: int, i: int) -> list:
    """Key positions along one axis of query ``i`` (NAT spec: clamped windows per dilation
    group): g = i % d, ip = i // d, Lg = ceil((L - g) / d), start = min(max(ip - K//2, 0), Lg - K),
    keys (start + t) * d + g for t < K."""
    g, ip = i % d, i // d
    lg = -(-(L - g) // d)
    start = min(max(ip - K // 2, 0), lg - K)
    return [(start + t) * d + g for t in range(K)]


def _per_axis(value, n: int) -> tuple:
    return (value,) * n if isinstance(value, int) else tuple(value)


def neighborhood_attention(q, k, v, kernel_size, dilation, rpb=None, scale=None) -> torch.Tensor:
    """NA / dilated NA, 1-D or 2-D: ``[B, *spatial, heads, D]`` q and k, ``[B, *spatial, heads,
    E]`` v -> like v. Query by query: its keys are every combination of its per-axis windows
    (:func:`na_window`, row-major), the logits ``q.k * scale + rpb[h, (key - query) / d + K - 1
    per axis]`` (bias unscaled, optional; scale default ``D ** -0.5``), a softmax over them, the
    weighted sum of v. ``kernel_size`` and ``dilation``: an int or one per axis."""
    n = q.dim() - 3
    ks, dil = _per_axis(kernel_size, n), _per_axis(dilation, n)
    spatial = tuple(q.shape[1:1 + n])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    every = (slice(None),)
    rows = []
    for query in itertools.product(*map(range, spatial)):
        windows = [na_window(L, K, d, i) for L, K, d, i in zip(spatial, ks, dil, query)]
        axes = list(zip(*itertools.product(*windows)))                  # per axis, every key's
        index = tuple(torch.tensor(a) for a in axes)
        logits = torch.einsum("bhd,bnhd->bhn", q[every + query] * scale, k[every + index])
        if rpb is not None:
            offset = tuple(torch.tensor([(key - i) // d + K - 1 for key in a])
                           for a, i, d, K in zip(axes, query, dil, ks))
            logits = logits + rpb[every + offset].to(logits.dtype)
        rows.append(torch.einsum("bhn,bnhe->bhe", logits.softmax(-1), v[every + index]))
    return torch.stack(rows, 1).reshape(q.shape[:-1] + v.shape[-1:])


def _windows(spatial, ks, dil, query) -> list:
    """Per axis, the positions of every key of ``query``'s window, in row-major order."""
    windows = [na_window(L, K, d, i) for L, K, d, i in zip(spatial, ks, dil, query)]
    return list(zip(*itertools.product(*windows)))


def na_scores(q, k, kernel_size, dilation, rpb=None) -> torch.Tensor:
    """NATTEN 0.17's ``na{n}d_qk`` on heads-last tensors: ``[B, *spatial, heads, K**n]``, entry
    ``t`` the plain dot product ``q . k`` with the ``t``-th key of the query's window (row-major
    over the per-axis windows, :func:`na_window`) plus ``rpb[h, (key - query) / d + K - 1 per
    axis]``; no scale."""
    n = q.dim() - 3
    ks, dil = _per_axis(kernel_size, n), _per_axis(dilation, n)
    spatial = tuple(q.shape[1:1 + n])
    every = (slice(None),)
    rows = []
    for query in itertools.product(*map(range, spatial)):
        axes = _windows(spatial, ks, dil, query)
        index = tuple(torch.tensor(a) for a in axes)
        logits = torch.einsum("bhd,bnhd->bhn", q[every + query], k[every + index])
        if rpb is not None:
            offset = tuple(torch.tensor([(key - i) // d + K - 1 for key in a])
                           for a, i, d, K in zip(axes, query, dil, ks))
            logits = logits + rpb[every + offset].to(logits.dtype)
        rows.append(logits)
    return torch.stack(rows, 1).reshape(q.shape[:-1] + (math.prod(ks),))


def na_weighted_sum(attn, v, kernel_size, dilation) -> torch.Tensor:
    """NATTEN 0.17's ``na{n}d_av`` on heads-last tensors: each query's ``sum_t attn[..., t] *
    v[t-th key of its window]``, ``[B, *spatial, heads, E]``."""
    n = v.dim() - 3
    ks, dil = _per_axis(kernel_size, n), _per_axis(dilation, n)
    spatial = tuple(v.shape[1:1 + n])
    every = (slice(None),)
    rows = []
    for query in itertools.product(*map(range, spatial)):
        index = tuple(torch.tensor(a) for a in _windows(spatial, ks, dil, query))
        rows.append(torch.einsum("bhn,bnhe->bhe", attn[every + query], v[every + index]))
    return torch.stack(rows, 1).reshape(v.shape)


def qna(logits, v, k: int, stride: int, rpb, window_weights, sum_queries: bool = True
        ) -> torch.Tensor:
    """QnA's local aggregation (spec: shared/specs/qna_vit.md): ``logits [B, H, W, L, heads]``
    (each learned query against each key), ``v [B, H, W, heads, D]``, ``rpb`` and
    ``window_weights`` ``[L, heads, k, k]``. Output ``(i, j)`` takes the in-bounds keys of the
    ``k x k`` window centred at input ``(i * stride, j * stride)`` (out-of-bounds ones excluded),
    a softmax per query and head over logit + rpb[offset], the softmax weights times
    window_weights[offset] times the values summed over the window, then over the queries unless
    ``sum_queries=False``: ``[B, Ho, Wo, heads, D]`` (``[B, Ho, Wo, L, heads, D]``)."""
    B, H, W, L, h = logits.shape
    r = k // 2
    Ho, Wo = -(-H // stride), -(-W // stride)
    rows = []
    for i in range(Ho):
        row = []
        for j in range(Wo):
            taps = [(a, b, i * stride + a - r, j * stride + b - r)
                    for a in range(k) for b in range(k)]
            taps = [t for t in taps if 0 <= t[2] < H and 0 <= t[3] < W]
            z = torch.stack([logits[:, y, x] + rpb[:, :, a, b] for a, b, y, x in taps], -1)
            weight = z.softmax(-1) * torch.stack([window_weights[:, :, a, b]
                                                  for a, b, _, _ in taps], -1)
            values = torch.stack([v[:, y, x] for _, _, y, x in taps], 1)   # [B, n, h, d]
            row.append(torch.einsum("blhn,bnhd->blhd", weight, values))
        rows.append(torch.stack(row, 1))
    out = torch.stack(rows, 1)                                               # [B, Ho, Wo, L, h, d]
    return out.sum(3) if sum_queries else out


def reflect(i: int, n: int) -> int:
    """nn.ReflectionPad2d's source index of position ``i`` on an axis of length ``n`` (the edge
    is not repeated): ``-i`` below 0, ``2(n-1) - i`` past the end; one reflection only."""
    if i < 0:
        i = -i
    if i >= n:
        i = 2 * (n - 1) - i
    assert 0 <= i < n, "a single reflection must land inside the map"
    return i


def relu(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x, torch.zeros_like(x))


def batch_norm(x: torch.Tensor, weight, bias, running_mean, running_var, eps: float,
               training: bool) -> torch.Tensor:
    """BatchNorm on channel dim 1: with batch statistics (biased variance) over every other dim
    when ``training``, else the running ones."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    if training:
        dims = [d for d in range(x.dim()) if d != 1]
        mean = x.mean(dims, keepdim=True)
        var = ((x - mean) ** 2).mean(dims, keepdim=True)
    else:
        mean, var = running_mean.view(shape), running_var.view(shape)
    return (x - mean) / torch.sqrt(var + eps) * weight.view(shape) + bias.view(shape)


def san_footprint(x, kernel_size, dilation, stride, padding_mode: str = "reflect"
                  ) -> torch.Tensor:
    """SAN's footprint gather (spec: shared/specs/san.md, the official CUDA ops' index
    arithmetic): ``x [N, C, H, W] -> [N, C, kh*kw, Ho*Wo]``, tap ``t = a * kw + b`` of output
    ``(ho, wo)`` (``L = ho * Wo + wo``) reads input row ``ho*s - p + a*d`` and column
    ``wo*s - p + b*d``, ``p = d * (k - 1) // 2`` per axis, reflected once (:func:`reflect`) or
    read as zero (``padding_mode="zeros"``); ``Ho, Wo = ceil(H / s), ceil(W / s)``. Every size
    argument: an int or a pair."""
    N, C, H, W = x.shape
    (kh, kw), (dh, dw), (sh, sw) = (_per_axis(a, 2) for a in (kernel_size, dilation, stride))
    ph, pw = dh * (kh - 1) // 2, dw * (kw - 1) // 2
    outputs = [(ho, wo) for ho in range(-(-H // sh)) for wo in range(-(-W // sw))]
    taps = [(a, b) for a in range(kh) for b in range(kw)]
    rows = [[ho * sh - ph + a * dh for ho, _ in outputs] for a, _ in taps]
    cols = [[wo * sw - pw + b * dw for _, wo in outputs] for _, b in taps]
    if padding_mode == "reflect":
        return x[:, :, torch.tensor([[reflect(r, H) for r in rs] for rs in rows]),
                 torch.tensor([[reflect(c, W) for c in cs] for cs in cols])]
    inside = torch.tensor([[0 <= r < H and 0 <= c < W for r, c in zip(rs, cs)]
                           for rs, cs in zip(rows, cols)])
    clamp = lambda i, n: min(max(i, 0), n - 1)  # noqa: E731  (any in-range index: masked)
    gathered = x[:, :, torch.tensor([[clamp(r, H) for r in rs] for rs in rows]),
                 torch.tensor([[clamp(c, W) for c in cs] for cs in cols])]
    return gathered * inside


def san_centre(x, stride) -> torch.Tensor:
    """``x`` at every output position's centre tap ``(ho*s, wo*s)``: ``[N, C, 1, Ho*Wo]``."""
    sh, sw = _per_axis(stride, 2)
    return x[:, :, ::sh, ::sw].flatten(2).unsqueeze(2)


def san_subtraction(x1, x2, kernel_size, dilation, stride, padding_mode: str = "reflect"
                    ) -> torch.Tensor:
    """SAN's subtraction relation ``x1(centre) - x2(tap)``, ``[N, C, kh*kw, Ho*Wo]`` (with
    ``x1 = x2``: its relative position encoding)."""
    return san_centre(x1, stride) - san_footprint(x2, kernel_size, dilation, stride,
                                                  padding_mode)


def san_aggregation(x, weight, kernel_size, dilation, stride, padding_mode: str = "reflect"
                    ) -> torch.Tensor:
    """``y[n, c, ho, wo] = sum_t weight[n, c % Cw, t, ho*Wo + wo] * x(tap t)``: the weights
    ``[N, Cw, kh*kw, Ho*Wo]`` shared interleaved (channel c uses weight channel c % Cw)."""
    N, C, H, W = x.shape
    sh, sw = _per_axis(stride, 2)
    shared = weight[:, [c % weight.shape[1] for c in range(C)]]            # [N, C, kk, L]
    out = (shared * san_footprint(x, kernel_size, dilation, stride, padding_mode)).sum(2)
    return out.view(N, C, -(-H // sh), -(-W // sw))
