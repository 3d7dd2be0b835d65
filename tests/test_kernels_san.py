"""attnzoo's fused Triton SAN kernels (the ``cuda`` backend of san_subtraction,
san_subtraction2 and san_aggregation).

Without a GPU these run under Triton's interpreter on CPU tensors (tests/conftest.py); with a
GPU, compiled on CUDA tensors. The oracle is the torch reference in float64 on the very inputs
the kernels saw (rounded to their dtype), forward and every input's gradient, with every memory
access of the fp32 launches checked to fall inside their tensors; the reference
itself is checked against a brute force in tests/test_ops_san.py, and every case registered with
the SAN ops runs on this backend in tests/test_ops_registry.py.

Shapes are small but reach what matters: reflected and zero-padded borders, interior tiles
(maps of more than two 4 x 32 tiles per axis, where the input-gradient kernels skip the mirror
images), full and partial channel blocks (of ``kernels.san.MAX_BC``), stride and dilation per
axis, non-square footprints, the interleaved weight sharing, non-contiguous inputs, and a SAN of
both self-attention types run end to end.
"""
from __future__ import annotations

import pytest
import torch

from attnzoo import backends, kernels
from attnzoo.backends import BackendUnsupportedError

if kernels.triton_missing():  # an optional dependency; its reason is shown (-ra)
    pytest.skip(kernels.triton_missing(), allow_module_level=True)

from attnzoo.kernels import san as ks  # noqa: E402
from attnzoo.ops import san as san_module  # noqa: E402
from attnzoo.ops import san_aggregation, san_subtraction, san_subtraction2  # noqa: E402
from kernel_checks import (  # noqa: E402
    assert_matches_reference, check_auto_waits_for_a_verification, weighted_grads)
import model_checks  # noqa: E402
import tiny_models  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.interpreter

# atol = rtol, gradients relative to their largest entry
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}
OPS = {"subtraction": san_subtraction, "subtraction2": san_subtraction2,
       "aggregation": san_aggregation}


