"""The unfused NA ops (NATTEN 0.17's two-step API): ``na{1,2}d_qk`` and ``na{1,2}d_av``.

Each is checked in float64, forward and backward, against its own brute force in
tests/oracles.py (``na_scores``: every query's window dot products plus the bias, row-major;
``na_weighted_sum``: the weighted sum of the window's values), written from NATTEN 0.17.5's
semantics and sharing nothing with attnzoo. Composed (qk of the scaled queries, softmax, av) they
equal the fused :func:`attnzoo.ops.na2d` and the brute force of NA itself. The registry tests
(tests/test_ops_registry.py) and ``attnzoo check`` run the ops' registered cases on every
backend that can run them; tests/test_ops_fuzz.py fuzzes their arguments.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from attnzoo.backends import BackendUnsupportedError
from attnzoo.ops import na1d, na1d_av, na1d_qk, na2d, na2d_av, na2d_qk
from oracles import na_scores, na_weighted_sum, neighborhood_attention
from na_inputs import grads_of, make_inputs

pytestmark = pytest.mark.floor

BACKENDS_DOC = Path(__file__).resolve().parents[1] / "docs" / "backends.md"

# (B, H, W, heads, D), kernel, dilation, rpb, v_dim: borders everywhere (small maps), odd sizes,
# dilation groups of unequal length, kernel sizes 3..13, non-square kernels and dilations.
CASES_2D = [
    pytest.param((2, 7, 9, 2, 4), 3, 1, True, None, id="k3-odd-map"),
    pytest.param((1, 9, 11, 3, 5), 3, 2, True, 7, id="k3d2-not-divisible-vdim7"),
    pytest.param((1, 11, 13, 2, 4), 5, 2, False, None, id="k5d2-norpb"),
    pytest.param((1, 13, 10, 1, 3), 7, 1, True, 2, id="k7-vdim2"),
    pytest.param((1, 19, 11, 1, 3), 9, (2, 1), True, None, id="k9d(2,1)"),
    pytest.param((1, 11, 12, 2, 2), 11, 1, True, 5, id="k11-H=K"),
    pytest.param((1, 13, 14, 1, 2), 13, 1, True, None, id="k13-H=K"),
    pytest.param((1, 13, 7, 1, 4), (3, 7), (4, 1), True, None, id="k(3,7)d(4,1)-W=K"),
    pytest.param((2, 6, 5, 2, 3), 1, (2, 1), True, None, id="k1"),
]

CASES_1D = [
    pytest.param((2, 11, 2, 4), 3, 1, True, 6, id="k3-vdim6"),
    pytest.param((1, 23, 1, 3), 5, 3, True, None, id="k5d3-not-divisible"),
    pytest.param((1, 13, 2, 4), 13, 1, False, None, id="k13-L=K"),
]


def _kernel(kernel, n):
    return (kernel,) * n if isinstance(kernel, int) else tuple(kernel)


@pytest.mark.parametrize("n,shape,kernel,dilation,use_rpb,v_dim",
                         [pytest.param(2, *c.values, id=f"2d-{c.id}") for c in CASES_2D]
                         + [pytest.param(1, *c.values, id=f"1d-{c.id}") for c in CASES_1D])
def test_qk_and_av_match_the_brute_force(n, shape, kernel, dilation, use_rpb, v_dim):
    ks = _kernel(kernel, n)
    qk, av = (na2d_qk, na2d_av) if n == 2 else (na1d_qk, na1d_av)
    q, k, v, rpb = make_inputs(shape, ks if use_rpb else None, v_dim=v_dim, requires_grad=True)
    scores = qk(q, k, kernel_size=kernel, dilation=dilation, rpb=rpb, backend="torch")
    expected = na_scores(q, k, ks, dilation, rpb)
    assert scores.shape == shape[:-1] + (torch.Size(ks).numel(),)
    torch.testing.assert_close(scores, expected, rtol=1e-10, atol=1e-10)
    inputs = [t for t in (q, k, rpb) if t is not None]
    for name, g, e in zip("qkr", grads_of(scores, inputs), grads_of(expected, inputs)):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad {name}: {m}")

    # the weights of av are any tensor (not only a softmax): their gradient is checked too
    attn = torch.randn(scores.shape, dtype=torch.float64, requires_grad=True)
    out = av(attn, v, kernel_size=kernel, dilation=dilation, backend="torch")
    expected = na_weighted_sum(attn, v, ks, dilation)
    assert out.shape == v.shape
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for name, g, e in zip("av", grads_of(out, [attn, v]), grads_of(expected, [attn, v])):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("n,shape,kernel,dilation,v_dim", [
    (2, (2, 9, 11, 2, 4), (3, 5), (2, 1), 6),
    (2, (1, 14, 15, 2, 8), 7, 2, None),
    (1, (2, 17, 3, 4), 5, 3, 3),
])
def test_softmax_between_qk_and_av_is_na(n, shape, kernel, dilation, v_dim, dtype, tol):
    """``av(softmax(qk(q * scale, k, rpb)), v) == na(q, k, v, rpb, scale)``, forward and
    backward, and both equal the brute force of NA."""
    ks = _kernel(kernel, n)
    q, k, v, rpb = make_inputs(shape, ks, v_dim=v_dim, dtype=dtype, requires_grad=True)
    qk, av, na = (na2d_qk, na2d_av, na2d) if n == 2 else (na1d_qk, na1d_av, na1d)
    scale = 0.37
    two_step = av(qk(q * scale, k, kernel_size=kernel, dilation=dilation, rpb=rpb).softmax(-1),
                  v, kernel_size=kernel, dilation=dilation)
    fused = na(q, k, v, kernel_size=kernel, dilation=dilation, rpb=rpb, scale=scale)
    torch.testing.assert_close(two_step, fused, rtol=tol, atol=tol)
    oracle = neighborhood_attention(*(t.detach().double() for t in (q, k, v)), ks, dilation,
                                    rpb.detach().double(), scale)
    torch.testing.assert_close(two_step.double(), oracle, rtol=tol, atol=tol)
    for g, e in zip(grads_of(two_step, [q, k, v, rpb]), grads_of(fused, [q, k, v, rpb])):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_runs_in_its_dtype(dtype):
    q, k, v, rpb = make_inputs((1, 8, 9, 2, 4), (3, 3))
    scores = na2d_qk(q.to(dtype), k.to(dtype), kernel_size=3, rpb=rpb.to(dtype))
    out = na2d_av(scores.softmax(-1), v.to(dtype), kernel_size=3)
    assert scores.dtype == out.dtype == dtype
    expected = na2d(q, k, v, kernel_size=3, rpb=rpb, scale=1.0)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=5e-2)


def test_errors_name_the_argument():
    q = torch.randn(1, 8, 8, 2, 4)
    with pytest.raises(ValueError, match=r"na2d_av: attn must be \[B, \*spatial, heads, K\*\*n\]"
                                         r" = \(1, 8, 8, 2, 9\)"):
        na2d_av(torch.randn(1, 8, 8, 2, 8), q, kernel_size=3)
    with pytest.raises(ValueError, match="na2d_qk: q and k must have the same shape"):
        na2d_qk(q, q[..., :3], kernel_size=3)
    with pytest.raises(ValueError, match=r"na2d_qk: rpb must have shape \[heads, 2K-1, \.\.\.\]"):
        na2d_qk(q, q, kernel_size=3, rpb=torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match="na1d_qk: kernel_size must be odd"):
        na1d_qk(q[:, 0], q[:, 0], kernel_size=2)
    with pytest.raises(ValueError, match="na2d_av: kernel_size \\* dilation must not exceed"):
        na2d_av(torch.randn(1, 8, 8, 2, 9), q, kernel_size=3, dilation=3)
    with pytest.raises(TypeError, match="na2d_av: attn must be a floating-point tensor"):
        na2d_av(torch.ones(1, 8, 8, 2, 9, dtype=torch.long), q, kernel_size=3)
    with pytest.raises(ValueError, match="na1d_av: attn, v must share dtype and device"):
        na1d_av(torch.randn(1, 8, 2, 3, dtype=torch.float64), q[:, 0], kernel_size=3)
    with pytest.raises(BackendUnsupportedError,
                       match="backend 'cuda' cannot run na2d_qk here: na2d_qk has no 'cuda' "
                             "implementation. Backends that can: 'torch', 'auto'"):
        na2d_qk(q, q, kernel_size=3, backend="cuda")


def test_natten_020_has_no_unfused_ops(monkeypatch):
    import types

    from attnzoo.ops import neighborhood as nbh
    fused = types.ModuleType("natten")
    fused.na2d = lambda *a, **k: None
    fused.__version__ = "0.21.0"
    monkeypatch.setitem(sys.modules, "natten", fused)
    monkeypatch.setitem(sys.modules, "natten.functional", types.ModuleType("natten.functional"))
    assert nbh._natten()[1] == "fused"
    q = torch.randn(1, 8, 8, 2, 4)
    with pytest.raises(BackendUnsupportedError, match=r"NATTEN >= 0\.20 has no unfused na2d_qk"):
        na2d_qk(q, q, kernel_size=3, backend="natten")


def test_natten_017_runs_the_unfused_ops_in_its_layout(legacy_natten):
    """With NATTEN <= 0.17.5 installed (a stand-in computing from the brute-force windows on
    heads-first tensors), ``backend="natten"`` hands it the heads-first tensors and returns ours."""
    q, k, v, rpb = make_inputs((2, 9, 11, 3, 4), (3, 5), v_dim=6, requires_grad=True)
    got = na2d_qk(q, k, kernel_size=(3, 5), dilation=(2, 1), rpb=rpb, backend="natten")
    ref = na2d_qk(q, k, kernel_size=(3, 5), dilation=(2, 1), rpb=rpb, backend="torch")
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads_of(got, [q, k, rpb]), grads_of(ref, [q, k, rpb])):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    attn = got.softmax(-1)
    torch.testing.assert_close(
        na2d_av(attn, v, kernel_size=(3, 5), dilation=(2, 1), backend="natten"),
        na2d_av(attn, v, kernel_size=(3, 5), dilation=(2, 1), backend="torch"))
    x = torch.randn(1, 17, 2, 4, dtype=torch.float64)
    scores = na1d_qk(x, x, kernel_size=5, dilation=3, backend="natten")
    torch.testing.assert_close(scores, na_scores(x, x, 5, 3))
    torch.testing.assert_close(na1d_av(scores, x, kernel_size=5, dilation=3, backend="natten"),
                               na_weighted_sum(scores, x, 5, 3))
    assert legacy_natten == ["na2d_qk", "na2d_av", "na1d_qk", "na1d_av"]


def _docs_shim() -> str:
    """docs/backends.md's drop-in definitions for NATTEN 0.17 code (after its marker)."""
    text = BACKENDS_DOC.read_text()
    block = re.search(r"<!-- natten-0.17 shim -->\s*```python\n(.*?)```", text, re.S)
    assert block, "docs/backends.md lost its NATTEN 0.17 shim"
    return block.group(1)


