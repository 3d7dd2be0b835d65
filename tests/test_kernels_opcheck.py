"""``torch.library.opcheck`` of every custom op that launches attnzoo's Triton kernels, forward
and backward: its schema, its autograd registration, its fake implementation against the real
kernel (sizes, strides and dtypes of every output: what a compiled graph is told) and AOT
dispatch with dynamic shapes. Without a GPU the kernels run under Triton's interpreter on CPU
tensors (tests/conftest.py), with one compiled on CUDA tensors.

Inputs come in the layouts models give the ops, not only contiguous: strided views of one qkv
(or kv) projection, dense permutations (heads-major maps seen heads-last), channels_last maps and
a slice of a larger batch; in float32 and bfloat16, with and without the optional inputs (rpb,
window weights, the per-query output, stride 2, a second SAN input, zero padding). A fake
implementation that disagrees with its kernel on any of them fails here. Shapes are tiny: the
interpreter runs every program of every launch in Python.
"""
from __future__ import annotations

import pytest
import torch

from attnzoo import kernels

if kernels.triton_missing():  # an optional dependency; its reason is shown (-ra)
    pytest.skip(kernels.triton_missing(), allow_module_level=True)

import attnzoo.kernels.neighborhood  # noqa: E402,F401  (registers the ops)
import attnzoo.kernels.qna  # noqa: E402,F401
import attnzoo.kernels.san  # noqa: E402,F401
from kernel_checks import laid_out, opcheck  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.interpreter
ops = torch.ops.attnzoo


def _randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------------------------
# neighborhood attention: attnzoo::na_fused and attnzoo::na_fused_backward
# ---------------------------------------------------------------------------------------------

# (layout, dtype, rpb, dilation): each layout once in fp32, and what the optional inputs change
NA_CASES = [
    pytest.param("contiguous", torch.float32, True, 1, id="contiguous-fp32-rpb"),
    pytest.param("projection", torch.float32, True, 1, id="qkv_views-fp32-rpb"),
    pytest.param("projection", torch.bfloat16, False, 2, id="qkv_views-bf16-dilated"),
    pytest.param("permuted", torch.float32, False, 1, id="heads_major-fp32"),
    pytest.param("batch_slice", torch.bfloat16, True, 1, id="batch_slice-bf16-fp32_rpb"),
]
NA_SHAPE, NA_K = (2, 6, 7, 2, 4), (3, 3)  # [B, H, W, heads, d] (>= K * dilation), kernel size


def _na_inputs(layout, dtype, rpb, dilation, grad):
    q, k, v = (laid_out(_randn(*NA_SHAPE, dtype=dtype, seed=s), layout, grad) for s in range(3))
    # the bias an fp32 parameter whatever q's dtype, as under autocast (the kernels round it)
    bias = _randn(NA_SHAPE[3], 2 * NA_K[0] - 1, 2 * NA_K[1] - 1, seed=3)
    return q, k, v, (bias.requires_grad_(grad) if rpb else None), [dilation] * 2


@pytest.mark.parametrize("layout,dtype,rpb,dilation", NA_CASES)
def test_na_fused(layout, dtype, rpb, dilation):
    q, k, v, bias, dil = _na_inputs(layout, dtype, rpb, dilation, grad=True)
    opcheck(ops.na_fused.default, (q, k, v, bias, list(NA_K), dil, 0.5, []))


@pytest.mark.parametrize("layout,dtype,rpb,dilation,kv_grad", [
    pytest.param(*case.values, True, id=case.id) for case in NA_CASES] + [
    pytest.param("projection", torch.float32, True, 1, False, id="qkv_views-fp32-rpb-q_grad_only")])
def test_na_fused_backward(layout, dtype, rpb, dilation, kv_grad):
    q, k, v, bias, dil = _na_inputs(layout, dtype, rpb, dilation, grad=False)
    o, lse = ops.na_fused(q, k, v, bias, list(NA_K), dil, 0.5, [])
    do = laid_out(_randn(*o.shape, dtype=dtype, seed=4), layout)
    opcheck(ops.na_fused_backward.default,
            (do, q, k, v, bias, o, lse, list(NA_K), dil, 0.5, rpb, kv_grad, []), backward_op=True)


# ---------------------------------------------------------------------------------------------
# QnA: attnzoo::qna_fused and attnzoo::qna_fused_backward
# ---------------------------------------------------------------------------------------------

# (layout of v, layout of logits, dtype, stride, sum_queries, biases): the rpb and window
# weights are inputs of the op always (qna_fused gives zeros and ones without them)
QNA_CASES = [
    pytest.param("contiguous", "contiguous", torch.float32, 1, True, False,
                 id="contiguous-fp32-no_bias"),
    pytest.param("projection", "permuted", torch.float32, 1, True, True,
                 id="kv_views-heads_major_logits-fp32-bias"),
    pytest.param("projection", "contiguous", torch.bfloat16, 2, True, True,
                 id="kv_views-bf16-stride2-bias"),
    pytest.param("batch_slice", "batch_slice", torch.float32, 2, False, True,
                 id="batch_slice-fp32-stride2-per_query"),
    pytest.param("permuted", "contiguous", torch.bfloat16, 1, False, False,
                 id="heads_major_v-bf16-per_query"),
]
QNA_SHAPE, QNA_K = (2, 5, 6, 2, 3, 4), 3  # [B, H, W, L, heads, d], kernel size


