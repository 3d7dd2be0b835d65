"""Tests of the neighborhood-attention ops (attnzoo.ops.neighborhood) and the backend switch.

The oracle is an independent brute force written from the spec (shared/specs/nat.md,
tests/oracles.py): plain Python loops over the queries, each window computed from the per-axis
formula

    g = i % d, ip = i // d, Lg = ceil((L - g) / d), start = min(max(ip - K//2, 0), Lg - K),
    neighbours (start + t) * d + g,  t < K,

logits q.k * scale + rpb[h, (ky - qy)/d + K - 1, (kx - qx)/d + K - 1] (bias unscaled), softmax
over the K*K neighbourhood, weighted sum of v; in float64. Nothing from attnzoo.ops is reused.
It checks the torch reference here; the reference checks every other backend on the op's
registered cases (tests/test_ops_registry.py).
"""
from __future__ import annotations

import math
import re
import sys

import numpy as np
import pytest
import torch

import attnzoo
from attnzoo import backends
from attnzoo.backends import BackendUnsupportedError
from attnzoo.ops import na1d, na1d_qkv, na2d, na2d_qkv
from attnzoo.ops import neighborhood as nbh
from na_inputs import grads_of, make_inputs
from oracles import na_window, neighborhood_attention

pytestmark = pytest.mark.floor  # also run on the lowest torch and timm admitted (.ci/floor)


# --------------------------------------------------------------------------------------------
# the independent brute force (tests/oracles.py)
# --------------------------------------------------------------------------------------------

def test_window_formula_by_hand():
    """Guard the oracle itself against a hand-worked example."""
    assert [na_window(5, 3, 1, i) for i in range(5)] == [
        [0, 1, 2], [0, 1, 2], [1, 2, 3], [2, 3, 4], [2, 3, 4]]
    # L=7, d=2: group 0 = 0,2,4,6 (Lg 4), group 1 = 1,3,5 (Lg 3, exactly K)
    assert [na_window(7, 3, 2, i) for i in range(7)] == [
        [0, 2, 4], [1, 3, 5], [0, 2, 4], [1, 3, 5], [2, 4, 6], [1, 3, 5], [2, 4, 6]]
    for L, K, d in [(13, 5, 2), (23, 7, 3), (12, 3, 4)]:
        for i in range(L):
            w = na_window(L, K, d, i)
            assert len(set(w)) == K and i in w and all(0 <= j < L and j % d == i % d for j in w)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------

def _pair(x):
    return (x, x) if isinstance(x, int) else tuple(x)


# --------------------------------------------------------------------------------------------
# torch reference vs brute force, forward and backward (float64)
# --------------------------------------------------------------------------------------------

# (B, H, W, heads, D), kernel, dilation, rpb, scale, v_dim
CASES_2D = [
    pytest.param((2, 7, 9, 2, 4), 3, 1, True, None, None, id="k3d1-odd"),
    pytest.param((1, 9, 11, 3, 5), 3, 2, True, None, None, id="k3d2-notdivisible"),
    pytest.param((1, 11, 13, 2, 4), 5, 2, False, None, None, id="k5d2-norpb"),
    pytest.param((1, 13, 10, 1, 3), 3, 3, True, 0.7, None, id="k3d3-scale"),
    pytest.param((1, 12, 13, 2, 4), 3, 4, True, None, None, id="k3d4-H=K*d"),
    pytest.param((1, 7, 8, 2, 4), 7, 1, True, None, None, id="k7d1-H=K"),
    pytest.param((1, 10, 14, 1, 4), 5, 2, True, None, 6, id="k5d2-H=K*d-vdim6"),
    pytest.param((1, 15, 8, 2, 4), 7, (2, 1), True, None, None, id="k7d(2,1)"),
    pytest.param((1, 9, 10, 2, 4), (5, 3), (1, 3), True, None, None, id="k(5,3)d(1,3)"),
    pytest.param((1, 13, 7, 1, 4), (3, 7), (4, 1), False, 0.25, None, id="k(3,7)d(4,1)-W=K"),
    pytest.param((2, 6, 5, 2, 3), 1, (2, 1), True, None, None, id="k1"),
    # tiled path: a dilation group longer than max(16, 2K) on an axis
    pytest.param((1, 40, 23, 2, 4), 7, 1, True, None, None, id="tiled-40x23-k7d1"),
    pytest.param((2, 70, 9, 1, 4), 3, (2, 3), True, None, None, id="tiled-70x9-k3d(2,3)-b2"),
    pytest.param((1, 55, 10, 1, 4), 5, (3, 2), True, None, None, id="tiled-55x10-k5d(3,2)"),
    pytest.param((1, 37, 18, 1, 3), (3, 5), 1, False, None, None, id="tiled-37x18-k(3,5)-norpb"),
    # tiled along H with a padded last tile, one dense tile along W, no dilation
    pytest.param((1, 21, 14, 1, 4), 7, 1, True, None, None, id="tiled-21x14-k7d1-padded"),
    pytest.param((2, 19, 9, 2, 3), 3, 1, False, None, None, id="tiled-19x9-k3d1-padded"),
]


