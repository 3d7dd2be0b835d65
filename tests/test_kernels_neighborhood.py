"""attnzoo's fused Triton NA kernels (the ``cuda`` backend of na1d / na2d).

Without a GPU these run under Triton's interpreter on CPU tensors (tests/conftest.py imports the
kernel modules with TRITON_INTERPRET=1 before anything else does, and sets it again while each
test marked ``interpreter``, as all of these are, runs); with a GPU, compiled on CUDA tensors.
The oracle is the torch reference in float64, evaluated on the very inputs the kernel saw
(rounded to its dtype), forward and the gradients of q, k, v and rpb. The reference itself is
checked against a brute force in tests/test_ops_neighborhood.py.

The interpreter is slow (a few seconds per forward+backward), so shapes are small but chosen to
hit what matters: borders (clamped windows), several tiles per dilation group, partial tiles,
dilations that do not divide the size, non-square kernels, head dims that are not powers of two.
"""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import attnzoo
from attnzoo import backends, kernels
from attnzoo.backends import BackendUnsupportedError

if kernels.triton_missing():  # an optional dependency, like NATTEN; its reason is shown (-ra)
    pytest.skip(kernels.triton_missing(), allow_module_level=True)

from attnzoo.kernels import neighborhood as kn  # noqa: E402
from attnzoo.kernels.tiling import Tiling  # noqa: E402
from attnzoo.ops import na1d, na2d  # noqa: E402
from attnzoo.ops import neighborhood as nbh  # noqa: E402
from tiny_models import NAT_MINI_CUT  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]


# On CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on for tests
# marked `interpreter` (the kernels themselves were built interpreted there).
pytestmark = pytest.mark.interpreter


def test_kernels_run_here():
    """On CPU the kernels must be the interpreted ones (else every test below would raise)."""
    assert torch.cuda.is_available() or kn.INTERPRETED


# --------------------------------------------------------------------------------------------
# kernel vs torch reference
# --------------------------------------------------------------------------------------------

