"""Independent reference math for the model-level oracles: written from the papers' and specs'
equations, sharing nothing with attnzoo but the weights it is handed (float64 recommended)."""
from __future__ import annotations

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
    group): g = i % d, ip = i // d, Lg = ceil((L - g) / d), start = min(max(ip - K//2, 0), Lg - K)."""
    g, ip = i % d, i // d
    lg = -(-(L - g) // d)
    start = min(max(ip - K // 2, 0), lg - K)
    return [(start + t) * d + g for t in range(K)]


def neighborhood_attention(q, k, v, K: int, d: int, rpb, scale: float) -> torch.Tensor:
    """[B, H, W, heads, hd] -> same; softmax over each query's K x K clamped window of
    q.k * scale + rpb[h, dy/d + K - 1, dx/d + K - 1] (rpb may be None)."""
    B, H, W, heads, _ = q.shape
    out = torch.empty_like(v)
    for y in range(H):
        ys = na_window(H, K, d, y)
        for x in range(W):
            xs = na_window(W, K, d, x)
            keys = [(a, b) for a in ys for b in xs]
            kk = torch.stack([k[:, a, b] for a, b in keys], 1)            # [B, KK, heads, hd]
            vv = torch.stack([v[:, a, b] for a, b in keys], 1)
            logits = torch.einsum("bhd,bnhd->bhn", q[:, y, x] * scale, kk)
            if rpb is not None:
                logits = logits + torch.stack(
                    [rpb[:, (a - y) // d + K - 1, (b - x) // d + K - 1] for a, b in keys], -1)
            out[:, y, x] = torch.einsum("bhn,bnhd->bhd", logits.softmax(-1), vv)
    return out


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