@pytest.mark.parametrize("shape,kernel,dilation,use_rpb,scale,v_dim", CASES_2D)
def test_na2d_torch_matches_brute_force(shape, kernel, dilation, use_rpb, scale, v_dim):
    ks = _pair(kernel)
    q, k, v, rpb = make_inputs(shape, ks if use_rpb else None, v_dim=v_dim, requires_grad=True)
    inputs = [t for t in (q, k, v, rpb) if t is not None]

    out = na2d(q, k, v, kernel_size=kernel, dilation=dilation, rpb=rpb, scale=scale,
               backend="torch")
    expected = neighborhood_attention(q, k, v, ks, dilation, rpb, scale)
    assert out.shape == expected.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)

    got_grads = grads_of(out, inputs)
    exp_grads = grads_of(expected, inputs)
    for name, g, e in zip("qkvr", got_grads, exp_grads):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad {name}: {m}")


def test_tiled_cases_really_tile(monkeypatch):
    """The 'tiled-*' cases above must exercise the tiled path: the reference's attention calls
    see fewer keys per query row than a whole dilation group holds (not one dense masked
    attention). Spies on SDPA."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append(k.shape[-2])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(nbh.F, "scaled_dot_product_attention", spy)
    for spatial, ks, dil in [((40, 23), 7, 1), ((70, 9), 3, (2, 3)), ((55, 10), 5, (3, 2)),
                             ((37, 18), (3, 5), 1)]:
        seen.clear()
        q, k, v, _ = make_inputs((1,) + spatial + (1, 2))
        na2d(q, k, v, kernel_size=ks, dilation=dil, backend="torch")
        assert seen, "the torch reference no longer runs through SDPA: update this spy"
        dh, dw = _pair(dil)
        group = math.ceil(spatial[0] / dh) * math.ceil(spatial[1] / dw)
        assert max(seen) < group, (spatial, ks, dil, seen, group)


def test_large_scores_go_in_batch_slices(monkeypatch):
    """With an rpb that needs a gradient on CPU, scores over glibc's mmap threshold are computed
    in batch slices (a smaller threshold stands in for 32 MiB here): same values and gradients
    as the brute force, and really sliced (the spy sees each slice's batch)."""
    monkeypatch.setattr(nbh, "_MMAP_THRESHOLD_MAX", 4096)
    batches = []
    matmul = torch.matmul

    def spy(a, b):
        batches.append(a.shape[0])
        return matmul(a, b)

    monkeypatch.setattr(nbh.torch, "matmul", spy)
    q, k, v, rpb = make_inputs((5, 21, 14, 2, 4), (7, 7), requires_grad=True)
    out = na2d(q, k, v, kernel_size=7, rpb=rpb, backend="torch")
    monkeypatch.setattr(nbh.torch, "matmul", matmul)
    assert batches and max(batches) < 5 and sum(batches) == 5, batches
    expected = neighborhood_attention(q, k, v, (7, 7), (1, 1), rpb)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    inputs = (q, k, v, rpb)
    for name, g, e in zip("qkvr", grads_of(out, inputs), grads_of(expected, inputs)):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad {name}: {m}")


def test_na2d_noncontiguous_inputs():
    """q/k/v as slices of a fused qkv tensor (what the layers pass)."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 11, 9, 3, 2, 4, generator=g, dtype=torch.float64)
    q, k, v = qkv.unbind(3)
    assert not q.is_contiguous()
    rpb = torch.randn(2, 5, 5, generator=g, dtype=torch.float64)
    out = na2d(q, k, v, kernel_size=3, dilation=(3, 2), rpb=rpb, backend="torch")
    torch.testing.assert_close(out, neighborhood_attention(q, k, v, 3, (3, 2), rpb), rtol=1e-10,
                               atol=1e-10)


def test_na2d_default_backend_is_reference_on_cpu():
    q, k, v, rpb = make_inputs((1, 8, 9, 2, 4), (3, 3))
    torch.testing.assert_close(na2d(q, k, v, kernel_size=3, rpb=rpb),
                               na2d(q, k, v, kernel_size=3, rpb=rpb, backend="torch"))


def test_na2d_gradcheck_tiny():
    q, k, v, rpb = make_inputs((1, 5, 6, 1, 2), (3, 3), requires_grad=True)
    fn = lambda q, k, v, rpb: na2d(q, k, v, kernel_size=3, dilation=(1, 2), rpb=rpb,  # noqa
                                   backend="torch")
    assert torch.autograd.gradcheck(fn, (q, k, v, rpb), eps=1e-6, atol=1e-6)


# (B, L, heads, D), kernel, dilation, rpb, scale
CASES_1D = [
    pytest.param((2, 11, 2, 4), 3, 1, True, None, id="k3d1"),
    pytest.param((1, 13, 3, 4), 5, 2, True, 0.5, id="k5d2-scale"),
    pytest.param((1, 12, 1, 4), 3, 4, False, None, id="k3d4-L=K*d"),
    pytest.param((1, 7, 2, 3), 7, 1, True, None, id="k7-L=K"),
    pytest.param((1, 40, 2, 4), 7, 1, True, None, id="tiled-k7d1"),
    pytest.param((1, 71, 1, 4), 5, 3, True, None, id="tiled-k5d3"),
    pytest.param((2, 19, 2, 4), 7, 1, True, None, id="tiled-k7d1-padded"),
]


@pytest.mark.parametrize("shape,kernel,dilation,use_rpb,scale", CASES_1D)
def test_na1d_torch_matches_brute_force(shape, kernel, dilation, use_rpb, scale):
    q, k, v, rpb = make_inputs(shape, kernel if use_rpb else None, requires_grad=True)
    inputs = [t for t in (q, k, v, rpb) if t is not None]
    out = na1d(q, k, v, kernel_size=kernel, dilation=dilation, rpb=rpb, scale=scale,
               backend="torch")
    expected = neighborhood_attention(q, k, v, kernel, dilation, rpb, scale)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for g, e in zip(grads_of(out, inputs), grads_of(expected, inputs)):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)


def test_na1d_accepts_tuple_args():
    q, k, v, _ = make_inputs((1, 9, 1, 4))
    torch.testing.assert_close(na1d(q, k, v, kernel_size=(3,), dilation=(2,)),
                               neighborhood_attention(q, k, v, 3, 2))


# --------------------------------------------------------------------------------------------
# the custom op a compiled training step runs: the reference, with its backward written out
# --------------------------------------------------------------------------------------------

_OP_CASES = [pytest.param(*p.values, id=f"2d-{p.id}") for p in CASES_2D] + [
    pytest.param(*p.values, None, id=f"1d-{p.id}") for p in CASES_1D]


@pytest.mark.parametrize("shape,kernel,dilation,use_rpb,scale,v_dim", _OP_CASES)
def test_the_custom_op_and_its_backward_match_brute_force(shape, kernel, dilation, use_rpb,
                                                         scale, v_dim):
    n = len(shape) - 3
    ks = _pair(kernel) if n == 2 else (kernel,)
    dil = _pair(dilation) if n == 2 else (dilation,)
    q, k, v, rpb = make_inputs(shape, ks if use_rpb else None, v_dim=v_dim, requires_grad=True)
    inputs = [t for t in (q, k, v, rpb) if t is not None]
    out = torch.ops.attnzoo.na_reference(q, k, v, rpb, list(ks), list(dil),
                                         shape[-1] ** -0.5 if scale is None else scale)
    expected = neighborhood_attention(q, k, v, ks, dil, rpb, scale)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for name, g, e in zip("qkvr", grads_of(out, inputs), grads_of(expected, inputs)):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("use_rpb", [True, False], ids=["rpb", "norpb"])
def test_the_custom_op_passes_opcheck(use_rpb):
    """torch.library's own checks: schema, fake (meta) kernel against the real one's shapes and
    strides, autograd registration, and AOT dispatch, on non-contiguous q, k, v as NAT's
    qkv split gives them."""
    q, k, v, rpb = make_inputs((1, 9, 10, 2, 4), (3, 3) if use_rpb else None,
                               requires_grad=True)
    qkv = torch.stack([q, k, v], 3).detach().requires_grad_()
    args = (qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :], rpb, [3, 3], [1, 2], 0.5)
    torch.library.opcheck(torch.ops.attnzoo.na_reference.default, args)


# --------------------------------------------------------------------------------------------
# low precision
# --------------------------------------------------------------------------------------------

# forward atol/rtol, grad atol/rtol (relative to values of O(1))
_TOL = {
    torch.float32: (1e-5, 1e-5, 1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3, 2e-2, 2e-2),
    torch.bfloat16: (3e-2, 3e-2, 1.5e-1, 5e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape,kernel,dilation", [
    ((1, 11, 13, 2, 8), 5, 2),
    ((1, 40, 9, 2, 8), 7, (1, 1)),   # tiled along H
])
def test_na2d_low_precision_vs_float64(dtype, shape, kernel, dilation):
    q64, k64, v64, rpb64 = make_inputs(shape, _pair(kernel), seed=5, requires_grad=True)
    ref = na2d(q64, k64, v64, kernel_size=kernel, dilation=dilation, rpb=rpb64, backend="torch")
    ref_grads = grads_of(ref, [q64, k64, v64, rpb64])

    low = [t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64)]
    rpb_low = rpb64.detach().to(dtype).requires_grad_()
    out = na2d(*low, kernel_size=kernel, dilation=dilation, rpb=rpb_low, backend="torch")
    assert out.dtype == dtype
    fa, fr, ga, gr = _TOL[dtype]
    torch.testing.assert_close(out.double(), ref.detach(), atol=fa, rtol=fr)
    grads = grads_of(out, low + [rpb_low])
    for name, g, e in zip("qkvr", grads, ref_grads):
        assert g.dtype == dtype
        # rpb grads are sums over many queries: compare relative to their magnitude.
        scale = max(1.0, e.abs().max().item()) if name == "r" else 1.0
        torch.testing.assert_close(g.double() / scale, e / scale, atol=ga, rtol=gr,
                                   msg=lambda m: f"{dtype} grad {name}: {m}")


# --------------------------------------------------------------------------------------------
# natten backend (NATTEN >= 0.20: no rpb; CPU path forward only)
# --------------------------------------------------------------------------------------------

@pytest.fixture
def natten_fused():
    natten = pytest.importorskip("natten")
    module, api = nbh._natten()
    if api != "fused":
        pytest.skip(f"installed NATTEN {getattr(natten, '__version__', '?')} uses the {api!r} API")
    return natten


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("shape,kernel,dilation,scale", [
    ((2, 9, 11, 2, 16), 3, 1, None),
    ((1, 13, 17, 2, 16), 5, 2, None),
    ((1, 12, 14, 1, 32), (3, 5), (4, 2), 0.3),
    ((1, 7, 10, 4, 8), 7, 1, None),
])
def test_natten_matches_torch_2d(natten_fused, shape, kernel, dilation, scale):
    q, k, v, _ = make_inputs(shape, dtype=torch.float32, seed=7)
    with torch.no_grad():
        got = na2d(q, k, v, kernel_size=kernel, dilation=dilation, scale=scale, backend="natten")
        ref = na2d(q, k, v, kernel_size=kernel, dilation=dilation, scale=scale, backend="torch")
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("shape,kernel,dilation", [((2, 30, 2, 16), 5, 3), ((1, 19, 1, 8), 7, 1)])
def test_natten_matches_torch_1d(natten_fused, shape, kernel, dilation):
    q, k, v, _ = make_inputs(shape, dtype=torch.float32, seed=8)
    with torch.no_grad():
        got = na1d(q, k, v, kernel_size=kernel, dilation=dilation, backend="natten")
        ref = na1d(q, k, v, kernel_size=kernel, dilation=dilation, backend="torch")
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------------------------------------
# clear errors
# --------------------------------------------------------------------------------------------

def _f32(shape=(1, 9, 9, 2, 8)):
    return make_inputs(shape, dtype=torch.float32)[:3]


def test_unknown_backend_name():
    q, k, v = _f32()
    with pytest.raises(ValueError, match="unknown backend 'tritonx'") as info:
        na2d(q, k, v, kernel_size=3, backend="tritonx")
    for name in backends.BACKENDS:
        assert name in str(info.value)
    with pytest.raises(TypeError):
        na2d(q, k, v, kernel_size=3, backend=1)


def test_backend_names_are_case_insensitive():
    q, k, v = _f32()
    torch.testing.assert_close(na2d(q, k, v, kernel_size=3, backend=" Torch "),
                               na2d(q, k, v, kernel_size=3, backend="torch"))


def test_natten_rejects_rpb(natten_fused):
    q, k, v = _f32()
    rpb = torch.zeros(2, 5, 5)
    with pytest.raises(BackendUnsupportedError, match="rpb") as info:
        na2d(q, k, v, kernel_size=3, rpb=rpb, backend="natten")
    assert "'torch'" in str(info.value)
    assert isinstance(info.value, ValueError)  # catchable as ValueError too


def test_natten_rejects_float64_and_grad_on_cpu(natten_fused):
    q, k, v, _ = make_inputs((1, 9, 9, 2, 8), dtype=torch.float64)
    with pytest.raises(BackendUnsupportedError, match="float64") as info:
        na2d(q, k, v, kernel_size=3, backend="natten")
    assert "'torch'" in str(info.value)
    q, k, v = [t.requires_grad_() for t in _f32()]
    with pytest.raises(BackendUnsupportedError, match="backward") as info:
        na2d(q, k, v, kernel_size=3, backend="natten")
    assert "'torch'" in str(info.value)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_natten_no_grad_with_requires_grad_leaves(natten_fused):
    q, k, v = [t.requires_grad_() for t in _f32()]
    with torch.no_grad():
        got = na2d(q, k, v, kernel_size=3, backend="natten")
        ref = na2d(q, k, v, kernel_size=3, backend="torch")
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


def test_natten_rejects_non_power_of_two_head_dim_on_cpu(natten_fused):
    q, k, v = _f32((1, 9, 9, 2, 12))
    with pytest.raises(BackendUnsupportedError, match="power-of-two"):
        na2d(q, k, v, kernel_size=3, backend="natten")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_natten_cpu_support_names_the_head_dims_its_path_lacks(natten_fused):
    """NATTEN 0.21's CPU path finds no backend for a head dim below 8 or a v head dim other
    than q's: the support check says so (it had said yes, then NATTEN's own message said only
    that it found no backend), and other backends' refusals do not offer natten."""
    for q_dim, v_dim, reason in ((4, 4, "head_dim >= 8, got 4"), (16, 8, "equal to q's")):
        q, k, _ = _f32((1, 8, 8, 2, q_dim))
        v = _f32((1, 8, 8, 2, v_dim))[2]
        with pytest.raises(BackendUnsupportedError, match=reason):
            na2d(q, k, v, kernel_size=3, backend="natten")
        assert "natten" not in nbh.backends.supported_backends(
            "na2d", nbh.NACall(2, "cpu", torch.float32, q_dim, False, False, (3, 3), v_dim))
    q, k, v = _f32((1, 8, 8, 2, 8))
    with torch.no_grad():
        torch.testing.assert_close(na2d(q, k, v, kernel_size=3, backend="natten"),
                                   na2d(q, k, v, kernel_size=3, backend="torch"),
                                   atol=2e-5, rtol=2e-5)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_natten_honours_a_zero_scale(natten_fused):
    """``scale=0`` (every key of a window weighs the same): NATTEN reads a scale of 0 as its
    default, head_dim ** -0.5, so the backend hands it the same zero logits another way."""
    q, k, v = _f32((1, 8, 8, 2, 16))
    with torch.no_grad():
        for zero in (0.0, -0.0, 0):
            got = na2d(q, k, v, kernel_size=3, scale=zero, backend="natten")
            torch.testing.assert_close(got, na2d(q, k, v, kernel_size=3, scale=zero,
                                                 backend="torch"), atol=2e-5, rtol=2e-5)
        assert (na2d(q, k, v, kernel_size=3, backend="natten") - got).abs().max() > 0.1


