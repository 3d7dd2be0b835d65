"""Tests of the QnA op (attnzoo.ops.qna2d) and its backends.

The oracle is an independent brute force written from the spec (shared/specs/qna_vit.md,
tests/oracles.py): a Python loop over the output positions; for each, the in-bounds keys of the
k x k window centred at input (i * stride, j * stride), a softmax per query and head over
logit + rpb[offset], the softmax weights times window_weights[offset] times the values, summed
over the window (and over the queries unless sum_queries=False); in float64. Nothing from
attnzoo.ops is reused. It checks the torch reference here; the reference checks every other
backend on the op's registered cases (tests/test_ops_registry.py).
"""
from __future__ import annotations

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnzoo
from attnzoo import backends, kernels
from attnzoo.backends import BackendUnsupportedError
from attnzoo.ops import qna2d
from attnzoo.ops import qna as qna_module
from attnzoo.profiling import count_macs
from oracles import qna as qna_brute_force

pytestmark = pytest.mark.floor  # also run on the lowest torch and timm admitted (.ci/floor)


def _inputs(B, H, W, L, heads, d, k, dtype=torch.float64, seed=0, logit_scale=1.):
    g = torch.Generator().manual_seed(seed)
    new = lambda *s: torch.randn(s, generator=g, dtype=dtype)  # noqa: E731
    return (new(B, H, W, L, heads) * logit_scale, new(B, H, W, heads, d),
            new(L, heads, k, k), new(L, heads, k, k))


def _check_against_brute_force(B, H, W, L, heads, d, k, stride, sum_queries=True,
                               logit_scale=1., backend='torch'):
    tensors = [t.requires_grad_() for t in _inputs(B, H, W, L, heads, d, k,
                                                    logit_scale=logit_scale)]
    logits, v, rpb, ws = tensors
    out = qna2d(logits, v, kernel_size=k, stride=stride, rpb=rpb, window_weights=ws,
                sum_queries=sum_queries, backend=backend)
    ref = qna_brute_force(logits, v, k, stride, rpb, ws, sum_queries)
    assert out.shape == ref.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    probe = torch.randn_like(ref)
    grads = torch.autograd.grad((out * probe).sum(), tensors)
    ref_grads = torch.autograd.grad((ref * probe).sum(), tensors)
    for name, g, rg in zip(('logits', 'v', 'rpb', 'window_weights'), grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-9, atol=1e-9, msg=lambda m: f'{name}: {m}')


@pytest.mark.parametrize('B,H,W,L,heads,d,k,stride', [
    (2, 7, 9, 2, 3, 4, 3, 1),     # odd, non-square, several heads
    (1, 8, 5, 1, 1, 3, 3, 2),     # one query, one head, stride 2 on an even/odd map
    (1, 7, 6, 4, 2, 2, 5, 1),
    (2, 9, 7, 2, 2, 3, 5, 2),
    (1, 6, 8, 2, 2, 2, 7, 1),     # the window is larger than the map on one axis
    (1, 9, 9, 1, 3, 2, 7, 2),
    (1, 5, 7, 4, 1, 2, 3, 2),
])
def test_qna2d_matches_brute_force(B, H, W, L, heads, d, k, stride):
    _check_against_brute_force(B, H, W, L, heads, d, k, stride)


@pytest.mark.parametrize('stride', [1, 2])
def test_unsummed_queries_match_brute_force(stride):
    _check_against_brute_force(1, 7, 6, 4, 2, 3, 3, stride, sum_queries=False)


@pytest.mark.parametrize('stride', [1, 2])
def test_exact_form_on_huge_logit_ranges(stride):
    """Logits spanning far more than exp's range: the call takes the per-window form, which is
    exact too (forward and gradients)."""
    _check_against_brute_force(1, 7, 8, 2, 2, 3, 3, stride, logit_scale=400.)


