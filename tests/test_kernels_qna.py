"""attnzoo's fused Triton QnA kernels (the ``cuda`` backend of qna2d).

Without a GPU these run under Triton's interpreter on CPU tensors (see
tests/test_kernels_neighborhood.py for how the interpreter is set up); with a GPU, compiled on
CUDA tensors. The oracle is the torch reference in float64 on the very inputs the kernel saw
(rounded to its dtype), forward and the gradients of logits, v, rpb and window weights; the
reference itself is checked against a brute force in tests/test_ops_qna.py (and every case
registered with qna2d runs on this backend in tests/test_ops_registry.py).

Shapes are small but reach what matters: borders (windows leaving the map), interior tiles (at
least 3 tiles of outputs and of keys per axis), partial tiles, both strides on odd and even
sizes, windows larger than the map, unsummed queries, and logits spanning more than the float32
exponent range within a map (where the reference's convolution form needs its fallback).
"""
from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo import backends, kernels
from attnzoo.backends import BackendUnsupportedError

if kernels.triton_missing():  # an optional dependency; its reason is shown (-ra)
    pytest.skip(kernels.triton_missing(), allow_module_level=True)

from attnzoo.kernels import qna as kq  # noqa: E402
from attnzoo.kernels import tiling  # noqa: E402
from attnzoo.ops import qna as qna_module  # noqa: E402
from attnzoo.ops import qna2d  # noqa: E402
from kernel_checks import (  # noqa: E402
    assert_matches_reference, check_auto_waits_for_a_verification, weighted_grads)
import model_checks  # noqa: E402
import tiny_models  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.interpreter

# forward atol=rtol; gradients atol=rtol relative to their largest entry (the rpb and window
# weight gradients are sums over every output)
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 8e-2}


def check_against_reference(shape, k, stride, sum_queries=True, dtype=torch.float32,
                            scale=1.0, bias=True, seed=0, grad_tol=None):
    B, H, W, L, h, d = shape
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, W, L, h), (B, H, W, h, d)] + [(L, h, k, k)] * (2 if bias else 0)
    inputs = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    inputs[0] = inputs[0] * scale
    inputs = [t.to(dtype) for t in inputs]
    results = []
    for backend, ins in (("cuda", [t.to(DEVICE) for t in inputs]),
                         ("torch", [t.double() for t in inputs])):
        ins = [t.requires_grad_() for t in ins]
        out = qna2d(ins[0], ins[1], kernel_size=k, stride=stride, rpb=ins[2] if bias else None,
                    window_weights=ins[3] if bias else None, sum_queries=sum_queries,
                    backend=backend)
        results.append((out, weighted_grads(out, ins, dtype)))
    (out, grads), (ref, ref_grads) = results
    assert_matches_reference(out, grads, ref, ref_grads, dtype, TOL[dtype], grad_tol,
                             names=("logits", "v", "rpb", "window_weights")[:len(grads)])


# (B, H, W, L, heads, head_dim), k, stride, sum_queries
CASES = [
    pytest.param((2, 7, 9, 2, 3, 4), 3, 1, True, id="k3-borders-b2"),
    pytest.param((1, 17, 19, 1, 2, 8), 3, 1, True, id="k3-interior-tiles"),
    pytest.param((1, 33, 35, 1, 1, 3), 3, 2, True, id="k3-s2-odd-interior-tiles"),
    pytest.param((1, 6, 7, 2, 2, 3), 5, 2, False, id="k5-s2-unsummed"),
    pytest.param((1, 5, 6, 2, 2, 5), 7, 1, False, id="k7-larger-than-map-unsummed"),
    pytest.param((1, 8, 8, 3, 1, 2), 3, 2, True, id="k3-s2-even-L3"),
    # head dim 200: programs of a row of 8 outputs (kq.tile), a partial channel block
    pytest.param((1, 5, 11, 2, 1, 200), 3, 1, False, id="hd200-row-tiles-unsummed"),
]


@pytest.mark.parametrize("shape,k,stride,sum_queries", CASES)
def test_qna_kernel_matches_the_reference_fp32(shape, k, stride, sum_queries, bounds_checked):
    check_against_reference(shape, k, stride, sum_queries)