@pytest.fixture
def natten_missing(monkeypatch):
    # A None entry in sys.modules makes `import natten` raise ImportError (probed afresh: the
    # backend_state fixture forgot every probe before this).
    monkeypatch.setitem(sys.modules, "natten", None)
    monkeypatch.setitem(sys.modules, "natten.functional", None)


def test_natten_missing_message(natten_missing):
    q, k, v = _f32()
    with pytest.raises(BackendUnsupportedError, match="pip install") as info:
        na2d(q, k, v, kernel_size=3, backend="natten")
    assert "natten" in str(info.value).lower() and "'torch'" in str(info.value)
    # auto and torch are unaffected
    torch.testing.assert_close(na2d(q, k, v, kernel_size=3),
                               na2d(q, k, v, kernel_size=3, backend="torch"))


def test_natten_missing_names_first_what_installing_it_would_not_change(natten_missing):
    """With a bias (NAT's layers), NATTEN >= 0.20 could not run the call even installed: that
    comes first, before the install hint."""
    q, k, v = _f32()
    with pytest.raises(BackendUnsupportedError) as info:
        na2d(q, k, v, kernel_size=3, rpb=torch.zeros(2, 5, 5), backend="natten")
    assert ("NATTEN >= 0.20 has no relative positional bias (rpb), and NATTEN is not installed"
            in str(info.value)) and "pip install" not in str(info.value)
    with pytest.raises(BackendUnsupportedError, match=re.escape(
            'pip install --no-build-isolation "natten>=0.20"')):
        na2d(q, k, v, kernel_size=3, backend="natten")