def test_each_form_against_brute_force():
    """Both forms, called directly, on ordinary logits (where they must agree)."""
    logits, v, rpb, ws = _inputs(2, 7, 6, 2, 3, 4, 5)
    for stride in (1, 2):
        for sum_queries in (True, False):
            ref = qna_brute_force(logits, v, 5, stride, rpb, ws, sum_queries)
            shift = logits.amax((1, 2), keepdim=True) - 3.  # any per-map shift works here
            for out in (qna_module._conv_form_output(logits, v, rpb, ws, stride, sum_queries,
                                                     shift),
                        qna_module._tap_form(logits, v, rpb, ws, stride, sum_queries)):
                torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def _wide_range_logits(dtype):
    """A map whose logits span ~480 (a steep ramp) plus an outlier 300 above its neighbours:
    a per-map shift alone would underflow whole windows to 0/0 in any float dtype."""
    H, W, L, heads = 9, 11, 2, 2
    y = torch.arange(H, dtype=torch.float64).view(H, 1, 1, 1)
    x = torch.arange(W, dtype=torch.float64).view(1, W, 1, 1)
    g = torch.Generator().manual_seed(1)
    logits = 25. * (y + x) + torch.randn(1, H, W, L, heads, generator=g, dtype=torch.float64)
    logits[0, 2, 3] += 300.
    assert float(logits.amax() - logits.amin()) > 200
    v = torch.randn(1, H, W, heads, 4, generator=g, dtype=torch.float64)
    rpb = torch.randn(L, heads, 3, 3, generator=g, dtype=torch.float64)
    ws = torch.randn(L, heads, 3, 3, generator=g, dtype=torch.float64)
    return logits, v, rpb, ws


@pytest.mark.parametrize('stride', [1, 2])
def test_wide_logit_range_float32_matches_float64(stride):
    logits, v, rpb, ws = _wide_range_logits(torch.float64)
    ref = qna_brute_force(logits, v, 3, stride, rpb, ws)
    out = qna2d(logits.float(), v.float(), kernel_size=3, stride=stride, rpb=rpb.float(),
                window_weights=ws.float())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    # the convolution form alone, shifted per map, really would fail here
    naive = qna_module._conv_form_output(logits.float(), v.float(), rpb.float(), ws.float(),
                                         stride, True, logits.float().amax((1, 2), keepdim=True))
    assert not torch.isfinite(naive).all()


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_wide_logit_range_half_precision(dtype):
    logits, v, rpb, ws = _wide_range_logits(torch.float64)
    ref = qna_brute_force(logits, v, 3, 1, rpb, ws)
    out = qna2d(logits.to(dtype), v.to(dtype), kernel_size=3, rpb=rpb, window_weights=ws)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # the logits themselves are rounded to `dtype` (bf16: 8 bits of mantissa on values ~500)
    rounded = qna_brute_force(logits.to(dtype).double(), v.to(dtype).double(), 3, 1, rpb, ws)
    torch.testing.assert_close(out.double(), rounded, rtol=2e-2, atol=2e-2)
    assert ref.shape == out.shape


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_autocast_inputs_finite_and_close(dtype):
    """Under autocast the op gets half-precision logits and values and float32 parameters; it
    computes in float32 and returns the input dtype."""
    logits, v, rpb, ws = _inputs(2, 9, 7, 2, 4, 8, 3, dtype=torch.float32, logit_scale=20.)
    with torch.autocast('cpu', dtype=dtype):
        out = qna2d(logits.to(dtype), v.to(dtype), kernel_size=3, stride=2, rpb=rpb,
                    window_weights=ws)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = qna_brute_force(logits.to(dtype).double(), v.to(dtype).double(), 3, 2, rpb.double(),
                      ws.double())
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_gradcheck_both_forms():
    for scale in (1., 300.):  # the convolution form, then the per-window form
        tensors = [t.requires_grad_() for t in _inputs(1, 4, 5, 2, 2, 2, 3, logit_scale=scale)]
        assert torch.autograd.gradcheck(
            lambda *t: qna2d(t[0], t[1], kernel_size=3, stride=2, rpb=t[2], window_weights=t[3]),
            tensors)


def test_defaults_without_bias_and_weights():
    logits, v, _, _ = _inputs(1, 5, 6, 2, 2, 3, 3)
    zeros, ones = torch.zeros(2, 2, 3, 3, dtype=torch.float64), torch.ones(2, 2, 3, 3,
                                                                            dtype=torch.float64)
    torch.testing.assert_close(qna2d(logits, v, kernel_size=3),
                               qna_brute_force(logits, v, 3, 1, zeros, ones))


