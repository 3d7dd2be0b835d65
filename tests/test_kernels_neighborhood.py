"""attnzoo's fused Triton NA kernels (the ``cuda`` backend of na1d / na2d).

Without a GPU these run under Triton's interpreter on CPU tensors (tests/conftest.py imports the
kernel modules with TRITON_INTERPRET=1 before anything else does, and sets it again while each
test marked ``interpreter``, as all of these are, runs); with a GPU, compiled on CUDA tensors.
The oracle is the torch reference in float64, evaluated on the very inputs the kernel saw
(rounded to its dtype), forward and the gradients of q, k, v and rpb. The reference itself is
checked against a brute force in tests/test_ops_neighborhood.py.

The interpreter is slow (a few seconds per forward+backward), so shapes are small but chosen to
hit what matters: borders (clamped windows), interior tiles (>= 3 tiles per axis), several tiles
per dilation group, partial tiles, dilations that do not divide the size, non-square kernels,
head dims that are not powers of two. Some tests also check every load and store of a launch
against the tensors it was given (the interpreter reads raw memory), and count the blocks the
kernels stream against tiling.logit_work. Per-device support, the GPU-architecture record that
gates ``auto`` and the autotuner are tested on CPU with the device query simulated.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple


import pytest
import timm
import torch

import attnzoo
from attnzoo import backends, kernels
from attnzoo.backends import BackendUnsupportedError

if kernels.triton_missing():  # an optional dependency, like NATTEN; its reason is shown (-ra)
    pytest.skip(kernels.triton_missing(), allow_module_level=True)

from attnzoo.kernels import neighborhood as kn  # noqa: E402
from attnzoo.kernels import tiling  # noqa: E402
from attnzoo.kernels.tiling import Tiling  # noqa: E402
from attnzoo.ops import na1d, na1d_qkv, na2d, na2d_qkv  # noqa: E402
from attnzoo.ops import neighborhood as nbh  # noqa: E402
import model_checks  # noqa: E402
from kernel_checks import (  # noqa: E402
    CPU, DispatchedOps, assert_matches_reference, check_auto_waits_for_a_verification,
    rerun_without_a_gpu, verification, weighted_grads)
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


# forward atol=rtol, gradients atol=rtol (rpb gradients relative to their largest entry: they
# are sums over every query)
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 1e-2), torch.bfloat16: (4e-2, 8e-2)}


def check_against_reference(shape, kernel, dilation, use_rpb=True, scale=None, v_dim=None,
                            dtype=torch.float32, config=None, seed=0):
    n = len(shape) - 3
    ks = (kernel,) * n if isinstance(kernel, int) else tuple(kernel)
    dil = (dilation,) * n if isinstance(dilation, int) else tuple(dilation)
    inputs = [t if t is None else t.to(dtype) for t in make_inputs(shape, ks, use_rpb, v_dim,
                                                                   seed)]
    used = [t for t in inputs if t is not None]
    # kernel, through the public op unless a configuration is forced
    low = [t if t is None else t.to(DEVICE).requires_grad_() for t in inputs]
    if config is None:
        op = na2d if n == 2 else na1d
        out = op(*low[:3], kernel_size=kernel, dilation=dilation, rpb=low[3], scale=scale,
                 backend="cuda")
    else:
        out = kn.na_fused(*low[:3], ks, dil, low[3], scale or shape[-1] ** -0.5, config)
    assert out.dtype == dtype and out.device.type == DEVICE
    grads = weighted_grads(out, [t for t in low if t is not None], dtype)
    # reference on the same (rounded) values, in float64
    ref_in = [t.double().requires_grad_() for t in used] + [None] * (4 - len(used))
    ref = nbh.na_reference(*ref_in[:3], ks, dil, ref_in[3], scale or shape[-1] ** -0.5)
    ref_grads = weighted_grads(ref, [t for t in ref_in if t is not None], dtype)

    fwd_tol, grad_tol = TOL[dtype]
    assert_matches_reference(out, grads, ref, ref_grads, dtype, fwd_tol, grad_tol,
                             names="qkvr"[:len(grads)], relative="r")


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


def test_forced_tiling_blocks_spanning_several_region_rows():
    """Blocks of 64 positions over regions 5-9 wide (up to 8 region rows per block: the rpb
    gradient's row slots and the key-centric pass with several query rows per block) and
    2x8 tiles, which the default tiling does not pick here."""
    check_against_reference((1, 11, 12, 2, 16), 5, (1, 2),
                            config=kn.Config(Tiling(2, 8, 64), 4, 2))


def test_rpb_gradient_summed_over_many_programs():
    """The dK/dV launch's reduction programs sum each head's rpb tables over every batch and dq
    program: here 2 batches x 69 programs of 16 queries per head (more than one step of
    SUM_ROWS tables, a step spanning both batches), 25 entries in 16-entry slots, against the
    float64 reference."""
    rows = -(-1100 // 16)  # tables per batch and head
    assert tiling.SUM_ROWS.value < 2 * rows and rows % tiling.SUM_ROWS.value  # spans both batches
    assert tiling.SUM_ENTRIES.value < 25
    check_against_reference((2, 1100, 2, 4), 13, 1, config=kn.Config(Tiling(1, 16, 16), 4, 1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_to_matches_torch(dtype):
    """tiling.round_to, the kernels' rounding of an fp32 bias to q's dtype, is torch's cast:
    ties to even (bf16's 1 + 2^-8 and 1 + 3 * 2^-8 go down and up), both signs, subnormals,
    overflow to inf, infinities and NaN (one whose bits would carry over)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, Y, N, DTYPE: tl.constexpr):
        r = tl.arange(0, 64)
        tl.store(Y + r, tiling.round_to(tl.load(X + r, mask=r < N), DTYPE), mask=r < N)

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11,
                                 100.25, -100.75, 1e-39, 7e4, 0.0, float("inf"),
                                 -float("inf")]),
                   torch.tensor([-1], dtype=torch.int32).view(torch.float32),  # NaN, 0xFFFFFFFF
                   torch.randn(40, generator=g) * 50])
    y = torch.empty_like(x, device=DEVICE)
    kernel[(1,)](x.to(DEVICE), y, x.numel(),
                 {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
                  torch.float32: tl.float32}[dtype])
    torch.testing.assert_close(y.cpu(), x.to(dtype).float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # masked lanes, dropped
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_rpb_in_its_own_dtype(dtype):
    """An fp32 bias with half-precision q, k, v (a parameter under autocast): the kernels round
    it to q's dtype as the reference's cast does, with no cast on the host, and its gradient
    comes back in fp32, the sum of the same per-query terms as the reference's. Biases near 100
    (a half-precision spacing of 0.06-0.5) make a bias left unrounded visible."""
    q, k, v, rpb = make_inputs((2, 9, 11, 2, 16), (3, 3), True, seed=5)
    low = [t.to(dtype).to(DEVICE).requires_grad_() for t in (q, k, v)]
    rpb = (100 + rpb).float().to(DEVICE).requires_grad_()
    out = na2d(*low, kernel_size=3, rpb=rpb, backend="cuda")
    grads = weighted_grads(out, low + [rpb], dtype)
    assert grads[3].dtype == torch.float32
    ref_in = [t.detach().double().requires_grad_() for t in low] + [
        rpb.detach().to(dtype).double().requires_grad_()]
    ref = nbh.na_reference(*ref_in[:3], (3, 3), (1, 1), ref_in[3], 16 ** -0.5)
    ref_grads = weighted_grads(ref, ref_in, dtype)
    assert_matches_reference(out, grads[:3], ref, ref_grads[:3], dtype, *TOL[dtype],
                             names="qkv")
    norm = ref_grads[3].abs().max().item()
    torch.testing.assert_close(grads[3].double().cpu() / norm, ref_grads[3] / norm,
                               atol=TOL[dtype][1], rtol=TOL[dtype][1])


@pytest.mark.parametrize("packed", [False, True], ids=["na2d", "na2d_qkv"])
def test_autocast_computes_in_its_dtype_on_every_backend(packed):
    """Under autocast, fp32 q, k and v are cast to its dtype before the call, as
    F.scaled_dot_product_attention's are, on the kernels as on the torch reference (whose
    matmuls alone cast: the kernels returned fp32 there); the bias stays fp32, and the
    gradients reach the fp32 leaves in fp32."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, 6, 7, 3, 2, 8, generator=g).to(DEVICE)
    rpb = torch.randn(2, 5, 5, generator=g).to(DEVICE).requires_grad_()
    low = qkv.bfloat16()
    outs = {}
    for backend in ("torch", "cuda"):
        leaf = qkv.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = (na2d_qkv(leaf, kernel_size=3, rpb=rpb, backend=backend) if packed else
                   na2d(*leaf.unbind(3), kernel_size=3, rpb=rpb, backend=backend))
        want = na2d(*low.unbind(3), kernel_size=3, rpb=rpb, backend=backend)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, want, rtol=0, atol=0)  # the cast, then the call
        out.float().square().sum().backward()
        assert leaf.grad.dtype == torch.float32 and rpb.grad.dtype == torch.float32
        outs[backend] = out.float()
    torch.testing.assert_close(outs["cuda"], outs["torch"], rtol=2e-2, atol=2e-2)


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
        (kernel.__name__, kernels.launch_arguments(kernel, a, kw).get("RPB_GRAD")))
        or run(kernel, grid, *a, **kw))
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 11, 9, 3, 2, 16, generator=g).to(DEVICE).unbind(3)
    rpb = torch.randn(2, 5, 5, generator=g).to(DEVICE)
    assert not q.is_contiguous()
    q.requires_grad_()
    out = na2d(q, k, v, kernel_size=3, dilation=(3, 2), rpb=rpb, backend="cuda")
    (dq,) = torch.autograd.grad(out.square().sum(), [q])
    # (in launch order, each once: on a GPU the autotuner launches each configuration it times)
    assert list(dict.fromkeys(launched)) == [("_na_fwd_kernel", None), ("_na_bwd_dq_kernel", False)]

    q64, k64, v64, rpb64 = (t.detach().cpu().double() for t in (q, k, v, rpb))
    q64.requires_grad_()
    ref = nbh.na_reference(q64, k64, v64, (3, 3), (3, 2), rpb64, 16 ** -0.5)
    torch.testing.assert_close(out.double().cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
    (dq_ref,) = torch.autograd.grad(ref.square().sum(), [q64])
    torch.testing.assert_close(dq.double().cpu(), dq_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape,kernel,dilation", [
    ((2, 9, 10, 3, 2, 8), 3, (2, 1)),
    ((1, 40, 3, 2, 8), 5, 3),
], ids=["2d", "1d"])
def test_packed_qkv_gradient_is_written_whole(shape, kernel, dilation):
    """na{n}d_qkv on the kernels: the output and the gradients of qkv and rpb are the float64
    reference's on qkv.unbind(-3), and the backward writes q's, k's and v's gradients into one
    tensor of qkv's shape: no stack (unbind's backward), no copy."""
    n = len(shape) - 4
    ks = (kernel,) * n
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(shape, generator=g).to(DEVICE).requires_grad_()
    rpb = torch.randn(shape[-2], *(2 * K - 1 for K in ks), generator=g).to(DEVICE)
    rpb.requires_grad_()
    op = na2d_qkv if n == 2 else na1d_qkv
    call = lambda: op(qkv, kernel_size=kernel, dilation=dilation, rpb=rpb,  # noqa: E731
                      backend="cuda")
    with kernels.capture_launches(arguments=False):  # (the interpreter's own copies left out)
        loss = call().sum()
        with DispatchedOps() as seen:
            loss.backward()
    ops = {name.split(".")[1] for name in seen.names}  # aten.stack.default -> stack
    assert ops and not {"stack", "copy_", "clone", "cat"} & ops, seen.names
    qkv.grad = rpb.grad = None
    out = call()
    grads = weighted_grads(out, [qkv, rpb], torch.float32)
    assert grads[0].shape == qkv.shape and grads[0].is_contiguous()
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (qkv, rpb)]
    ref = nbh.na_reference(*ref_in[0].unbind(-3), ks, (dilation,) * n if n == 1 else dilation,
                           ref_in[1], shape[-1] ** -0.5)
    ref_grads = weighted_grads(ref, ref_in, torch.float32)
    assert_matches_reference(out, grads, ref, ref_grads, torch.float32, *TOL[torch.float32],
                             names="qr", relative="r")


def test_packed_qkv_frozen_gives_the_bias_its_gradient():
    """qkv without gradient, the rpb with: its gradient only, the reference's."""
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(1, 9, 9, 3, 2, 8, generator=g).to(DEVICE)
    rpb = torch.randn(2, 5, 5, generator=g).to(DEVICE).requires_grad_()
    out = na2d_qkv(qkv, kernel_size=3, rpb=rpb, backend="cuda")
    (got,) = weighted_grads(out, [rpb], torch.float32)
    rpb64 = rpb.detach().double().cpu().requires_grad_()
    ref = nbh.na_reference(*qkv.double().cpu().unbind(3), (3, 3), (1, 1), rpb64, 8 ** -0.5)
    (exp,) = weighted_grads(ref, [rpb64], torch.float32)
    torch.testing.assert_close(got.double().cpu(), exp, atol=1e-5, rtol=1e-5)