def test_shape_and_argument_errors():
    q, k, v = _f32()
    with pytest.raises(ValueError, match="6-D|5-D"):
        na2d(q[0], k[0], v[0], kernel_size=3)
    with pytest.raises(ValueError, match="4-D"):
        na1d(q, k, v, kernel_size=3)
    with pytest.raises(ValueError, match="same shape"):
        na2d(q, k[:, :8], v, kernel_size=3)
    with pytest.raises(ValueError, match="same shape"):
        na2d(q, k, v[:, :, :8], kernel_size=3)
    with pytest.raises(ValueError, match="dtype"):
        na2d(q, k.double(), v, kernel_size=3)
    with pytest.raises(TypeError):
        na2d(q.long(), k.long(), v.long(), kernel_size=3)
    with pytest.raises(TypeError):
        na2d(q.numpy(), k, v, kernel_size=3)
    with pytest.raises(ValueError, match="odd"):
        na2d(q, k, v, kernel_size=4)
    with pytest.raises(ValueError, match="odd"):
        na2d(q, k, v, kernel_size=(3, 2))
    with pytest.raises(ValueError, match="dilation"):
        na2d(q, k, v, kernel_size=3, dilation=0)
    with pytest.raises(ValueError, match="kernel_size.*dilation"):
        na2d(q, k, v, kernel_size=5, dilation=2)        # 10 > 9
    with pytest.raises(ValueError, match="kernel_size.*dilation"):
        na2d(q, k, v, kernel_size=(3, 11))              # 11 > 9 on W only
    with pytest.raises(ValueError, match="kernel_size.*dilation"):
        na1d(q[:, 0], k[:, 0], v[:, 0], kernel_size=3, dilation=4)
    for bad in (3.0, "3", (3, 3, 3), (3,), True, None, (3, 3.0)):
        with pytest.raises(TypeError, match="^na2d: kernel_size"):
            na2d(q, k, v, kernel_size=bad)
    with pytest.raises(TypeError, match="^na2d: dilation"):
        na2d(q, k, v, kernel_size=3, dilation=1.5)
    for bad in (float("nan"), float("inf"), float("-inf"), np.float64("nan")):
        na2d(q, k, v, kernel_size=3, scale=type(bad)(0.5))  # a finite scale first: a warm key
        with pytest.raises(ValueError, match="^na2d: scale must be finite"):
            na2d(q, k, v, kernel_size=3, scale=bad)
    # NumPy's integers are ints, its floats floats
    torch.testing.assert_close(na2d(q, k, v, kernel_size=np.int64(3), dilation=(np.int32(1), 2)),
                               na2d(q, k, v, kernel_size=3, dilation=(1, 2)), rtol=0, atol=0)
    torch.testing.assert_close(na2d(q, k, v, kernel_size=3, scale=np.float32(0.25)),
                               na2d(q, k, v, kernel_size=3, scale=0.25), rtol=0, atol=0)
    with pytest.raises(TypeError, match="^na2d: scale must be a float"):
        na2d(q, k, v, kernel_size=3, scale=np.bool_(True))