def test_table_gradients_summed_over_many_programs():
    """The keys launch's last programs sum the delta launch's rpb and window-weight tables, one
    per (batch, tile of outputs): here 9 batches x 4 tiles (more than one step of SUM_ROWS
    tables, the last partial) of 18 entries (in 16-entry slots, the last partial), against
    the float64 reference."""
    shape, k = (9, 9, 9, 2, 1, 4), 3
    tables = kq._geometry_of(shape[:5], shape[5], k, 1, True, torch.float32, torch.float32,
                             torch.device("cpu")).tables()
    rows, entries = tables.shape[1] * tables.shape[2], tables[0, 0, 0].numel()
    assert tiling.SUM_ROWS.value < rows and rows % tiling.SUM_ROWS.value
    assert tiling.SUM_ENTRIES.value < entries and entries % tiling.SUM_ENTRIES.value
    check_against_reference(shape, k, 1)


def test_defaults_without_rpb_or_window_weights():
    check_against_reference((1, 6, 5, 2, 2, 3), 3, 1, bias=False)


@pytest.mark.parametrize("stride", [1, 2])
def test_logits_spanning_more_than_the_exponent_range_are_exact(stride):
    """Logits of scale 60 span ~500 within a map, beyond float32's exponent range (where the
    reference's convolution form needs its per-window fallback; the float64 reference here
    does not): the kernel's online softmax is exact without any fallback. Exact as float32 can
    be: a weight's exponent, a logit of size S in float32, carries up to S * eps of absolute
    error whatever the order of operations, so the gradients are compared within that (the
    forward keeps 1e-5; a GPU's exp2 showed 3e-5 at S ~ 250, the interpreter less)."""
    shape, scale, seed = (1, 7, 8, 2, 2, 3), 60.0, 3
    logits = torch.randn(shape[:5], generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64)  # check_against_reference's first draw
    logit_size = scale * logits.abs().max().item()
    check_against_reference(shape, 3, stride, scale=scale, seed=seed,
                            grad_tol=TOL[torch.float32] + 2 * logit_size * torch.finfo().eps)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stride,sum_queries", [(1, True), (2, False)])
def test_qna_kernel_low_precision(dtype, stride, sum_queries):
    check_against_reference((1, 7, 9, 2, 2, 4), 3, stride, sum_queries, dtype=dtype)


def test_inference_under_no_grad_and_noncontiguous_inputs(bounds_checked):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 5, 6, 2, 3, generator=g).transpose(1, 2)[..., :2]  # strided
    v = torch.randn(1, 6, 5, 4, 2, generator=g).transpose(-1, -2)
    with torch.no_grad():
        out = qna2d(logits.to(DEVICE), v.to(DEVICE), kernel_size=3, stride=2, backend="cuda")
    torch.testing.assert_close(out.cpu(), qna2d(logits, v, kernel_size=3, stride=2,
                                                backend="torch"), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# support and backend selection
# --------------------------------------------------------------------------------------------

def _call(device="cuda", dtype=torch.float16, head_dim=8, grad=True):
    return qna_module.QnACall(device, dtype, 3, 1, True, grad, head_dim)


def test_every_reason_is_given_at_once():
    reasons = kq.not_supported_reasons("cpu", torch.float64, 300)
    assert any("float64" in r for r in reasons)
    assert any("head_dim up to 256, got 300" in r for r in reasons)
    with pytest.raises(BackendUnsupportedError) as info:
        backends.resolve("qna2d", _call("cpu", torch.float64, 300), "cuda")
    assert all(reason in str(info.value) for reason in reasons)


def test_auto_runs_the_kernels_only_where_a_record_covers_the_call(monkeypatch, kernel_records):
    """auto leaves a CUDA call to the torch reference until a verification record in the data
    file covers its architecture, dtype and Triton minor (kernel_checks says which)."""
    check_auto_waits_for_a_verification(monkeypatch, kernel_records, "qna", "qna2d",
                                        _call("cuda:0", torch.bfloat16),
                                        qna_module._kernels_trusted)


def test_auto_never_picks_the_interpreter():
    assert qna_module._kernels_trusted(_call("cpu")) is not None
    assert attnzoo.backends.resolve("qna2d", _call("cpu", torch.float32)) == "torch"


def test_qna_vit_on_cuda_equals_torch():
    """A whole QnA-ViT (the registered class, narrow: QnA blocks with k = 3 and 5, both
    downsampling kernels, LSA blocks) gives the torch backend's logits and parameter gradients."""
    model = tiny_models.randomize(tiny_models.qna_vit()).to(DEVICE)
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    model_checks.check_backends_agree(model, x.to(DEVICE))