def test_the_docs_shim_runs_dinat_layer_arithmetic_as_na2d():
    """Code written for NATTEN <= 0.17.4 (transformers' DiNAT: heads-first tensors, q scaled
    before ``natten2dqkrpb(q, k, rpb, kernel_size, dilation)``, softmax, ``natten2dav``) and for
    0.17.5's ``na2d_qk``/``na2d_av``, run through the mapping in docs/backends.md, equals
    :func:`na2d`."""
    shim: dict = {}
    exec(compile(_docs_shim(), "docs/backends.md shim", "exec"), shim)
    B, heads, H, W, hd, K, d = 2, 3, 11, 13, 8, 5, 2
    q, k, v, rpb = make_inputs((B, H, W, heads, hd), (K, K), requires_grad=True)
    first = lambda t: t.movedim(-2, 1)  # noqa: E731  (DiNAT's heads-first layout)
    scale = hd ** -0.5
    for qk, av in ((shim["natten2dqkrpb"], shim["natten2dav"]),
                   (lambda q, k, rpb, K, d: shim["na2d_qk"](q, k, K, d, rpb=rpb),
                    shim["na2d_av"])):
        attn = qk(first(q) * scale, first(k), rpb, K, d).softmax(dim=-1)
        assert attn.shape == (B, heads, H, W, K * K)
        out = av(attn, first(v), K, d).movedim(1, -2)
        expected = na2d(q, k, v, kernel_size=K, dilation=d, rpb=rpb)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
        for g, e in zip(grads_of(out, [q, k, v, rpb]), grads_of(expected, [q, k, v, rpb])):
            torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)
