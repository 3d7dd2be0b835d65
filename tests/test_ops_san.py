"""Tests of SAN's ops (attnzoo.ops.san): aggregation, subtraction, subtraction2.

The oracle is an independent brute force written from the spec (shared/specs/san.md) and the
official CUDA kernels' index arithmetic (tests/oracles.py): for every output position (ho, wo)
and tap (kh, kw), input row ``ho*s - p + kh*d`` (``p = d*(k-1)/2``), reflected by hand (``-i``
below 0, ``2(H-1) - i`` past the end) or read as zero, in float64. Nothing from attnzoo.ops.san
is reused. It checks the torch reference here; the reference checks every other backend on the
ops' registered cases (tests/test_ops_registry.py).
"""
from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo import backends
from attnzoo.backends import BackendUnsupportedError
from attnzoo.ops import san_aggregation, san_neighbours, san_subtraction, san_subtraction2
from attnzoo.profiling import count_macs
import oracles
from oracles import reflect

pytestmark = pytest.mark.floor  # also run on the lowest torch and timm admitted (.ci/floor)


# --------------------------------------------------------------------------------------------
# the independent brute force (tests/oracles.py)
# --------------------------------------------------------------------------------------------

def test_reflection_by_hand():
    """Guard the oracle itself: ReflectionPad2d's indices (oracles.reflect), and one worked
    aggregation."""
    assert [reflect(i, 5) for i in range(-3, 8)] == [3, 2, 1, 0, 1, 2, 3, 4, 3, 2, 1]
    ref = torch.nn.ReflectionPad2d(2)(torch.arange(20.).view(1, 1, 4, 5))
    assert all(ref[0, 0, r + 2, c + 2] == 5 * reflect(r, 4) + reflect(c, 5)
               for r in range(-2, 6) for c in range(-2, 7))
    # a 1x3 map, a 1x3 footprint with tap weights 1, 2, 3 everywhere: the outer taps reflect
    x = torch.tensor([[[[1., 10., 100.]]]], dtype=torch.float64)
    w = torch.tensor([1., 2., 3.], dtype=torch.float64).view(1, 1, 3, 1).expand(1, 1, 3, 3)
    out = oracles.san_aggregation(x, w, (1, 3), (1, 1), (1, 1), "reflect")
    assert out.flatten().tolist() == [1 * 10 + 2 * 1 + 3 * 10, 1 * 1 + 2 * 10 + 3 * 100,
                                      1 * 10 + 2 * 100 + 3 * 10]


# --------------------------------------------------------------------------------------------
# torch reference vs brute force, float64, forward and backward
# --------------------------------------------------------------------------------------------

