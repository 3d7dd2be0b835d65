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

import logging
import os
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
from attnzoo.ops import na1d, na2d  # noqa: E402
from attnzoo.ops import neighborhood as nbh  # noqa: E402
import model_checks  # noqa: E402
from kernel_checks import assert_matches_reference, weighted_grads  # noqa: E402
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


def test_the_stand_in_bias_pointer_is_never_read(bounds_checked):
    """Without rpb the kernels get q as a stand-in pointer for the bias table. Here q (3 heads
    of 13 entries) is the start of a larger buffer the kernels are not given, and head 2's
    table at K=13 starts 2 * 25 entries in (1-D): a read would be caught."""
    buffer = torch.zeros(1000)
    q = buffer[:39].view(1, 13, 3, 1).copy_(torch.randn(1, 13, 3, 1)).requires_grad_()
    k, v = (torch.randn(1, 13, 3, 1, requires_grad=True) for _ in range(2))
    out = na1d(q, k, v, kernel_size=13, backend="cuda")
    torch.autograd.grad(out.sum(), [q, k, v])


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
def test_logit_work_counts_what_the_kernels_compute(shape, kernel, dilation, monkeypatch):
    """tiling.logit_work against the kernels themselves: the blocks each launch streams
    (calls of region_block under the interpreter) times the tile and block sizes."""
    if torch.cuda.is_available():
        pytest.skip("counts the interpreter's calls")
    launches, run, region_block = [], kn._run, kn.region_block

    def counting_run(kernel_fn, grid, *args, **kwargs):
        launches.append([kernel_fn.__name__, kwargs, 0])
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
        kw["PRECISION"]) or run(fn, grid, *a, **kw))
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
    with caplog.at_level(logging.DEBUG, logger="attnzoo.backends"):
        for call in calls:
            op = f"na{call.ndim}d"
            choice = backends.resolve(op, call)
            assert backends.available_backends(op, call)[choice] is None, (call, choice)
            assert f"auto backend for {op}{call} -> {choice}" in caplog.text  # says what it picked
            if call.device == "cpu":
                assert choice == "torch", call  # never the interpreter, never NATTEN's CPU path
            elif backends.available_backends(op, call)["cuda"] is None \
                    and backends._OPS[op].backends["cuda"].trusted(call) is None:
                assert choice == "cuda", call
            elif natten_state == "natten" and not call.rpb and call.dtype != torch.float64:
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
    index); the current device is cuda:1, and each query is counted."""
    queried = []
    monkeypatch.setattr(tiling, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: queried.append(index) or GPUS[index])
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


def test_auto_runs_the_kernels_only_on_verified_architectures(simulated_gpus, monkeypatch,
                                                              caplog):
    """A record of a validation on an H100 (sm_90) makes auto pick the kernels on cuda:0;
    cuda:1 (sm_86) has none: auto goes on down its order, while an explicit backend="cuda"
    runs the kernels there."""
    assert kernels.VERIFIED["neighborhood"] == ()  # never run on a GPU: auto never picks them
    assert backends.resolve("na2d", _call("cuda:0")) != "cuda"
    backends._resolve.cache_clear()
    record = kernels.Verification("sm_90", GPUS[0].name, "2026-01-01",
                                  "pytest tests/test_kernels_neighborhood.py", "simulated")
    monkeypatch.setitem(kernels.VERIFIED, "neighborhood", (record,))
    assert kernels.verified("neighborhood", "cuda:0") == record
    assert backends.resolve("na2d", _call("cuda:0")) == "cuda"
    with caplog.at_level(logging.INFO, logger="attnzoo.kernels"):
        assert backends.resolve("na2d", _call("cuda:1")) == "torch"  # rpb: not NATTEN >= 0.20
        backends.resolve("na2d", _call("cuda:1", torch.float16))
    assert caplog.text.count("not been verified on sm_86 (NVIDIA A10)") == 1  # once per arch
    assert backends.resolve("na2d", _call("cuda:1"), "cuda") == "cuda"


class _Compiled:  # what the autotuner reads of a compiled Triton kernel
    def __init__(self, spills, fits=True):
        self.n_spills, self.fits = spills, fits

    def _init_handles(self):
        if not self.fits:
            from triton.runtime.errors import OutOfResources
            raise OutOfResources(300_000, 232_448, "shared memory")


def test_autotuner_keeps_the_fastest_config_that_fits_without_spills():
    compiled = {"a": _Compiled(0), "b": _Compiled(0), "c": _Compiled(8), "d": _Compiled(0, False)}
    times = {"a": 3.0, "b": 2.0, "c": 1.0, "d": 0.5}
    launched = []

    def launch(config, warmup=False):
        if warmup:
            return compiled[config]
        launched.append(config)

    tuner = kernels.Autotuner(bench=lambda fn: fn() or times[launched[-1]])
    assert tuner.choose("key", "abcd", launch, tune=True) == "b"   # c spills, d does not fit
    assert sorted(launched) == ["a", "b"]
    assert tuner.choose("key", "abcd", launch, tune=True) == "b" and len(launched) == 2  # cached
    assert tuner.choose("other", "abcd", launch, tune=False) == "a"  # untuned: the default
    compiled["a"] = compiled["b"] = _Compiled(16)
    assert tuner.choose("spilling", "abcd", launch, tune=True) == "c"  # all spill: the fewest


def test_configurations_over_the_shared_memory_limit_are_left_out():
    args = ("dq", (56, 56), (7, 7), (1, 1), (128, 128), torch.float32)
    space = kn.configs(*args)
    need = {c: kn.shared_memory("dq", c, (128, 128), torch.float32, (7, 7)) for c in space}
    limit = max(need.values()) - 1
    fitting = kn.configs(*args, shared_limit=limit)
    assert fitting and fitting == [c for c in space if need[c] <= limit] != space


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