def test_noncontiguous_inputs():
    logits, v, rpb, ws = _inputs(2, 6, 5, 2, 3, 4, 3)
    lt = logits.transpose(1, 2).contiguous().transpose(1, 2)
    vt = v.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
    assert not lt.is_contiguous() and not vt.is_contiguous()
    torch.testing.assert_close(qna2d(lt, vt, kernel_size=3, rpb=rpb, window_weights=ws),
                               qna_brute_force(logits, v, 3, 1, rpb, ws))


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize('scale', [1., 300.])
def test_memory_stays_linear_in_the_window(scale):
    """No intermediate is larger than the [B, H, W, L, heads, head_dim] product (plus
    padding): nothing is unfolded k*k times, whichever form runs, forward and backward."""
    B, H, W, L, heads, d, k = 1, 24, 20, 2, 2, 4, 7
    tensors = [t.float() for t in _inputs(B, H, W, L, heads, d, k, logit_scale=scale)]
    pad = k - 1
    bound = B * (H + pad) * (W + pad) * L * heads * d
    with _LargestTensor() as mode:
        out = qna_module._forward(*tensors, 1, True)
    assert mode.numel <= bound and mode.numel < B * H * W * heads * d * k * k // 10
    with _LargestTensor() as mode:
        qna_module._backward(torch.ones_like(out), *tensors, 1, True)
    assert mode.numel <= bound


# --------------------------------------------------------------------------------------------
# backends, errors, accounting
# --------------------------------------------------------------------------------------------

def test_auto_runs_the_reference_on_cpu_and_never_natten():
    call = qna_module.QnACall('cpu', torch.float32, 3, 1, True, False)
    assert backends.resolve('qna2d', call) == 'torch'
    # cuda: no verification record of the kernels (none in the tests), or no GPU
    assert backends.resolve('qna2d', call._replace(device='cuda')) == 'torch'
    assert 'natten' not in backends.supported_backends('qna2d', call._replace(device='cuda'))


@pytest.mark.parametrize('backend,message', [
    ('natten', 'NATTEN cannot express QnA'),
    # CPU tensors outside the interpreter (compiled kernels on a GPU host refuse them too);
    # without a usable Triton (the floor's is too old) that is the reason given
    ('cuda', re.escape(kernels.triton_missing() or "Triton kernels run on CUDA tensors; CPU "
                       "tensors only under Triton's interpreter")),
])
def test_explicit_unsupported_backends_raise(backend, message):
    logits, v, _, _ = _inputs(1, 5, 5, 2, 2, 2, 3, dtype=torch.float32)
    with pytest.raises(BackendUnsupportedError, match=message) as info:
        qna2d(logits, v, kernel_size=3, backend=backend)
    assert "Backends that can: 'torch', 'auto'" in str(info.value)
    with attnzoo.use_backend(backend), pytest.raises(BackendUnsupportedError, match=message):
        qna2d(logits, v, kernel_size=3)


def test_argument_errors():
    logits, v, rpb, ws = _inputs(1, 5, 6, 2, 2, 3, 3, dtype=torch.float32)
    cases = [
        (dict(logits=logits[0]), ValueError, 'logits must be 5-D'),
        (dict(v=v.int()), TypeError, 'v must be a floating-point'),
        (dict(v=v[:, :4]), ValueError, 'must agree on B, H, W and heads'),
        (dict(v=v.double()), ValueError, 'share dtype and device'),
        (dict(kernel_size=4), ValueError, 'kernel_size must be an odd int >= 1'),
        (dict(kernel_size=3.0), TypeError, 'kernel_size must be an int'),
        (dict(stride=0), ValueError, 'stride must be an int >= 1'),
        (dict(rpb=rpb[:, :, :2]), ValueError, r'rpb must have shape \[L, heads, k, k\]'),
        (dict(window_weights=ws.int()), TypeError, 'window_weights must be a floating-point'),
        (dict(sum_queries=1), TypeError, 'sum_queries must be a bool'),
        (dict(backend='tpu'), ValueError, "unknown backend 'tpu'"),
        (dict(logits=logits[:, :0], v=v[:, :0]), ValueError, 'only the batch may be empty'),
        (dict(logits=logits[..., :0, :], rpb=None, window_weights=None), ValueError,
         'only the batch may be empty'),
        (dict(v=v[..., :0]), ValueError, 'only the batch may be empty'),
    ]
    qna2d(logits, v, kernel_size=3, rpb=rpb, window_weights=ws)  # warm: the checks still run
    for change, error, message in cases:
        kwargs = {**dict(logits=logits, v=v, kernel_size=3, rpb=rpb, window_weights=ws), **change}
        with pytest.raises(error, match=message):
            qna2d(kwargs.pop('logits'), kwargs.pop('v'), **kwargs)
    # NumPy's integers are ints (as na2d's kernel_size): the same call
    import numpy as np
    torch.testing.assert_close(
        qna2d(logits, v, kernel_size=np.int64(3), stride=np.int32(2), rpb=rpb, window_weights=ws),
        qna2d(logits, v, kernel_size=3, stride=2, rpb=rpb, window_weights=ws), rtol=0, atol=0)
    positions = qna_module.qna_window_positions
    torch.testing.assert_close(positions(np.int64(5), 6, kernel_size=np.int64(3)),
                               positions(5, 6, kernel_size=3), rtol=0, atol=0)