def test_inference_under_no_grad():
    q, k, v, rpb = (t.float().to(DEVICE) for t in make_inputs((1, 9, 10, 2, 8), (3, 3), True))
    with torch.no_grad():
        out = na2d(q, k, v, kernel_size=3, rpb=rpb, backend="cuda")
    ref = na2d(*(t.cpu() for t in (q, k, v)), kernel_size=3, rpb=rpb.cpu(), backend="torch")
    assert not out.requires_grad
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_forward_mode_ad_is_refused_not_dropped():
    """A dual q without autograd's grad mode takes the autograd.Function, which has no jvp and
    says so, not the plain forward, which would lose the tangent silently."""
    import torch.autograd.forward_ad as fwAD
    q = torch.randn(1, 5, 5, 1, 8, device=DEVICE)
    with fwAD.dual_level(), torch.no_grad(), pytest.raises(NotImplementedError, match="jvp"):
        na2d(fwAD.make_dual(q, torch.randn_like(q)), q, q, kernel_size=3, backend="cuda")


def test_the_stand_in_bias_pointer_is_never_read(bounds_checked):
    """Without rpb the kernels get q as a stand-in pointer for the bias table. Here q (3 heads
    of 13 entries) is the start of a larger buffer the kernels are not given, and head 2's
    table at K=13 starts 2 * 25 entries in (1-D): a read would be caught (the interpreter's
    bounds check) or would add the buffer's 100s to logits (a GPU: results against torch's)."""
    buffer = torch.full((1000,), 100.0, device=DEVICE)
    q = buffer[:39].view(1, 13, 3, 1).copy_(torch.randn(1, 13, 3, 1)).requires_grad_()
    k, v = (torch.randn(1, 13, 3, 1, device=DEVICE, requires_grad=True) for _ in range(2))
    results = []
    for backend in ("cuda", "torch"):
        out = na1d(q, k, v, kernel_size=13, backend=backend)
        results.append((out, *torch.autograd.grad(out.sum(), [q, k, v])))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# 2-D tiles with neighbours on every side: >= 3 tiles per axis in every dilation group, in each
