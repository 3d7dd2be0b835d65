"""Shared helpers of the NA op tests (test modules import helpers from here, never from one
another): random NA inputs, the gradients of a fixed random weighting, and a stand-in for
NATTEN 0.17's legacy API (the ``legacy_natten`` fixture in conftest.py)."""
from __future__ import annotations

import types

import torch

from oracles import na_window


def make_inputs(shape, rpb_kernel=None, dtype=torch.float64, v_dim=None, seed=0,
                requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape, generator=g, dtype=dtype)
    k = torch.randn(shape, generator=g, dtype=dtype)
    vshape = shape if v_dim is None else shape[:-1] + (v_dim,)
    v = torch.randn(vshape, generator=g, dtype=dtype)
    rpb = None
    if rpb_kernel is not None:
        ks = (rpb_kernel,) if isinstance(rpb_kernel, int) else tuple(rpb_kernel)
        rpb = torch.randn((shape[-2],) + tuple(2 * K - 1 for K in ks), generator=g, dtype=dtype)
    tensors = [q, k, v] + ([rpb] if rpb is not None else [])
    for t in tensors:
        t.requires_grad_(requires_grad)
    return q, k, v, rpb


def grads_of(out, inputs, seed=1):
    """Gradients of a random weighted sum of ``out`` (the weights drawn in float64, so every
    dtype sees the same weights)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad((out * w).sum(), inputs)


def fake_legacy_natten():
    """A stand-in for NATTEN 0.17: na{1,2}d_qk / na{1,2}d_av on heads-first tensors, computed
    from the brute-force windows. Like NATTEN 0.17 it does not scale q, adds the bias unscaled,
    orders the K*K neighbours row-major, and casts the bias to the key's dtype."""
    calls = []

    def axis_tables(L, K, d):
        idx = torch.tensor([na_window(L, K, d, i) for i in range(L)])         # [L, K]
        rel = (idx - torch.arange(L).unsqueeze(1)) // d + K - 1             # [L, K]
        return idx, rel

    def as_tuple(x, n):
        return (x,) * n if isinstance(x, int) else tuple(x)

    def na2d_qk(query, key, kernel_size, dilation=1, additional_keys=None, is_causal=False,
                rpb=None):
        calls.append("na2d_qk")
        B, heads, H, W, D = query.shape
        assert key.shape == query.shape and additional_keys is None and not is_causal
        (KH, KW), (dh, dw) = as_tuple(kernel_size, 2), as_tuple(dilation, 2)
        iy, ry = axis_tables(H, KH, dh)
        ix, rx = axis_tables(W, KW, dw)
        # neighbour n = a * KW + b of query (y, x) is key (iy[y, a], ix[x, b])
        Y = iy[:, None, :, None].expand(H, W, KH, KW).reshape(H, W, KH * KW)
        X = ix[None, :, None, :].expand(H, W, KH, KW).reshape(H, W, KH * KW)
        keys = key[:, :, Y, X]                                                 # [B,h,H,W,KK,D]
        attn = torch.einsum("bhyxd,bhyxnd->bhyxn", query, keys)
        if rpb is not None:
            assert rpb.shape == (heads, 2 * KH - 1, 2 * KW - 1), "rpb must be [heads, 2K-1, 2K-1]"
            RY = ry[:, None, :, None].expand(H, W, KH, KW).reshape(H, W, KH * KW)
            RX = rx[None, :, None, :].expand(H, W, KH, KW).reshape(H, W, KH * KW)
            attn = attn + rpb.to(key.dtype)[:, RY, RX].unsqueeze(0)
        return attn

    def na2d_av(attn, value, kernel_size, dilation=1, additional_values=None, is_causal=False):
        calls.append("na2d_av")
        B, heads, H, W, E = value.shape
        (KH, KW), (dh, dw) = as_tuple(kernel_size, 2), as_tuple(dilation, 2)
        assert attn.shape == (B, heads, H, W, KH * KW)
        iy, _ = axis_tables(H, KH, dh)
        ix, _ = axis_tables(W, KW, dw)
        Y = iy[:, None, :, None].expand(H, W, KH, KW).reshape(H, W, KH * KW)
        X = ix[None, :, None, :].expand(H, W, KH, KW).reshape(H, W, KH * KW)
        return torch.einsum("bhyxn,bhyxne->bhyxe", attn.to(value.dtype), value[:, :, Y, X])

    def na1d_qk(query, key, kernel_size, dilation=1, additional_keys=None, is_causal=False,
                rpb=None):
        calls.append("na1d_qk")
        B, heads, L, D = query.shape
        K, d = as_tuple(kernel_size, 1)[0], as_tuple(dilation, 1)[0]
        idx, rel = axis_tables(L, K, d)
        attn = torch.einsum("bhld,bhlnd->bhln", query, key[:, :, idx])
        if rpb is not None:
            assert rpb.shape == (heads, 2 * K - 1)
            attn = attn + rpb.to(key.dtype)[:, rel].unsqueeze(0)
        return attn

    def na1d_av(attn, value, kernel_size, dilation=1, additional_values=None, is_causal=False):
        calls.append("na1d_av")
        L = value.shape[2]
        K, d = as_tuple(kernel_size, 1)[0], as_tuple(dilation, 1)[0]
        idx, _ = axis_tables(L, K, d)
        return torch.einsum("bhln,bhlne->bhle", attn.to(value.dtype), value[:, :, idx])

    functional = types.ModuleType("natten.functional")
    for fn in (na2d_qk, na2d_av, na1d_qk, na1d_av):
        setattr(functional, fn.__name__, fn)
    natten = types.ModuleType("natten")
    natten.__version__ = "0.17.5"
    natten.functional = functional
    return natten, functional, calls