@pytest.mark.parametrize("n", [1, 2])
def test_packed_qkv_is_na_of_its_three_views(n):
    """na{n}d_qkv(qkv) on the torch backend: the brute-force formula on qkv.unbind(-3), forward
    and the gradients of qkv (the three views' in one tensor) and rpb."""
    g = torch.Generator().manual_seed(3)
    spatial, ks = ((9, 11), (3, 5)) if n == 2 else ((17,), (5,))
    qkv = torch.randn(2, *spatial, 3, 2, 8, generator=g, dtype=torch.float64,
                      requires_grad=True)
    rpb = torch.randn(2, *(2 * K - 1 for K in ks), generator=g, dtype=torch.float64,
                      requires_grad=True)
    op = na2d_qkv if n == 2 else na1d_qkv
    out = op(qkv, kernel_size=ks, dilation=2 if n == 1 else (2, 1), rpb=rpb, scale=0.4,
             backend="torch")
    expected = neighborhood_attention(*qkv.unbind(-3), ks, 2 if n == 1 else (2, 1), rpb, 0.4)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for got, exp in zip(grads_of(out, [qkv, rpb]), grads_of(expected, [qkv, rpb])):
        torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-10)


def test_packed_qkv_errors_name_the_argument():
    qkv = torch.randn(1, 9, 9, 3, 2, 8)
    with pytest.raises(ValueError, match=r"na2d_qkv: qkv must be 6-D \[B, H, W, 3, heads"):
        na2d_qkv(qkv[:, :, :, :2], kernel_size=3)
    with pytest.raises(ValueError, match=r"na1d_qkv: qkv must be 5-D \[B, L, 3, heads"):
        na1d_qkv(qkv, kernel_size=3)
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        na2d_qkv(qkv.numpy(), kernel_size=3)
    with pytest.raises(TypeError, match="na2d_qkv: qkv must be a floating-point"):
        na2d_qkv(qkv.long(), kernel_size=3)
    with pytest.raises(ValueError, match=r"na2d_qkv: kernel_size \* dilation"):
        na2d_qkv(qkv, kernel_size=5, dilation=2)