# of the three kernels' default tilings (checked below, so a tiling change cannot void it).
INTERIOR = [pytest.param((1, 12, 13, 1, 16), 3, 1, id="d1"),
            pytest.param((1, 18, 19, 1, 16), 3, 2, id="d2")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,kernel,dilation", INTERIOR)
def test_interior_tiles_match_the_reference(shape, kernel, dilation, dtype, bounds_checked):
    for name in kn.KERNELS:
        t = kn.configs(name, shape[1:3], (kernel,) * 2, (dilation,) * 2, (16, 16), dtype)[0]
        assert min(tiling.grid_tiles(shape[1:3], (dilation,) * 2, t.tiling[:2])) >= 3, name
    check_against_reference(shape, kernel, dilation, dtype=dtype, seed=5)


@pytest.mark.parametrize("shape,kernel,dilation", [
    ((1, 10, 13, 1, 16), (5, 3), (1, 2)),
    ((1, 1, 40, 1, 16), (1, 7), (1, 3)),
], ids=["2d", "1d"])
def test_logit_work_counts_what_the_kernels_compute(shape, kernel, dilation, monkeypatch,
                                                    request):
    """tiling.logit_work against the kernels themselves: the blocks each launch streams
    (calls of region_block under the interpreter, which a GPU host runs in a process without
    its GPU) times the tile and block sizes."""
    if rerun_without_a_gpu(request):
        return
    launches, run, region_block = [], kn._run, kn.region_block

    def counting_run(kernel_fn, grid, *args, **kwargs):
        launches.append([kernel_fn.__name__, kernels.launch_arguments(kernel_fn, args, kwargs),
                         0])
        return run(kernel_fn, grid, *args, **kwargs)

    def counting_block(y0, x0, rows, cols, n, BN):
        launches[-1][2] += 1
        return region_block(y0, x0, rows, cols, n, BN)

    monkeypatch.setattr(kn, "_run", counting_run)
    monkeypatch.setattr(kn, "region_block", counting_block)
    q, k, v, rpb = (t.float().requires_grad_() for t in make_inputs(shape, kernel, True))
    out = kn.na_fused(q, k, v, kernel, dilation, rpb, 0.25)
    torch.autograd.grad(out.sum(), [q, k, v, rpb])
    assert [name for name, _, _ in launches] == [
        "_na_fwd_kernel", "_na_bwd_dq_kernel", "_na_bwd_dkdv_kernel"]
    for name, kwargs, blocks in launches:
        t = Tiling(kwargs["TH"], kwargs["TW"], kwargs["BN"])
        work = tiling.logit_work(shape[1:3], kernel, dilation, t, key_pass="dkdv" in name)
        assert blocks == work.steps > 0, name
        assert work.computed == blocks * t.TH * t.TW * t.BN >= work.needed, name


@pytest.mark.parametrize("setting", ["highest", "high"])
def test_fp32_uses_tf32_only_where_torch_allows_it(setting, monkeypatch):
    """"highest" (torch's default): exact fp32; "high" / "medium": TF32 tensor cores (under
    the interpreter, operands rounded to TF32, which is what they compute): close to the
    float64 reference at TF32's precision, and measurably not exact."""
    precisions, run = [], kn._run
    monkeypatch.setattr(kn, "_run", lambda fn, grid, *a, **kw: precisions.append(
        kernels.launch_arguments(fn, a, kw)["PRECISION"]) or run(fn, grid, *a, **kw))
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        inputs = [t.float() for t in make_inputs((1, 9, 10, 2, 16), (3, 3), True, seed=6)]
        low = [t.to(DEVICE).requires_grad_() for t in inputs]
        out = na2d(*low[:3], kernel_size=3, rpb=low[3], backend="cuda")
        grads = weighted_grads(out, low, torch.float32)
    finally:
        torch.set_float32_matmul_precision(previous)
    ref_in = [t.double().requires_grad_() for t in inputs]
    ref = nbh.na_reference(*ref_in[:3], (3, 3), (1, 1), ref_in[3], 16 ** -0.5)
    errors = [(got.double().cpu() - exp).abs().max().item() for got, exp in
              zip([out] + list(grads), [ref] + list(weighted_grads(ref, ref_in, torch.float32)))]
    if setting == "highest":
        assert set(precisions) == {"ieee"}
        assert max(errors) < 1e-5, errors
    else:
        assert set(precisions) == {"tf32-rounded" if kn.INTERPRETED else "tf32"}
        assert 1e-5 < max(errors) < 2e-2, errors


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
    model_checks.check_backends_agree(model, x, ("cuda", "torch"), atol=1e-5, rtol=1e-5,
                                      grad_rtol=1e-4, grads_relative_to_largest=False)


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
    natten_usable = nbh._natten()[0] is not None  # "natten": if installed (the GPU image has none)
    with caplog.at_level(logging.DEBUG, logger="attnzoo.backends"):
        for call in calls:
            op = f"na{call.ndim}d"
            choice = backends.resolve(op, call)
            assert backends.available_backends(op, call)[choice] is None, (call, choice)
            assert f"auto backend for {op} {call} -> {choice}" in caplog.text  # what it picked
            if call.device == "cpu":
                assert choice == "torch", call  # never the interpreter, never NATTEN's CPU path
            elif backends.available_backends(op, call)["cuda"] is None \
                    and backends._OPS[op].backends["cuda"].trusted(call) is None:
                assert choice == "cuda", call
            elif natten_usable and not call.rpb and call.dtype != torch.float64:
                assert choice == "natten", call
            else:
                assert choice == "torch", call


class _GPU(NamedTuple):  # the fields of torch.cuda.get_device_properties the kernels read
    name: str
    major: int
    minor: int
    shared_memory_per_block_optin: int


GPUS = [_GPU("NVIDIA H100 80GB HBM3", 9, 0, 227 << 10), _GPU("NVIDIA A10", 8, 6, 99 << 10),
        _GPU("Tesla T4", 7, 5, 64 << 10), _GPU("a small GPU", 8, 0, 40 << 10)]


@pytest.fixture
def simulated_gpus(monkeypatch):
    """Compiled kernels on a host with the GPUs above (torch's device query answers per
    index); the current device is cuda:1, and each query of an index is counted (NATTEN's
    support check, when installed, asks for the current device's: ``None``, not counted)."""
    queried = []
    monkeypatch.setattr(tiling, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: GPUS[1] if (
        index is None) else queried.append(index) or GPUS[index])
    kernels._cuda_device_info.cache_clear()
    kernels._note_unverified.cache_clear()
    yield queried
    kernels._cuda_device_info.cache_clear()
    kernels._note_unverified.cache_clear()


def test_support_is_decided_by_each_devices_own_properties(simulated_gpus):
    assert backends.resolve("na2d", _call("cuda:0"), "cuda") == "cuda"
    with pytest.raises(BackendUnsupportedError, match=r"compute capability >= 8\.0 .*cuda:2 "
                                                      r"\(Tesla T4\) is 7\.5"):
        backends.resolve("na2d", _call("cuda:2"), "cuda")
    assert backends.resolve("na2d", _call("cuda:0"), "cuda") == "cuda"  # not cuda:2's answer
    # fp32 at head dim 128 needs more shared memory than the small GPU's 40 KiB per block (its
    # smallest configuration, by kernels.neighborhood.shared_memory); bf16 at 32 does not
    wide = _call("cuda:3", torch.float32, head_dim=128)
    with pytest.raises(BackendUnsupportedError, match=r"need \d+ KiB of shared memory per block "
                                                      r"for this call; cuda:3 \(a small GPU\) "
                                                      r"has 40 KiB"):
        backends.resolve("na2d", wide, "cuda")
    assert backends.resolve("na2d", _call("cuda:3"), "cuda") == "cuda"
    # per index, once each; the current device (cuda:1) was never asked for an indexed call
    assert sorted(simulated_gpus) == [0, 2, 3]
    assert backends.resolve("na2d", _call("cuda"), "cuda") == "cuda"  # "cuda": the current one
    assert sorted(simulated_gpus) == [0, 1, 2, 3]


def test_every_reason_is_given_at_once(simulated_gpus):
    reasons = kn.not_supported_reasons("cuda:2", torch.float64, 160, 40, (15, 15))
    assert len(reasons) == 4, reasons
    for expected, reason in zip(["compute capability", "float64", "head_dim up to 128, got 160",
                                 "kernel sizes up to 13"], reasons):
        assert expected in reason
    with pytest.raises(BackendUnsupportedError) as info:
        backends.resolve("na2d", _call("cuda:2", torch.float64, head_dim=160, kernel=15), "cuda")
    assert all(reason in str(info.value) for reason in reasons)


def test_auto_runs_the_kernels_only_where_a_record_covers_the_call(monkeypatch, kernel_records):
    """auto leaves a CUDA call to the torch reference until a verification record in the data
    file covers its architecture, dtype and Triton minor (kernel_checks says which)."""
    check_auto_waits_for_a_verification(monkeypatch, kernel_records, "neighborhood", "na2d",
                                        _call("cuda:0"), nbh._kernels_trusted)


def test_auto_judges_each_device_by_its_own_architecture(simulated_gpus, monkeypatch,
                                                        kernel_records, caplog):
    """A record of a verification on an H100 (sm_90) makes auto pick the kernels on cuda:0;
    cuda:1 (sm_86) has none: auto goes on down its order, while an explicit backend="cuda"
    runs the kernels there."""
    monkeypatch.setattr(kernels, "triton_version", lambda: "3.6.0")
    assert backends.resolve("na2d", _call("cuda:0")) == "torch"  # no record
    record = verification("neighborhood", ("bfloat16", "float16"))
    kernel_records(record)
    assert kernels.verified("neighborhood", "cuda:0", torch.bfloat16) == record
    assert backends.resolve("na2d", _call("cuda:0")) == "cuda"
    with caplog.at_level(logging.INFO, logger="attnzoo.kernels"):
        assert backends.resolve("na2d", _call("cuda:1")) == "torch"  # rpb: not NATTEN >= 0.20
        backends.resolve("na2d", _call("cuda:1"))
        backends._resolve.cache_clear()
        backends.resolve("na2d", _call("cuda:1"))
    assert caplog.text.count("not been verified on sm_86 (NVIDIA A10) in bfloat16") == 1  # once
    assert backends.resolve("na2d", _call("cuda:1"), "cuda") == "cuda"


def test_the_package_records_are_well_formed(monkeypatch):
    """The shipped records file (attnzoo/kernels/verified.jsonl, package data in the wheel) is
    what auto reads, and each of its lines a record that round-trips through its line."""
    path = Path(kernels.__file__).with_name("verified.jsonl")
    assert "kernels/verified.jsonl" in (ROOT / "pyproject.toml").read_text()  # package data
    monkeypatch.setattr(kernels, "RECORDS_FILE", path)
    backends.reset()
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(kernels.records()) == len(lines)
    for record, line in zip(kernels.records(), lines):
        assert record.to_line() == line and record.family in kernels.FAMILIES


@pytest.mark.parametrize("line,message", [
    ("{not json", "not a JSON object"),
    ('{"family": "neighborhood"}', "exactly the fields"),
    (verification("nat").to_line(), "family 'nat' is not one of"),
    (verification("qna", arch="90").to_line(), "arch '90' is not like 'sm_90'"),
    (verification("qna", ("fp16",)).to_line(), "dtypes ['fp16'] must be some of"),
    (verification("qna", triton="latest").to_line(), "triton 'latest' is not a version"),
    (verification("qna", digest="3.6").to_line(), "kernels '3.6' is not a digest"),
])
def test_a_malformed_record_is_an_error_naming_its_file_and_line(line, message, kernel_records,
                                                                 monkeypatch, tmp_path):
    """A record auto cannot read raises with its place, never passes for no record; so does a
    file ATTNZOO_VERIFIED_KERNELS names that cannot be read."""
    path = kernel_records(verification("san"))
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(ValueError, match=f"verified.jsonl, line 2: .*{re.escape(message)}"):
        kernels.records()
    kernel_records(verification("san"))
    extra = tmp_path / "mine.jsonl"
    extra.write_text(verification("qna", ("float32",)).to_line() + "\n")
    monkeypatch.setenv(kernels.RECORDS_ENV, os.pathsep.join([str(extra), str(tmp_path / "no")]))
    backends.reset()
    with pytest.raises(ValueError, match="cannot read the kernel verification records .*no"):
        kernels.records()
    monkeypatch.setenv(kernels.RECORDS_ENV, str(extra))
    backends.reset()
    assert [r.family for r in kernels.records()] == ["san", "qna"]  # the package's, then yours


KERNEL_MODULE = '''
import triton
import triton.language as tl
from .tiling import helper, scale as rescale

BLOCK = tl.constexpr(16)
HOST_WARPS = 4


@triton.jit
def _kernel(X, N: tl.constexpr, M: tl.constexpr = tiling.DEPTH):
    """What it computes."""
    x = tl.load(X + tl.arange(0, BLOCK))
    if N > 1:
        x = helper(x)
    x = rescale(x) * 2  # doubled
    tl.store(X + tl.arange(0, BLOCK), x)


@triton.jit
def _other(X):
    tl.store(X, 0)


def launch(x):
    _kernel[(1,)](x, 2, num_warps=HOST_WARPS)
'''
TILING = '''
import triton
import triton.language as tl

FACTOR = 3
DEPTH = tl.constexpr(FACTOR)


@triton.jit
def unused(x):
    if x > 0:
        if x > 1:
            return x - 1
    return x


@triton.jit
def helper(x):
    return x + 1


@triton.jit
def scale(x):
    return x * 3
'''


@pytest.mark.parametrize("module,tiling,same", [
    (KERNEL_MODULE.replace("# doubled", "# twice"), TILING, True),
    (KERNEL_MODULE.replace("# doubled", "# doubled: x \u2192 2x"), TILING, True),  # non-ASCII
    (KERNEL_MODULE.replace('    """What it computes."""\n', ""), TILING, True),
    (KERNEL_MODULE.replace("HOST_WARPS = 4", "HOST_WARPS = 8"), TILING, True),  # host code
    (KERNEL_MODULE.replace("x, N: tl", "x,\n            N: tl"), TILING, True),
    (KERNEL_MODULE, TILING.replace("x - 1", "x - 2"), True),  # a helper it does not call
    (KERNEL_MODULE, TILING.replace("            return x - 1\n    return x\n",
                                   "            return x - 1\n"), True),  # ends nested deeper
    (KERNEL_MODULE, TILING.replace("x + 1", "x + 2"), False),  # one it calls
    (KERNEL_MODULE, TILING.replace("x * 3", "x * 4"), False),  # one it calls by another name
    (KERNEL_MODULE, TILING.replace("FACTOR = 3", "FACTOR = 4"), False),  # through tiling.DEPTH
    (KERNEL_MODULE.replace("    x = rescale", "        x = rescale"), TILING, False),  # in the if
    (KERNEL_MODULE.replace("tl.constexpr(16)", "tl.constexpr(32)"), TILING, False),
    (KERNEL_MODULE.replace("tl.store(X, 0)", "tl.store(X, 1)"), TILING, False),
    (KERNEL_MODULE.replace("@triton.jit\ndef _kernel", "@triton.jit(do_not_specialize=['N'])"
                           "\ndef _kernel"), TILING, False),
])
def test_the_kernels_digest_changes_with_what_the_kernels_compile_only(module, tiling, same):
    """A verification record holds the digest of the Triton code it verified: a change that
    the compiled kernels cannot see (comments, docstrings, layout, host code, a helper they do
    not call) leaves it; one they can (a statement's block, a constant, a helper they call, by
    any name, a decorator's options) changes it, and auto no longer trusts the record."""
    before = kernels.source_digest(KERNEL_MODULE, TILING)
    assert re.fullmatch("[0-9a-f]{12}", before)
    assert (kernels.source_digest(module, tiling) == before) == same


def test_the_kernels_digest_ignores_the_order_of_definitions():
    head, rest = KERNEL_MODULE.split("@triton.jit\ndef _kernel")
    kernel, rest = rest.split("@triton.jit\ndef _other")
    other, launch = rest.split("def launch")
    reordered = (head + "@triton.jit\ndef _other" + other + "@triton.jit\ndef _kernel" + kernel
                 + "def launch" + launch)
    assert reordered != KERNEL_MODULE
    assert kernels.source_digest(reordered, TILING) == kernels.source_digest(KERNEL_MODULE, TILING)


def test_each_family_s_digest_is_of_its_installed_kernels():
    here = Path(kernels.__file__).parent
    tiling = (here / "tiling.py").read_text()
    digests = {f: kernels.kernels_digest(f) for f in kernels.FAMILIES}
    assert len(set(digests.values())) == 3
    for family, digest in digests.items():
        assert digest == kernels.source_digest((here / f"{family}.py").read_text(), tiling)


class _Compiled:  # what the autotuner reads of a compiled Triton kernel
    def __init__(self, spills, fits=True, error=None):
        self.n_spills, self.fits, self.error = spills, fits, error

    def _init_handles(self):
        if not self.fits:
            from triton.runtime.errors import OutOfResources
            raise OutOfResources(300_000, 232_448, "shared memory")


def test_autotuner_keeps_the_fastest_config_that_compiles_and_fits_without_spills(caplog):
    compiled = {"a": _Compiled(0), "b": _Compiled(0), "c": _Compiled(8), "d": _Compiled(0, False),
                "e": _Compiled(0, error=RuntimeError("PassManager::run failed\n(MLIR dump)"))}
    times = {"a": 3.0, "b": 2.0, "c": 1.0, "d": 0.5, "e": 0.1}
    launched = []

    def launch(config, warmup=False):
        if warmup:
            if compiled[config].error:
                raise compiled[config].error
            return compiled[config]
        launched.append(config)

    tuner = kernels.Autotuner(bench=lambda fn: fn() or times[launched[-1]])
    with caplog.at_level(logging.WARNING, logger="attnzoo.kernels"):
        # c spills, e does not compile (its reason logged); d does not fit
        assert tuner.choose("key", "abce", launch, tune=True, device=CPU) == "b"
        assert tuner.choose("fits", "db", launch, tune=True, device=CPU) == "b"
    assert "configuration e of key does not compile, left out: RuntimeError: PassManager::run " \
           "failed" in caplog.text and "MLIR dump" not in caplog.text
    assert sorted(launched) == ["a", "b", "b"]
    # cached; untuned: the default
    assert tuner.choose("key", "abcd", launch, tune=True, device=CPU) == "b" and len(launched) == 3
    assert tuner.choose("other", "abcd", launch, tune=False, device=CPU) == "a"
    compiled["a"] = compiled["b"] = _Compiled(16)
    # all spill: the fewest
    assert tuner.choose("spilling", "abcd", launch, tune=True, device=CPU) == "c"
    with pytest.raises(RuntimeError, match="no configuration of nothing fits this GPU.*compile "
                                           "errors: e: RuntimeError: PassManager"):
        tuner.choose("nothing", "de", launch, tune=True, device=CPU)


def test_the_autotuner_compiles_loads_and_times_with_the_call_s_device_current(monkeypatch):
    """Triton loads a compiled kernel into the current device's context, and its timer records
    events and synchronises on the current device: tuning a call on cuda:1 while cuda:0 is
    current must run with cuda:1 current (a simulated device switch: no GPU here)."""
    current = [0]

    @contextlib.contextmanager
    def device(d):
        before, current[0] = current[0], torch.device(d).index
        try:
            yield
        finally:
            current[0] = before
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    seen = []

    class Compiled(_Compiled):
        def _init_handles(self):
            seen.append(("load", current[0]))

    def launch(config, warmup=False):
        seen.append(("warmup" if warmup else "launch", current[0]))
        return Compiled(0) if warmup else None

    def bench(fn):
        seen.append(("timer", current[0]))
        fn()
        return len(seen)

    for index in (1, 0):
        seen.clear()
        tuner = kernels.Autotuner(bench)
        assert tuner.choose("key", "ab", launch, tune=True,
                            device=torch.device("cuda", index)) == "a"
        assert {what for what, _ in seen} == {"warmup", "load", "timer", "launch"}
        assert {where for _, where in seen} == {index} and current[0] == 0, seen


def test_autotuning_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(tiling, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert kernels.can_tune(torch.device("cuda:0"))
    monkeypatch.setenv(kernels.AUTOTUNE_ENV, "0")
    assert not kernels.can_tune(torch.device("cuda:0"))
    assert not kernels.can_tune(torch.device("cpu"))


def test_configurations_over_the_shared_memory_limit_are_left_out():
    args = ("dq", (56, 56), (7, 7), (1, 1), (128, 128), torch.float32)
    space = kn.configs(*args)
    need = {c: kn.shared_memory("dq", c, (128, 128), torch.float32, (7, 7)) for c in space}
    limit = max(need.values()) - 1
    fitting = kn.configs(*args, shared_limit=limit)
    assert fitting and fitting == [c for c in space if need[c] <= limit] != space


@pytest.mark.parametrize("kernel,dtype,shared_kib,stages", [
    ("dq", torch.bfloat16, 163, 1),   # sm80: Triton 3.6 spills the 2-stage default
    ("dq", torch.bfloat16, 227, 2),   # sm90
    ("dq", torch.float32, 163, 2),
    ("dkdv", torch.float16, 99, 1),   # sm86 / sm89
    ("dkdv", torch.float16, 163, 2),
    ("dkdv", torch.float32, 227, 1),  # sm90: Triton 3.8 spills the 2-stage default at K 11
    ("dkdv", torch.float32, 163, 2),
    ("dkdv", torch.bfloat16, 227, 2),
])
def test_the_untuned_default_takes_one_stage_where_two_spill(kernel, dtype, shared_kib, stages):
    """scripts/compile_kernels.py found the 2-stage default spilling there (BENCHMARKS.md); the
    autotuner still tries both."""
    space = kn.configs(kernel, (28, 28), (7, 7), (4, 4), (32, 32), dtype, shared_kib << 10)
    assert space[0].num_stages == stages
    assert {c.num_stages for c in space} == {1, 2}


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
        monkeypatch.setattr(tiling, "INTERPRETED", False)
    q = torch.randn(1, 9, 9, 2, 8)
    with pytest.raises(BackendUnsupportedError, match="CUDA tensors.*TRITON_INTERPRET") as info:
        na2d(q, q, q, kernel_size=3, backend="cuda")
    assert "'torch'" in str(info.value) and "'auto'" in str(info.value)
    assert "The call: na2d(float32[1, 9, 9, 2, 8] on cpu" in str(info.value)  # shapes, dtypes
    with attnzoo.use_backend("cuda"), pytest.raises(BackendUnsupportedError):
        na1d(q[:, 0], q[:, 0], q[:, 0], kernel_size=3)
    assert na2d(q, q, q, kernel_size=3).shape == q.shape  # auto: the torch reference


def test_kernels_compile_for_sm80_and_sm90():
    """The interpreter accepts programs the compiler rejects: compile the three NA kernels of
    nat_tiny's first stage, and QnA's and SAN's kernels at their first example's shape, as
    Triton would launch them (its binder's specialization) for real GPUs (cubin via Triton's
    bundled ptxas; no GPU needed), without spills."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compile_kernels.py"), "--quick", "--arch",
         "80,90", "--jobs", "1"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    # NA: 3 kernels; QnA: 3; SAN: 3 + 2 + 2 (subtraction's and subtraction2's examples differ
    # in channels, so in channel block); each for 2 archs
    assert "26 distinct compiles: no spilling launch" in result.stdout, result.stdout
    for kernel in ("| dkdv |", "| qna_bwd_keys |", "| aggregation_bwd_input |",
                   "| subtraction_bwd |"):
        assert kernel in result.stdout