def _inputs(op, N, C, Cw, H, W, geometry, gen):
    if op == "aggregation":
        kh, kw = ks_pair(geometry["kernel_size"])
        sh, sw = ks_pair(geometry.get("stride", 1))
        taps = (N, Cw, kh * kw, -(-H // sh) * -(-W // sw))
        return [torch.randn(N, C, H, W, generator=gen, dtype=torch.float64),
                torch.randn(taps, generator=gen, dtype=torch.float64)]
    return [torch.randn(N, C, H, W, generator=gen, dtype=torch.float64)
            for _ in range(2 if op == "subtraction2" else 1)]


def ks_pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def check_against_reference(op, shape, dtype=torch.float32, seed=0, transform=None,
                            **geometry):
    """The kernel's output and input gradients in ``dtype`` against the float64 reference on
    the same (rounded) inputs. ``transform``: applied to the kernel's inputs (strides)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [t.to(dtype) for t in _inputs(op, *shape, geometry, gen)]
    results = []
    for backend, ins in (("cuda", [t.to(DEVICE) for t in inputs]),
                         ("torch", [t.double() for t in inputs])):
        ins = [t.requires_grad_() for t in ins]
        args = transform(ins) if transform and backend == "cuda" else ins
        out = OPS[op](*args, backend=backend, **geometry)
        results.append((out, weighted_grads(out, ins, dtype)))
    (out, grads), (ref, ref_grads) = results
    assert_matches_reference(out, grads, ref, ref_grads, dtype, TOL[dtype])


# (N, C, Cw, H, W), geometry
CASES = [
    pytest.param((2, 3, 1, 6, 7), dict(kernel_size=3), id="k3-reflect-borders-b2"),
    pytest.param((1, 2, 1, 19, 70), dict(kernel_size=3), id="k3-reflect-interior-tiles"),
    pytest.param((1, 4, 2, 9, 8), dict(kernel_size=5, dilation=2, stride=2),
                 id="k5-d2-s2-reflect"),
    pytest.param((1, 4, 2, 5, 11), dict(kernel_size=(3, 5), dilation=(2, 1), stride=(1, 2)),
                 id="k3x5-d21-s12-reflect"),
    pytest.param((1, 2, 1, 4, 7), dict(kernel_size=7), id="k7-minimal-reflect"),
    pytest.param((1, 4, 2, 5, 6), dict(kernel_size=7, padding_mode="zeros"),
                 id="k7-zeros-larger-than-map"),
    pytest.param((1, 2, 2, 18, 67), dict(kernel_size=5, dilation=2, stride=2,
                                          padding_mode="zeros"), id="k5-d2-s2-zeros-interior"),
    pytest.param((1, 20, 10, 4, 5), dict(kernel_size=3), id="k3-partial-channel-blocks"),
]


@pytest.mark.parametrize("shape,geometry", CASES)
@pytest.mark.parametrize("op", OPS)
def test_san_kernels_match_the_reference_fp32(op, shape, geometry, bounds_checked):
    check_against_reference(op, shape, **geometry)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("geometry", [
    dict(kernel_size=3, stride=2),
    dict(kernel_size=3, dilation=2, padding_mode="zeros")], ids=["k3-s2-reflect", "k3-d2-zeros"])
def test_san_kernels_low_precision(op, dtype, geometry):
    check_against_reference(op, (1, 4, 2, 7, 9), dtype=dtype, **geometry)


@pytest.mark.parametrize("op", OPS)
def test_noncontiguous_inputs(op, bounds_checked):
    """Maps are read through their strides: the first channels-last, a second one (x2 of
    subtraction2: strides unlike x1's) or the weight column-major."""
    def transform(ins):
        first, *rest = ins
        return [first.contiguous(memory_format=torch.channels_last)] + [
            t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in rest]
    check_against_reference(op, (1, 4, 2, 6, 7), transform=transform, kernel_size=3)


def test_interleaved_weight_sharing():
    """Channel c takes weight channel c % Cw: with one weight channel set to zero, exactly the
    channels c = cw (mod Cw) of the output vanish."""
    x = torch.randn(1, 6, 5, 5, device=DEVICE)
    w = torch.randn(1, 3, 9, 25, device=DEVICE)
    w[:, 1] = 0
    out = san_aggregation(x, w, kernel_size=3, backend="cuda")
    assert [bool(out[0, c].abs().max() == 0) for c in range(6)] == [False, True, False] * 2


SLOW = pytest.mark.slow  # about a minute each under the interpreter: one per type by default


@pytest.mark.parametrize("sa_type,config,size", [
    ("pairwise", dict(kernel_sizes=3), 64),
    ("patchwise", dict(kernel_sizes=(3, 7, 7, 7, 7), padding_mode="zeros"), 32),
    pytest.param("patchwise", dict(kernel_sizes=3), 64, marks=SLOW),
    pytest.param("pairwise", dict(kernel_sizes=(3, 7, 7, 7, 7), padding_mode="zeros"), 32,
                 marks=SLOW)],
    ids=["pairwise-reflect-k3", "patchwise-zeros-k7", "patchwise-reflect-k3",
         "pairwise-zeros-k7"])
def test_san_model_on_cuda_equals_torch(sa_type, config, size):
    """A whole SAN (the registered SAN class, narrow: five stages of one block; SAN10's 3x3 then
    7x7 footprints with zero padding, or 3x3 with reflection, the smallest inputs each allows)
    gives the torch backend's logits and parameter gradients."""
    model = tiny_models.randomize(tiny_models.san_small(sa_type, **config)).to(DEVICE)
    x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))
    model_checks.check_backends_agree(model, x.to(DEVICE))


# --------------------------------------------------------------------------------------------
# support and backend selection
# --------------------------------------------------------------------------------------------

def _call(device="cuda:0", dtype=torch.float16):
    return san_module.SANCall(device, dtype, (3, 3), (1, 1), (1, 1), "reflect", True)


def test_unsupported_calls_name_every_reason():
    reasons = ks.not_supported_reasons("cpu", torch.float64)
    assert any("float64" in r for r in reasons)
    with pytest.raises(BackendUnsupportedError) as info:
        backends.resolve("san_aggregation", _call("cpu", torch.float64), "cuda")
    assert all(reason in str(info.value) for reason in reasons)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled kernels (a GPU) refuse them anyway
    backends._resolve.cache_clear()
    (reason,) = ks.not_supported_reasons("cpu", torch.float32)
    assert "run on CUDA tensors" in reason and "TRITON_INTERPRET=1" in reason
    with pytest.raises(BackendUnsupportedError, match="TRITON_INTERPRET=1"):
        san_subtraction(torch.randn(1, 1, 4, 4), kernel_size=3, backend="cuda")
    backends._resolve.cache_clear()


@pytest.mark.parametrize("op", ["san_aggregation", "san_subtraction", "san_subtraction2"])
def test_auto_runs_the_kernels_only_where_a_record_covers_the_call(monkeypatch, kernel_records,
                                                                   op):
    """auto leaves a CUDA call to the torch reference until a verification record in the data
    file covers its architecture, dtype and Triton minor (kernel_checks says which)."""
    check_auto_waits_for_a_verification(monkeypatch, kernel_records, "san", op,
                                        _call(dtype=torch.bfloat16), san_module._kernels_trusted)


def test_auto_never_picks_the_interpreter():
    assert san_module._kernels_trusted(_call("cpu")) is not None
    assert backends.resolve("san_aggregation", _call("cpu", torch.float32)) == "torch"