def test_a_warm_call_skips_the_checks_that_its_metadata_passed(monkeypatch):
    """The checks run once per call metadata; a call differing in anything they decide by (a
    bias's shape, a bool window, which equals an int) is checked again and refused."""
    checks = []
    check = nbh._check_call
    monkeypatch.setattr(nbh, "_check_call", lambda *a: checks.append(a) or check(*a))
    monkeypatch.setattr(backends, "_CHECKED", {})
    q, k, v = _f32()
    rpb = torch.randn(q.shape[-2], 5, 5)
    for _ in range(3):
        na2d(q, k, v, kernel_size=3, rpb=rpb)
        na2d(q, k, v, kernel_size=1, rpb=rpb[:, 2:3, 2:3])
    assert len(checks) == 2
    with pytest.raises(ValueError, match="rpb must have shape"):
        na2d(q, k, v, kernel_size=3, rpb=rpb[:, :3])
    with pytest.raises(TypeError, match="kernel_size"):
        na2d(q, k, v, kernel_size=True, rpb=rpb[:, 2:3, 2:3])
    with pytest.raises(TypeError, match="kernel_size"):
        na2d(q, k, v, kernel_size=(True, 1), rpb=rpb[:, 2:3, 2:3])
    with pytest.raises(TypeError, match="scale"):
        na2d(q, k, v, kernel_size=3, rpb=rpb, scale=True)
    with pytest.raises(ValueError, match="dtype"):
        na2d(q, k.double(), v, kernel_size=3, rpb=rpb)