def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def grads_of(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    return torch.autograd.grad((out * w).sum(), inputs)


# (N, C, Cw, H, W), kernel, dilation, stride, padding mode: k 3/5/7, dilation 1/2, stride 1/2,
# odd and non-square maps, maps just large enough for a single reflection (H = p + 1).
CASES = [
    pytest.param((2, 4, 2, 7, 9), 3, 1, 1, "reflect", id="k3d1s1-7x9"),
    pytest.param((1, 6, 3, 9, 8), 3, 2, 2, "reflect", id="k3d2s2-9x8"),
    pytest.param((2, 4, 2, 8, 5), 5, 1, 2, "reflect", id="k5d1s2-8x5"),
    pytest.param((1, 4, 1, 7, 9), 5, 2, 1, "reflect", id="k5d2s1-7x9"),
    pytest.param((1, 8, 4, 4, 7), 7, 1, 1, "reflect", id="k7d1s1-4x7-minimal"),
    pytest.param((1, 4, 2, 11, 9), 7, 1, 2, "reflect", id="k7d1s2-11x9"),
    pytest.param((1, 2, 2, 7, 8), 7, 2, 1, "reflect", id="k7d2s1-7x8-minimal"),
    pytest.param((1, 4, 2, 9, 13), 7, 2, 2, "reflect", id="k7d2s2-9x13"),
    pytest.param((1, 4, 2, 5, 8), (3, 5), (2, 1), (1, 2), "reflect", id="k(3,5)d(2,1)s(1,2)"),
    pytest.param((2, 4, 2, 5, 6), 7, 1, 1, "zeros", id="k7-zeros-5x6"),
    pytest.param((1, 6, 2, 3, 7), 5, 2, 2, "zeros", id="k5d2s2-zeros-3x7"),
]


@pytest.mark.parametrize("shape,k,d,s,mode", CASES)
def test_subtractions_match_brute_force(shape, k, d, s, mode):
    N, C, _, H, W = shape
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(N, C, H, W, generator=g, dtype=torch.float64, requires_grad=True)
    x2 = torch.randn(N, C, H, W, generator=g, dtype=torch.float64, requires_grad=True)
    k, d, s = _pair(k), _pair(d), _pair(s)
    kw = dict(kernel_size=k, dilation=d, stride=s, padding_mode=mode, backend="torch")

    out = san_subtraction2(x1, x2, **kw)
    expected = oracles.san_subtraction(x1, x2, k, d, s, mode)
    assert out.shape == expected.shape == (N, C, k[0] * k[1], -(-H // s[0]) * -(-W // s[1]))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for got, exp in zip(grads_of(out, [x1, x2]), grads_of(expected, [x1, x2])):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)

    out = san_subtraction(x2, **kw)
    expected = oracles.san_subtraction(x2, x2, k, d, s, mode)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(grads_of(out, [x2])[0], grads_of(expected, [x2])[0],
                               rtol=1e-12, atol=1e-12)
    # the plain footprint gather: x2 at every tap
    torch.testing.assert_close(san_neighbours(x2, **{a: b for a, b in kw.items()
                                                     if a != "backend"}),
                               oracles.san_footprint(x2, k, d, s, mode), rtol=0, atol=0)


@pytest.mark.parametrize("shape,k,d,s,mode", CASES)
def test_aggregation_matches_brute_force(shape, k, d, s, mode):
    N, C, Cw, H, W = shape
    k, d, s = _pair(k), _pair(d), _pair(s)
    L = -(-H // s[0]) * -(-W // s[1])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, C, H, W, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(N, Cw, k[0] * k[1], L, generator=g, dtype=torch.float64, requires_grad=True)
    out = san_aggregation(x, w, kernel_size=k, dilation=d, stride=s, padding_mode=mode,
                          backend="torch")
    expected = oracles.san_aggregation(x, w, k, d, s, mode)
    assert out.shape == expected.shape == (N, C, -(-H // s[0]), -(-W // s[1]))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for name, got, exp in zip("xw", grads_of(out, [x, w]), grads_of(expected, [x, w])):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"grad {name}: {m}")


def test_aggregation_shares_weights_interleaved():
    """Channel c uses weight channel c % Cw: a weight set only on weight channel 1 moves
    channels 1, 3, 5 (not 2, 3 as blocks of C / Cw would)."""
    x = torch.randn(1, 6, 5, 5, dtype=torch.float64)
    w = torch.zeros(1, 2, 9, 25, dtype=torch.float64)
    w[:, 1, 4] = 1.  # the centre tap of weight channel 1
    out = san_aggregation(x, w, kernel_size=3)
    torch.testing.assert_close(out[:, 1::2], x[:, 1::2], rtol=0, atol=0)
    assert out[:, 0::2].abs().max() == 0


def test_gradcheck_tiny():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 4, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 2, 9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w: san_aggregation(x, w, kernel_size=3, stride=2, dilation=(1, 2)), (x, w),
        fast_mode=True)
    assert torch.autograd.gradcheck(lambda x: san_subtraction(x, kernel_size=3, dilation=2), (x,),
                                    fast_mode=True)
    # the aggregation's hand-written backward is made of differentiable ops: double backward
    assert torch.autograd.gradgradcheck(
        lambda x, w: san_aggregation(x, w, kernel_size=3, stride=2, dilation=(1, 2)), (x, w),
        fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_low_precision_vs_float64(dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 8, 9, 10, generator=g, dtype=torch.float64)
    w = torch.randn(2, 2, 49, 90, generator=g, dtype=torch.float64).softmax(2)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]
    out = san_aggregation(x.to(dtype), w.to(dtype), kernel_size=7)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), san_aggregation(x, w, kernel_size=7),
                               rtol=tol, atol=tol)
    out = san_subtraction2(x.to(dtype), x.flip(1).to(dtype), kernel_size=5, stride=2)
    torch.testing.assert_close(out.double(), san_subtraction2(x, x.flip(1), kernel_size=5,
                                                              stride=2), rtol=tol, atol=tol)


def test_meta_device_shapes():
    x = torch.empty(2, 16, 14, 15, device="meta")
    w = torch.empty(2, 4, 49, 14 * 15, device="meta")
    assert san_aggregation(x, w, kernel_size=7).shape == (2, 16, 14, 15)
    assert san_subtraction(x, kernel_size=7, stride=2).shape == (2, 16, 49, 7 * 8)


# --------------------------------------------------------------------------------------------
# backends, MAC formulas, clear errors
# --------------------------------------------------------------------------------------------

OPS = ("san_aggregation", "san_subtraction", "san_subtraction2")


def _calls(**kw):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 8, 8, generator=g)
    w = torch.randn(1, 2, 9, 64, generator=g)
    return {"san_aggregation": lambda: san_aggregation(x, w, kernel_size=3, **kw),
            "san_subtraction": lambda: san_subtraction(x, kernel_size=3, **kw),
            "san_subtraction2": lambda: san_subtraction2(x, x, kernel_size=3, **kw)}


@pytest.mark.parametrize("op", OPS)
def test_backends(op):
    assert set(backends._OPS[op].backends) == set(backends.CONCRETE_BACKENDS)
    call = _calls()[op]
    torch.testing.assert_close(call(), _calls(backend="torch")[op]())  # auto -> torch on CPU
    with pytest.raises(BackendUnsupportedError, match="NATTEN has no") as info:
        _calls(backend="natten")[op]()
    assert "'torch'" in str(info.value)
    with attnzoo.use_backend("natten"), pytest.raises(BackendUnsupportedError):
        call()
    with pytest.raises(BackendUnsupportedError, match="Triton"):  # CPU, no interpreter
        _calls(backend="cuda")[op]()
    # auto never picks natten, nor the cuda kernels without a record (none in the tests)
    key = backends._OPS[op].key_type("cuda:0", torch.float16, (7, 7), (1, 1), (1, 1),
                                     "reflect", True)
    assert backends.resolve(op, key) == "torch"
    assert "natten" not in backends.supported_backends(op, key)


def test_benchmark_examples_registered():
    for op in OPS:
        examples = backends.op_examples(op, torch.device("meta"), torch.float32)
        assert len(examples) == 3 and all(callable(run) for _, run in examples)
        label, run = examples[1]
        assert "56x56 k7" in label
        out = run("torch")  # on meta: shapes only
        assert out.shape[0] in (1, 8) and out.requires_grad


def test_mac_formulas():
    class Ops(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.ones(()))

        def forward(self, x):  # x: [N, C, H, W]
            N, C, H, W = x.shape
            w = x.new_ones(N, 2, 25, ((H - 1) // 2 + 1) * ((W - 1) // 2 + 1))
            y = san_aggregation(x * self.p, w, kernel_size=5, stride=2)
            return y, san_subtraction(x, kernel_size=3), san_subtraction2(x, x, kernel_size=7)

    N, C, H, W = 2, 6, 9, 8
    # aggregation: N*C*L*kk multiply-adds; subtractions: one per output element (as SAN's
    # official counter). FlopCounterMode sees none of them.
    expected = N * C * 5 * 4 * 25 + N * C * 9 * H * W + N * C * 49 * H * W
    assert count_macs(Ops(), (N, C, H, W)) == expected


def test_errors():
    x = torch.randn(1, 4, 8, 8)
    w = torch.randn(1, 2, 9, 64)
    with pytest.raises(ValueError, match="odd"):
        san_aggregation(x, w, kernel_size=4)
    with pytest.raises(TypeError, match="kernel_size"):
        san_subtraction(x, kernel_size=3.0)
    with pytest.raises(ValueError, match="dilation"):
        san_subtraction(x, kernel_size=3, dilation=0)
    with pytest.raises(ValueError, match="stride"):
        san_subtraction(x, kernel_size=3, stride=0)
    with pytest.raises(ValueError, match="padding_mode"):
        san_subtraction(x, kernel_size=3, padding_mode="circular")
    with pytest.raises(ValueError, match="4-D"):
        san_subtraction(x[0], kernel_size=3)
    with pytest.raises(TypeError, match="floating"):
        san_subtraction(x.long(), kernel_size=3)
    with pytest.raises(ValueError, match="multiple of Cw"):
        san_aggregation(torch.randn(1, 5, 8, 8), w, kernel_size=3)
    with pytest.raises(ValueError, match=r"\[1, Cw, 25, 64\]"):
        san_aggregation(x, w, kernel_size=5)
    with pytest.raises(ValueError, match="dtype"):
        san_aggregation(x, w.double(), kernel_size=3)
    with pytest.raises(ValueError, match="same shape"):
        san_subtraction2(x, x[:, :2], kernel_size=3)
    with pytest.raises(ValueError, match="unknown backend"):
        san_subtraction(x, kernel_size=3, backend="bogus")
    # NumPy's integers are ints (as na2d's kernel_size): the same calls
    import numpy as np
    torch.testing.assert_close(san_aggregation(x, w, kernel_size=np.int64(3)),
                               san_aggregation(x, w, kernel_size=3), rtol=0, atol=0)
    torch.testing.assert_close(
        san_subtraction(x, kernel_size=(np.int32(3), 3), dilation=np.int64(2)),
        san_subtraction(x, kernel_size=3, dilation=2), rtol=0, atol=0)
    for empty in (x[:, :0], x[:, :, :0]):  # only the batch may be
        with pytest.raises(ValueError, match=r"only the batch of x may be empty"):
            san_subtraction(empty, kernel_size=3, padding_mode="zeros")


def test_a_warm_call_skips_the_checks_that_its_metadata_passed(monkeypatch):
    """The checks run once per call metadata (the op, its options, each tensor's shape,
    strides, dtype and device); a call differing in any of them, or a bool where the int it
    equals passed, is checked again and refused. A gradient's need is decided per call."""
    from attnzoo.ops import san as san_module
    checks = []
    footprint = san_module._footprint
    monkeypatch.setattr(san_module, "_footprint", lambda *a: checks.append(a[0]) or footprint(*a))
    monkeypatch.setattr(backends, "_CHECKED", {})
    x, w = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 9, 64)
    for _ in range(3):
        san_aggregation(x, w, kernel_size=3)
        san_subtraction(x, kernel_size=(3, 3))
        san_subtraction2(x, x, kernel_size=3, stride=2)
    assert checks == ["san_aggregation", "san_subtraction", "san_subtraction2"]
    with pytest.raises(TypeError, match="stride"):  # True == 1: the same key but for types
        san_aggregation(x, w, kernel_size=3, stride=True)
    with pytest.raises(TypeError, match="dilation"):
        san_subtraction(x, kernel_size=(3, 3), dilation=(1, True))
    with pytest.raises(ValueError, match="padding_mode"):
        san_subtraction2(x, x, kernel_size=3, stride=2, padding_mode="Reflect")
    with pytest.raises(ValueError, match=r"\[1, Cw, 9, 16\]"):  # w's shape, at stride 2
        san_aggregation(x, w, kernel_size=3, stride=2)
    with pytest.raises(ValueError, match="dtype"):
        san_aggregation(x, w.double(), kernel_size=3)
    with pytest.raises(ValueError, match="at least 4x4"):  # x's strides and shape as a view
        san_subtraction(x[:, :, :3], kernel_size=7)
    # the same metadata with and without gradients: one check, the backward still runs
    before = len(checks)
    xg = x.clone().requires_grad_()
    with backends.record_calls() as calls:
        san_aggregation(x, w, kernel_size=3)
        out = san_aggregation(xg, w, kernel_size=3)
    out.sum().backward()
    assert len(checks) == before and xg.grad is not None
    assert [call.grad for call in calls["san_aggregation"]] == [False, True]
    assert torch.equal(out, san_aggregation(x, w, kernel_size=3))


def test_reflection_needs_map_larger_than_padding():
    """One reflection covers a pad of at most H - 1 (the official op read out of bounds);
    zero padding has no such limit."""
    ok = torch.randn(1, 2, 4, 4)
    assert san_subtraction(ok, kernel_size=7).shape == (1, 2, 49, 16)
    with pytest.raises(ValueError, match=r"\(3, 3\).*at least 4x4.*got 3x9"):
        san_subtraction(torch.randn(1, 2, 3, 9), kernel_size=7)
    with pytest.raises(ValueError, match="at least 7x7"):
        san_aggregation(torch.randn(1, 2, 9, 6), torch.randn(1, 1, 49, 54), kernel_size=7,
                        dilation=2)
    assert san_subtraction(torch.randn(1, 2, 3, 2), kernel_size=7, padding_mode="zeros").shape \
        == (1, 2, 49, 6)