def make_inputs(shape, kernel, use_rpb, v_dim=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(shape[:-1] + (v_dim or shape[-1],), generator=g, dtype=torch.float64)
    rpb = None
    if use_rpb:
        rpb = torch.randn((shape[-2],) + tuple(2 * K - 1 for K in kernel), generator=g,
                          dtype=torch.float64)
    return [q, k, v, rpb]


def weighted_grads(out, inputs, dtype, seed=1):
    """Gradients of a fixed random weighting of ``out``, the weights rounded to ``dtype`` (the
    kernel's) whatever ``out``'s dtype, so kernel and reference see the same ones."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype).to(out)
    return torch.autograd.grad((out * w).sum(), inputs)


# forward atol=rtol, gradients atol=rtol (rpb gradients relative to their largest entry: they
# are sums over every query)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 1e-2), torch.bfloat16: (4e-2, 8e-2)}


def check_against_reference(shape, kernel, dilation, use_rpb=True, scale=None, v_dim=None,
                            dtype=torch.float32, tiling=None, seed=0):
    n = len(shape) - 3
    ks = (kernel,) * n if isinstance(kernel, int) else tuple(kernel)
    dil = (dilation,) * n if isinstance(dilation, int) else tuple(dilation)
    inputs = [t if t is None else t.to(dtype) for t in make_inputs(shape, ks, use_rpb, v_dim,
                                                                   seed)]
    used = [t for t in inputs if t is not None]
    # kernel, through the public op unless a tiling is forced
    low = [t if t is None else t.to(DEVICE).requires_grad_() for t in inputs]
    if tiling is None:
        op = na2d if n == 2 else na1d
        out = op(*low[:3], kernel_size=kernel, dilation=dilation, rpb=low[3], scale=scale,
                 backend="cuda")
    else:
        out = kn.na_fused(*low[:3], ks, dil, low[3], scale or shape[-1] ** -0.5, tiling)
    assert out.dtype == dtype and out.device.type == DEVICE
    grads = weighted_grads(out, [t for t in low if t is not None], dtype)
    # reference on the same (rounded) values, in float64
    ref_in = [t.double().requires_grad_() for t in used] + [None] * (4 - len(used))
    ref = nbh.na_reference(*ref_in[:3], ks, dil, ref_in[3], scale or shape[-1] ** -0.5)
    ref_grads = weighted_grads(ref, [t for t in ref_in if t is not None], dtype)

    fwd_tol, grad_tol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), ref.detach(), atol=fwd_tol, rtol=fwd_tol)
    for name, got, exp in zip("qkvr", grads, ref_grads):
        assert got.dtype == dtype and got.shape == exp.shape
        norm = max(1.0, exp.abs().max().item()) if name == "r" else 1.0
        torch.testing.assert_close(got.double().cpu() / norm, exp / norm, atol=grad_tol,
                                   rtol=grad_tol, msg=lambda m: f"grad {name}: {m}")


# (B, H, W, heads, D), kernel, dilation, rpb, scale, v_dim
CASES_2D = [
    pytest.param((1, 13, 15, 2, 16), 5, 1, True, None, None, id="k5-borders-2x2tiles"),
    pytest.param((2, 9, 11, 2, 8), 3, (2, 1), True, 0.7, None, id="k3-d(2,1)-scale-b2"),
    pytest.param((1, 17, 10, 1, 32), (7, 3), (2, 3), True, None, None, id="k(7,3)-d(2,3)"),
    pytest.param((1, 6, 20, 2, 24), (5, 7), (1, 2), True, None, 40, id="k(5,7)-hd24-vdim40"),
    pytest.param((1, 12, 13, 2, 16), 3, 4, False, None, None, id="k3-d4-H=K*d-norpb"),
    pytest.param((1, 13, 14, 1, 16), 13, 1, True, None, None, id="k13-whole-map"),
    pytest.param((2, 5, 6, 2, 8), 1, (2, 1), True, None, None, id="k1"),
    pytest.param((1, 20, 18, 1, 16), 3, 2, True, None, None, id="d2-several-tiles-per-group"),
    pytest.param((1, 8, 9, 1, 128), 3, 1, True, None, None, id="hd128"),
]


@pytest.mark.parametrize("shape,kernel,dilation,use_rpb,scale,v_dim", CASES_2D)
def test_na2d_kernel_matches_reference_fp32(shape, kernel, dilation, use_rpb, scale, v_dim):
    check_against_reference(shape, kernel, dilation, use_rpb, scale, v_dim)


CASES_1D = [
    pytest.param((1, 150, 2, 16), 7, 1, True, None, id="k7-3tiles"),
    pytest.param((1, 61, 1, 8), 5, 3, True, 0.5, id="k5-d3-scale"),
    pytest.param((2, 30, 2, 16), 13, 2, False, None, id="k13-d2-norpb-b2"),
]


@pytest.mark.parametrize("shape,kernel,dilation,use_rpb,scale", CASES_1D)
def test_na1d_kernel_matches_reference_fp32(shape, kernel, dilation, use_rpb, scale):
    check_against_reference(shape, kernel, dilation, use_rpb, scale)


def test_forced_tiling_multi_row_blocks():
    """Blocks of 4 region rows (the rpb gradient's row fold and the key-centric pass with more
    than one query row per block) and 2x8 tiles, which the default tiling does not use."""
    check_against_reference((1, 11, 12, 2, 16), 5, (1, 2), tiling=Tiling(2, 8, 4, 16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape,kernel,dilation", [
    ((1, 13, 15, 2, 32), 5, (2, 1)),
    ((1, 70, 2, 32), 7, 2),
], ids=["2d", "1d"])
def test_kernel_low_precision(dtype, shape, kernel, dilation):
    check_against_reference(shape, kernel, dilation, dtype=dtype, seed=3)


def test_noncontiguous_inputs_and_partial_grads(monkeypatch):
    """q, k, v as slices of one qkv tensor (what the layer passes), gradients wanted for q only:
    the key-centric pass and the rpb reduction are skipped."""
    launched = []
    run = kn._run
    monkeypatch.setattr(kn, "_run", lambda kernel, grid, *a, **kw: launched.append(
        (kernel.__name__, kw.get("RPB_GRAD"))) or run(kernel, grid, *a, **kw))
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 11, 9, 3, 2, 16, generator=g).to(DEVICE).unbind(3)
    rpb = torch.randn(2, 5, 5, generator=g).to(DEVICE)
    assert not q.is_contiguous()
    q.requires_grad_()
    out = na2d(q, k, v, kernel_size=3, dilation=(3, 2), rpb=rpb, backend="cuda")
    (dq,) = torch.autograd.grad(out.square().sum(), [q])
    assert launched == [("_na_fwd_kernel", None), ("_na_bwd_dq_kernel", False)]

    q64, k64, v64, rpb64 = (t.detach().cpu().double() for t in (q, k, v, rpb))
    q64.requires_grad_()
    ref = nbh.na_reference(q64, k64, v64, (3, 3), (3, 2), rpb64, 16 ** -0.5)
    torch.testing.assert_close(out.double().cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
    (dq_ref,) = torch.autograd.grad(ref.square().sum(), [q64])
    torch.testing.assert_close(dq.double().cpu(), dq_ref, atol=1e-5, rtol=1e-5)


def test_inference_under_no_grad():
    q, k, v, rpb = (t.float().to(DEVICE) for t in make_inputs((1, 9, 10, 2, 8), (3, 3), True))
    with torch.no_grad():
        out = na2d(q, k, v, kernel_size=3, rpb=rpb, backend="cuda")
    ref = na2d(*(t.cpu() for t in (q, k, v)), kernel_size=3, rpb=rpb.cpu(), backend="torch")
    assert not out.requires_grad
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# models: the same outputs and gradients on `cuda` as on `torch`
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,extra", [
    ("nat_mini", {}),
    ("dinat_mini", dict(dilations=((1, 2), (2,), (1,), (1,)))),
])
def test_model_cuda_backend_matches_torch(name, extra):
    torch.manual_seed(0)
    model = timm.create_model(name, **NAT_MINI_CUT, **extra).to(DEVICE)  # at 64 px
    assert model.stages[0].blocks[0].attn.rpb is not None
    model.train()
    x = torch.randn(1, 3, 64, 64, device=DEVICE)
    params = [p for p in model.parameters()]
    results = {}
    for backend in ("torch", "cuda"):
        seen = set()

        def observer(op, chosen, macs, seen=seen):
            seen.add(chosen)
            return contextlib.nullcontext()

        with attnzoo.use_backend(backend), backends.observe_ops(observer):
            out = model(x)
            grads = torch.autograd.grad(out.square().sum(), params)
        assert seen == {backend}
        results[backend] = (out, grads)
    (out_t, grads_t), (out_c, grads_c) = results["torch"], results["cuda"]
    torch.testing.assert_close(out_c, out_t, atol=1e-5, rtol=1e-5)
    for (pname, _), g_c, g_t in zip(model.named_parameters(), grads_c, grads_t):
        torch.testing.assert_close(g_c, g_t, atol=1e-5, rtol=1e-4, msg=lambda m: f"{pname}: {m}")


# --------------------------------------------------------------------------------------------
# backend selection
# --------------------------------------------------------------------------------------------

def _call(device="cuda", dtype=torch.bfloat16, head_dim=32, rpb=True, grad=True, ndim=2,
          kernel=7, v_dim=None):
    return nbh.NACall(ndim, device, dtype, head_dim, rpb, grad, (kernel,) * ndim,
                      v_dim or head_dim)


@pytest.fixture(params=["natten", "no-natten"])
def natten_state(request, monkeypatch):
    if request.param == "no-natten":
        monkeypatch.setitem(sys.modules, "natten", None)
        monkeypatch.setitem(sys.modules, "natten.functional", None)
    nbh._natten.cache_clear()
    return request.param


@pytest.fixture(params=["triton", "no-triton"])
def triton_state(request, monkeypatch):
    if request.param == "no-triton":
        monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    kernels.triton_missing.cache_clear()
    return request.param


def test_auto_never_picks_a_backend_that_cannot_run(natten_state, triton_state, caplog):
    calls = [_call(device, dtype, hd, rpb, grad, ndim, kernel)
             for device in ("cuda", "cpu")
             for dtype in (torch.bfloat16, torch.float32, torch.float64)
             for hd in (32, 160)
             for rpb in (True, False)
             for grad in (True, False)
             for ndim, kernel in ((2, 7), (2, 15), (1, 13))]
    picked = set()
    with caplog.at_level(logging.DEBUG, logger="attnzoo.backends"):
        for call in calls:
            op = f"na{call.ndim}d"
            choice = backends.resolve(op, call)
            assert backends.available_backends(op, call)[choice] is None, (call, choice)
            assert f"auto backend for {op}{call} -> {choice}" in caplog.text  # says what it picked
            picked.add((call, choice))
            if call.device == "cpu":
                assert choice == "torch", call  # never the interpreter, never NATTEN's CPU path
            elif triton_state == "triton" and call.dtype != torch.float64 \
                    and call.head_dim <= 128 and max(call.kernel_size) <= 13:
                assert choice == "cuda", call
            elif natten_state == "natten" and not call.rpb and call.dtype != torch.float64:
                assert choice == "natten", call
            else:
                assert choice == "torch", call


def test_cuda_backend_limits_give_reasons():
    reasons = {
        "float64": _call(dtype=torch.float64),
        "head_dim up to 128": _call(head_dim=160),
        "head_dim up to 128, got 256": _call(v_dim=256),
        "kernel sizes up to 13": _call(kernel=15),
        "CUDA tensors, not mps": _call(device="mps"),
    }
    for expected, call in reasons.items():
        with pytest.raises(BackendUnsupportedError, match=expected) as info:
            backends.resolve("na2d" if call.ndim == 2 else "na1d", call, "cuda")
        assert "'torch'" in str(info.value)  # names a backend that can


def test_triton_missing_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    kernels.triton_missing.cache_clear()
    reason = kernels.triton_missing()
    assert "pip install triton" in reason
    with pytest.raises(BackendUnsupportedError, match="pip install triton"):
        backends.resolve("na2d", _call(), "cuda")
    assert backends.resolve("na2d", _call()) in ("natten", "torch")  # auto goes on


@pytest.mark.parametrize("outside", ["variable-unset", "kernels-compiled"])
def test_explicit_cuda_on_cpu_outside_the_interpreter(monkeypatch, outside):
    if outside == "variable-unset":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setattr(kn, "INTERPRETED", False)
    q = torch.randn(1, 9, 9, 2, 8)
    with pytest.raises(BackendUnsupportedError, match="CUDA tensors.*TRITON_INTERPRET") as info:
        na2d(q, q, q, kernel_size=3, backend="cuda")
    assert "'torch'" in str(info.value) and "'auto'" in str(info.value)
    with attnzoo.use_backend("cuda"), pytest.raises(BackendUnsupportedError):
        na1d(q[:, 0], q[:, 0], q[:, 0], kernel_size=3)
    assert na2d(q, q, q, kernel_size=3).shape == q.shape  # auto: the torch reference


def test_kernels_compile_for_sm80_and_sm90():
    """The interpreter accepts programs the compiler rejects: compile every kernel of one NAT
    case for real GPUs (cubin via Triton's bundled ptxas; no GPU needed)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_kernels.py"), "--quick"], cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" ok ") == 6 and "all compiled" in result.stdout, result.stdout