def _qna_inputs(v_layout, logits_layout, dtype, biases, grad):
    B, H, W, L, heads, d = QNA_SHAPE
    logits = laid_out(_randn(B, H, W, L, heads, dtype=dtype), logits_layout, grad)
    v = laid_out(_randn(B, H, W, heads, d, dtype=dtype, seed=1), v_layout, grad)
    shape = (L, heads, QNA_K, QNA_K)
    rpb, ws = ((_randn(*shape, seed=2), _randn(*shape, seed=3)) if biases
               else (torch.zeros(shape, device=DEVICE), torch.ones(shape, device=DEVICE)))
    return logits, v, rpb.requires_grad_(grad), ws.requires_grad_(grad)


@pytest.mark.parametrize("v_layout,logits_layout,dtype,stride,sum_queries,biases", QNA_CASES)
def test_qna_fused(v_layout, logits_layout, dtype, stride, sum_queries, biases):
    inputs = _qna_inputs(v_layout, logits_layout, dtype, biases, grad=True)
    opcheck(ops.qna_fused.default, (*inputs, QNA_K, stride, sum_queries))


@pytest.mark.parametrize("v_layout,logits_layout,dtype,stride,sum_queries,biases", QNA_CASES)
def test_qna_fused_backward(v_layout, logits_layout, dtype, stride, sum_queries, biases):
    """The case of issue 45: the rpb and window-weight gradients, reduced per head, came back
    transposed ``[L, heads, k, k]`` views where the fake stated contiguous tensors."""
    inputs = _qna_inputs(v_layout, logits_layout, dtype, biases, grad=False)
    out, lse = ops.qna_fused(*inputs, QNA_K, stride, sum_queries)
    g = laid_out(_randn(*out.shape, dtype=dtype, seed=4), v_layout)
    opcheck(ops.qna_fused_backward.default, (g, *inputs, lse, QNA_K, stride, sum_queries),
            backward_op=True)


# ---------------------------------------------------------------------------------------------
# SAN: attnzoo::san_subtraction_fused, san_aggregation_fused and their backward ops
# ---------------------------------------------------------------------------------------------

# (layout, dtype, stride, padding mode)
SAN_CASES = [
    pytest.param("contiguous", torch.float32, 1, "reflect", id="contiguous-fp32-reflect"),
    pytest.param("permuted", torch.float32, 2, "reflect", id="channels_last-fp32-stride2"),
    pytest.param("batch_slice", torch.bfloat16, 1, "zeros", id="batch_slice-bf16-zeros"),
    pytest.param("permuted", torch.bfloat16, 1, "zeros", id="channels_last-bf16-zeros"),
]
SAN_SHAPE, SAN_CW = (2, 4, 5, 6), 2  # [N, C, H, W], weight channels


def _footprint(stride, padding_mode):
    # kernel 3, dilation 1: padding 1 (kernel_size, dilation, stride, padding_mode, padding)
    return [3, 3], [1, 1], [stride] * 2, padding_mode, [1, 1]