def test_rpb_errors():
    q, k, v = _f32()
    for bad_shape in [(2, 5), (2, 3, 5), (3, 5, 5), (2, 5, 5, 1), (2, 4, 4)]:
        with pytest.raises(ValueError, match="rpb"):
            na2d(q, k, v, kernel_size=3, rpb=torch.zeros(bad_shape))
    with pytest.raises(ValueError, match="rpb"):
        na1d(q[:, 0], k[:, 0], v[:, 0], kernel_size=3, rpb=torch.zeros(2, 5, 5))
    with pytest.raises(TypeError, match="rpb"):
        na2d(q, k, v, kernel_size=3, rpb=[[0.0]])


# --------------------------------------------------------------------------------------------
# backend selection precedence
# --------------------------------------------------------------------------------------------

@pytest.fixture
def spy(monkeypatch):
    """Make every backend of na1d/na2d supported, auto prefer natten on CPU, and record which
    implementation runs."""
    calls = []

    def make(name):
        def impl(q, k, v, kernel_size, dilation, rpb, scale):
            calls.append(name)
            return v.clone()
        return impl

    for op in ("na1d", "na2d"):
        monkeypatch.setitem(backends._OPS, op, backends._OPS[op])  # restored afterwards
        backends.register_op(op, backends={name: backends.Backend(make(name))
                                           for name in backends.CONCRETE_BACKENDS},
                             macs=lambda *args: 0, key_type=nbh.NACall)
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ("natten", "torch"))
    return calls


def _run2d(**kw):
    q, k, v = _f32()
    na2d(q, k, v, kernel_size=3, **kw)


def test_precedence_chain(spy, monkeypatch):
    _run2d()
    assert spy[-1] == "natten"                       # auto (the spy's order)
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    _run2d()
    assert spy[-1] == "torch"                        # env > auto
    attnzoo.set_backend("cuda")
    _run2d()
    assert spy[-1] == "cuda"                         # set_backend > env
    with attnzoo.use_backend("natten"):
        _run2d()
        assert spy[-1] == "natten"                   # context > set_backend
        _run2d(backend="torch")
        assert spy[-1] == "torch"                    # explicit > context
        with attnzoo.use_backend("torch"):
            _run2d()
            assert spy[-1] == "torch"
        _run2d()
        assert spy[-1] == "natten"                   # nested context restored
    _run2d()
    assert spy[-1] == "cuda"                         # outer context restored
    attnzoo.set_backend(None)
    _run2d()
    assert spy[-1] == "torch"                        # cleared -> env again
    monkeypatch.delenv(backends.ENV_VAR)
    _run2d()
    assert spy[-1] == "natten"                       # -> auto
    _run2d(backend="auto")
    assert spy[-1] == "natten"


def test_context_restored_after_exception(spy):
    with pytest.raises(RuntimeError):
        with attnzoo.use_backend("cuda"):
            raise RuntimeError("boom")
    _run2d()
    assert spy[-1] == "natten"
    assert backends.get_backend() == "auto"


def test_explicit_auto_overrides_context(spy):
    with attnzoo.use_backend("torch"):
        _run2d(backend="auto")
    assert spy[-1] == "natten"


def test_get_backend_and_resolve_precedence(monkeypatch):
    call = nbh.NACall(2, "cpu", torch.float32, 32, False, False)
    assert backends.get_backend() == "auto"
    assert backends.resolve("na2d", call) == "torch"          # auto on CPU -> torch
    monkeypatch.setenv(backends.ENV_VAR, "cuda")
    assert backends.get_backend() == "cuda"
    attnzoo.set_backend("torch")
    assert backends.get_backend() == "torch"
    with attnzoo.use_backend("natten"):
        assert backends.get_backend() == "natten"
        assert backends.get_backend("cuda") == "cuda"
        with attnzoo.use_backend("auto"):
            assert backends.get_backend() == "auto"
            assert backends.resolve("na2d", call) == "torch"
        assert backends.get_backend() == "natten"
    assert backends.get_backend() == "torch"
    assert backends.resolve("na2d", call) == "torch"
    attnzoo.set_backend(None)
    assert backends.get_backend() == "cuda"
    # env asks for cuda explicitly; the reason is the device, or Triton where it is too old
    with pytest.raises(BackendUnsupportedError, match=r"'cuda' cannot run na2d.*(CUDA tensors|"
                                                      r"Triton \S+ is too old)"):
        backends.resolve("na2d", call)