def test_a_warm_call_skips_the_checks_that_its_metadata_passed(monkeypatch):
    """The checks run once per call metadata; bools, equal to the ints they stand for, are
    still refused after the ints passed."""
    checks = []
    check = qna_module._check_call
    monkeypatch.setattr(qna_module, "_check_call", lambda *a: checks.append(a) or check(*a))
    monkeypatch.setattr(backends, "_CHECKED", {})
    logits, v, _, _ = _inputs(1, 5, 6, 2, 2, 3, 1, dtype=torch.float32)
    for _ in range(3):
        qna2d(logits, v, kernel_size=1, stride=1, sum_queries=True)
    assert len(checks) == 1
    for change, message in ((dict(kernel_size=True), "kernel_size must be an int"),
                            (dict(stride=True), "stride must be an int"),
                            (dict(sum_queries=1), "sum_queries must be a bool")):
        with pytest.raises(TypeError, match=message):
            qna2d(logits, v, **{**dict(kernel_size=1, stride=1, sum_queries=True), **change})


def test_meta_tensors_give_shapes():
    logits = torch.empty(2, 9, 7, 2, 4, device='meta')
    v = torch.empty(2, 9, 7, 4, 8, device='meta')
    assert qna2d(logits, v, kernel_size=3, stride=2).shape == (2, 5, 4, 4, 8)
    assert qna2d(logits, v, kernel_size=3, sum_queries=False).shape == (2, 9, 7, 2, 4, 8)


def test_macs_formula_counted_independently():
    class OneQnA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, v):  # v: [B, H, W, heads, d]; logits from its first two channels
            return qna2d(v[..., :2].transpose(-1, -2) * self.w, v, kernel_size=5, stride=2)

    B, H, W, heads, d = 2, 9, 8, 3, 4
    # window sums of the numerator (d per query and head) and the denominator (1), k*k each
    assert count_macs(OneQnA(), (B, H, W, heads, d)) == B * 5 * 4 * 2 * heads * (d + 1) * 25


def test_benchmark_examples_run():
    examples = dict(backends.op_examples('qna2d', torch.device('cpu'), torch.float32))
    assert len(examples) == 9 and 'figure 3 1x256x256 h8 k7' in examples
    with torch.no_grad():
        assert examples['head dim 256 1x28x28 h2 k7']('torch').shape == (1, 28, 28, 2, 256)
        assert examples['qna_vit_tiny s2 8x14x14 h32 k3']('torch').shape == (8, 14, 14, 32, 8)
        assert examples['qna_vit_tiny down2 8x14x14 h64 k3 s2']('auto').shape == (8, 7, 7, 64, 8)


def test_window_positions_are_each_window_s_keys_and_its_arguments_are_checked():
    """``qna_window_positions``: output pixel (i, j) of stride s reads the k x k keys centred
    on input (i s, j s), row-major (written out here); bad sizes are refused as qna2d refuses
    them (they had given a silent wrong shape, or torch's and Python's own errors)."""
    from attnzoo.ops import qna_window_positions
    got = qna_window_positions(5, 4, kernel_size=3, stride=2)
    want = torch.tensor([[[(i * 2 + dy - 1, j * 2 + dx - 1) for dy in range(3) for dx in range(3)]
                          for j in range(2)] for i in range(3)])
    assert torch.equal(got, want)
    for kwargs, error, message in (
            (dict(kernel_size=4), ValueError, "kernel_size must be an odd int >= 1, got 4"),
            (dict(kernel_size=-1), ValueError, "kernel_size must be an odd int >= 1, got -1"),
            (dict(kernel_size=3, stride=0), ValueError, "stride must be an int >= 1, got 0"),
            (dict(kernel_size=3.0), TypeError, "kernel_size must be an int, got 3.0"),
            (dict(kernel_size=True), TypeError, "kernel_size must be an int, got True")):
        with pytest.raises(error, match=f"^qna_window_positions: {re.escape(message)}$"):
            qna_window_positions(5, 5, **kwargs)
    with pytest.raises(ValueError, match="^qna_window_positions: H must be an int >= 1"):
        qna_window_positions(0, 5, kernel_size=3)
