"""``torch.library.opcheck`` of the torch references' custom ops, forward and backward
(``attnzoo::na_reference``, ``qna2d``, ``san_aggregation_reference`` and their ``_backward``
ops: what a compiled training step on the ``torch`` backend calls), on the layouts models hand
them (kernel_checks.laid_out): a fake implementation that states other sizes, strides or dtypes
than its op returns fails here. The kernels' own ops: tests/test_kernels_opcheck.py."""
import pytest
import torch

import attnzoo.ops  # noqa: F401  (registers the ops)
from kernel_checks import laid_out, opcheck

pytestmark = pytest.mark.floor  # also run on the lowest torch and timm admitted (.ci/floor)
ops = torch.ops.attnzoo


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# (layout, dtype, an option): every layout once, each dtype and option value at least once
def _cases(option, values):
    rows = [("contiguous", torch.float32, values[0]), ("projection", torch.bfloat16, values[1]),
            ("permuted", torch.float32, values[1]), ("batch_slice", torch.bfloat16, values[0])]
    return [pytest.param(layout, dtype, value, id=f"{layout}-{str(dtype)[6:]}-{option}{value}")
            for layout, dtype, value in rows]


@pytest.mark.parametrize("layout,dtype,rpb", _cases("rpb=", (True, False)))
def test_na_reference_and_its_backward(layout, dtype, rpb):
    q, k, v = (laid_out(_randn(2, 6, 7, 2, 4, dtype=dtype, seed=s), layout) for s in range(3))
    bias = _randn(2, 5, 5, dtype=dtype, seed=3) if rpb else None
    args = ([3, 3], [1, 2], 0.5)
    grad = laid_out(_randn(*q.shape, dtype=dtype, seed=4), layout)
    opcheck(ops.na_reference_backward.default, (grad, q, k, v, bias, *args), backward_op=True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    opcheck(ops.na_reference.default,
            (*leaves, bias if bias is None else bias.requires_grad_(), *args))


@pytest.mark.parametrize("layout,dtype,stride", _cases("stride=", (1, 2)))
def test_qna2d_and_its_backward(layout, dtype, stride):
    sum_queries = stride == 1  # stride 2 with per-query outputs
    logits = laid_out(_randn(2, 5, 6, 2, 3, dtype=dtype), layout)
    v = laid_out(_randn(2, 5, 6, 3, 4, dtype=dtype, seed=1), layout)
    rpb, ws = _randn(2, 3, 3, 3, seed=2), _randn(2, 3, 3, 3, seed=3)
    out = ops.qna2d(logits, v, rpb, ws, stride, sum_queries)
    grad = laid_out(_randn(*out.shape, dtype=dtype, seed=4), layout)
    opcheck(ops.qna2d_backward.default, (grad, logits, v, rpb, ws, stride, sum_queries),
            backward_op=True)
    leaves = [t.detach().requires_grad_() for t in (logits, v, rpb, ws)]
    opcheck(ops.qna2d.default, (*leaves, stride, sum_queries))


@pytest.mark.parametrize("layout,dtype,stride", [
    case for case in _cases("stride=", (1, 2)) if case.values[0] != "projection"])
def test_san_aggregation_reference_and_its_backward(layout, dtype, stride):
    padding_mode = "reflect" if stride == 1 else "zeros"
    Ho, Wo = 3 if stride == 2 else 5, 3 if stride == 2 else 6
    x = laid_out(_randn(2, 4, 5, 6, dtype=dtype), layout)
    weight = laid_out(_randn(2, 2, 9, Ho * Wo, dtype=dtype, seed=1), layout)
    fp = ([3, 3], [1, 1], [stride] * 2, padding_mode)
    grad = laid_out(_randn(2, 4, Ho, Wo, dtype=dtype, seed=2), layout)
    opcheck(ops.san_aggregation_reference_backward.default, (grad, x, weight, *fp),
            backward_op=True)
    leaves = [t.detach().requires_grad_() for t in (x, weight)]
    opcheck(ops.san_aggregation_reference.default, (*leaves, *fp))