def test_auto_on_cpu_picks_torch_even_with_natten():
    pytest.importorskip("natten")
    for call in [nbh.NACall(2, "cpu", torch.float32, 32, False, False),
                 nbh.NACall(2, "cpu", torch.float16, 64, False, False),
                 nbh.NACall(1, "cpu", torch.float32, 32, True, True)]:
        assert backends.resolve(f"na{call.ndim}d", call) == "torch"


def test_auto_on_cuda_order(natten_fused, monkeypatch):
    no_rpb = nbh.NACall(2, "cuda", torch.float16, 32, False, True)
    with_rpb = nbh.NACall(2, "cuda", torch.float16, 32, True, True)
    # our fused kernels first where verified on the GPU's architecture (none here: simulated in
    # tests/test_kernels_neighborhood.py), with or without rpb
    cuda = backends._OPS["na2d"].backends["cuda"]
    verified = cuda.support(no_rpb) is None and cuda.trusted(no_rpb) is None
    assert backends.resolve("na2d", no_rpb) == ("cuda" if verified else "natten")
    assert backends.resolve("na2d", with_rpb) == ("cuda" if verified else "torch")
    monkeypatch.setitem(sys.modules, "triton", None)
    backends.reset()  # Triton probed again
    assert backends.resolve("na2d", no_rpb) == "natten"   # without Triton
    assert backends.resolve("na2d", with_rpb) == "torch"


def test_invalid_names_fail_fast(monkeypatch):
    with pytest.raises(ValueError, match="accepted"):
        attnzoo.set_backend("fast")
    with pytest.raises(TypeError):
        attnzoo.set_backend(3)
    with pytest.raises(ValueError, match="accepted"):
        with attnzoo.use_backend("gpu"):
            pass
    assert backends.get_backend() == "auto"
    monkeypatch.setenv(backends.ENV_VAR, "gpu")
    q, k, v = _f32()
    with pytest.raises(ValueError, match=backends.ENV_VAR) as info:
        na2d(q, k, v, kernel_size=3)
    assert "torch" in str(info.value) and "'gpu'" in str(info.value)
    # an explicit argument does not read the (bad) env var
    na2d(q, k, v, kernel_size=3, backend="torch")
    monkeypatch.setenv(backends.ENV_VAR, "")          # empty = unset
    na2d(q, k, v, kernel_size=3)


# --------------------------------------------------------------------------------------------
# legacy NATTEN (<= 0.17.5) API through a fake module
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,kernel,dilation,scale", [
    ((2, 9, 11, 3, 4), 3, (2, 1), None),
    ((1, 13, 10, 2, 5), (5, 3), (2, 3), 0.3),
])
def test_legacy_natten_api_with_rpb(legacy_natten, shape, kernel, dilation, scale):
    ks = _pair(kernel)
    q, k, v, rpb = make_inputs(shape, ks, requires_grad=True)
    got = na2d(q, k, v, kernel_size=kernel, dilation=dilation, rpb=rpb, scale=scale,
               backend="natten")
    assert legacy_natten == ["na2d_qk", "na2d_av"]
    ref = na2d(q, k, v, kernel_size=kernel, dilation=dilation, rpb=rpb, scale=scale,
               backend="torch")
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    # the fake is differentiable, so the layout transposes must carry gradients correctly too
    for g, e in zip(grads_of(got, [q, k, v, rpb]), grads_of(ref, [q, k, v, rpb])):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)


def test_legacy_natten_without_rpb_and_1d(legacy_natten):
    q, k, v, _ = make_inputs((1, 10, 12, 2, 4))
    torch.testing.assert_close(na2d(q, k, v, kernel_size=5, dilation=2, backend="natten"),
                               neighborhood_attention(q, k, v, (5, 5), (2, 2)))
    q, k, v, rpb = make_inputs((2, 17, 3, 4), 5)
    torch.testing.assert_close(
        na1d(q, k, v, kernel_size=5, dilation=3, rpb=rpb, scale=0.4, backend="natten"),
        neighborhood_attention(q, k, v, 5, 3, rpb, 0.4))
    assert legacy_natten == ["na2d_qk", "na2d_av", "na1d_qk", "na1d_av"]


def test_legacy_natten_auto_on_cpu_still_torch(legacy_natten):
    q, k, v, rpb = make_inputs((1, 9, 9, 2, 4), (3, 3))
    na2d(q, k, v, kernel_size=3, rpb=rpb)
    assert legacy_natten == []