def _out_size(stride):
    return tuple((n - 1) // stride + 1 for n in SAN_SHAPE[2:])


def _with(cases, values, ids):
    """Each case with each of ``values`` appended (its id extended)."""
    return [pytest.param(*case.values, value, id=f"{case.id}-{name}")
            for case in cases for value, name in zip(values, ids)]


@pytest.mark.parametrize("layout,dtype,stride,padding_mode,two_inputs", _with(
    SAN_CASES[:2], (False, True), ("one_input", "two_inputs")) + _with(
    SAN_CASES[2:], (True,), ("two_inputs",)))
def test_san_subtraction_fused(layout, dtype, stride, padding_mode, two_inputs):
    x1 = laid_out(_randn(*SAN_SHAPE, dtype=dtype), layout, grad=True)
    x2 = laid_out(_randn(*SAN_SHAPE, dtype=dtype, seed=1), "contiguous", True) \
        if two_inputs else None
    opcheck(ops.san_subtraction_fused.default, (x1, x2, *_footprint(stride, padding_mode)))


@pytest.mark.parametrize("layout,dtype,stride,padding_mode,same", _with(
    SAN_CASES[:2], (True, False), ("one_input", "two_inputs")) + _with(
    SAN_CASES[2:], (False,), ("two_inputs",)))
def test_san_subtraction_fused_backward(layout, dtype, stride, padding_mode, same):
    Ho, Wo = _out_size(stride)
    g = laid_out(_randn(SAN_SHAPE[0], SAN_SHAPE[1], 9, Ho * Wo, dtype=dtype), layout)
    opcheck(ops.san_subtraction_fused_backward.default,
            (g, list(SAN_SHAPE), same, *_footprint(stride, padding_mode)), backward_op=True)


def _aggregation_inputs(layout, dtype, stride, grad):
    Ho, Wo = _out_size(stride)
    x = laid_out(_randn(*SAN_SHAPE, dtype=dtype), layout, grad)
    weight = laid_out(_randn(SAN_SHAPE[0], SAN_CW, 9, Ho * Wo, dtype=dtype, seed=1), layout,
                      grad)
    return x, weight


@pytest.mark.parametrize("layout,dtype,stride,padding_mode", SAN_CASES)
def test_san_aggregation_fused(layout, dtype, stride, padding_mode):
    x, weight = _aggregation_inputs(layout, dtype, stride, grad=True)
    opcheck(ops.san_aggregation_fused.default, (x, weight, *_footprint(stride, padding_mode)))


@pytest.mark.parametrize("layout,dtype,stride,padding_mode,needs", _with(
    SAN_CASES, ((True, True),), ("both_grads",)) + _with(
    SAN_CASES[1:2], ((True, False), (False, True)), ("x_grad_only", "weight_grad_only")))
def test_san_aggregation_fused_backward(layout, dtype, stride, padding_mode, needs):
    x, weight = _aggregation_inputs(layout, dtype, stride, grad=False)
    go = laid_out(_randn(SAN_SHAPE[0], SAN_SHAPE[1], *_out_size(stride), dtype=dtype, seed=2),
                  layout)
    opcheck(ops.san_aggregation_fused_backward.default,
            (go, x, weight, *needs, *_footprint(stride, padding_mode)), backward_op=True)


# ---------------------------------------------------------------------------------------------
# the triton_ops torch.compile traces into (torch >= 2.6: kernels.KernelOp), one case each
# ---------------------------------------------------------------------------------------------

def _first_case(op: str):
    """The arguments of ``op``'s first case above (the backward ops' from a forward call)."""
    q, k, v, bias, dil = _na_inputs(*NA_CASES[0].values, grad=not op.endswith("backward"))
    if op == "na_fused":
        return (q, k, v, bias, list(NA_K), dil, 0.5, [])
    if op == "na_fused_backward":
        o, lse = ops.na_fused(q, k, v, bias, list(NA_K), dil, 0.5, [])
        return (_randn(*o.shape, seed=4), q, k, v, bias, o, lse, list(NA_K), dil, 0.5, True,
                True, [])
    qna_case = QNA_CASES[1].values
    stride, sum_queries = qna_case[3:5]
    if op == "qna_fused":
        return (*_qna_inputs(*qna_case[:3], qna_case[5], grad=True), QNA_K, stride, sum_queries)
    if op == "qna_fused_backward":
        inputs = _qna_inputs(*qna_case[:3], qna_case[5], grad=False)
        out, lse = ops.qna_fused(*inputs, QNA_K, stride, sum_queries)
        return (_randn(*out.shape, seed=4), *inputs, lse, QNA_K, stride, sum_queries)
    layout, dtype, stride, padding_mode = SAN_CASES[1].values
    footprint = _footprint(stride, padding_mode)
    Ho, Wo = _out_size(stride)
    if op == "san_subtraction_fused":
        return (laid_out(_randn(*SAN_SHAPE, dtype=dtype), layout, grad=True), None, *footprint)
    if op == "san_subtraction_fused_backward":
        return (_randn(SAN_SHAPE[0], SAN_SHAPE[1], 9, Ho * Wo, dtype=dtype), list(SAN_SHAPE),
                True, *footprint)
    x, weight = _aggregation_inputs(layout, dtype, stride, grad=op == "san_aggregation_fused")
    if op == "san_aggregation_fused":
        return (x, weight, *footprint)
    return (_randn(SAN_SHAPE[0], SAN_SHAPE[1], Ho, Wo, dtype=dtype, seed=2), x, weight, True,
            True, *footprint)


INDUCTOR_OPS = ["na_fused", "na_fused_backward", "qna_fused", "qna_fused_backward",
                "san_subtraction_fused", "san_subtraction_fused_backward",
                "san_aggregation_fused", "san_aggregation_fused_backward"]


@pytest.mark.skipif(not kernels.inductor_launches(),
                    reason=f"torch {torch.__version__} has no torch.library.triton_op (>= 2.6)")
@pytest.mark.parametrize("op", INDUCTOR_OPS)
def test_inductor_op(op):
    """``attnzoo::<op>_inductor``, the triton_op of each pass: its schema, fake (its host code,
    which on CUDA tensors traces the launches; elsewhere, the opaque op's) and autograd as the
    opaque op's are checked, on the first case above."""
    opcheck(getattr(ops, f"{op}_inductor").default, _first_case(op),
            backward_op=op.endswith("backward"))


def test_every_kernel_op_is_checked_here():
    """A kernel op added to a family without a case here fails this: each op is named by a test
    of this module (a triton_op, ``<op>_inductor``, by :func:`test_inductor_op`)."""
    registered = {name for name in dir(ops) if "fused" in name}
    tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
    tested |= {f"{op}_inductor" for op in INDUCTOR_OPS}
    assert registered and registered <= tested, sorted(registered - tested)
    assert {f"{op}_inductor" for op in INDUCTOR_OPS} <= registered or (
        not kernels.inductor_launches())
