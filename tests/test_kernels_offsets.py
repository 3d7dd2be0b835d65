"""The kernels address one sample's elements (a batch entry's) with 32-bit offsets: a call whose
tensors reach further within a sample is refused by the ``cuda`` backend with that reason (``auto``
runs the torch reference), and a gradient that reaches further (a view into a larger tensor) is
copied first. Compiled, a wider offset would wrap around: the access faults or reads elsewhere
(under the interpreter too: it segfaulted before the check)."""
from __future__ import annotations

import pytest
import torch

from attnzoo import kernels
from attnzoo.backends import BackendUnsupportedError
from attnzoo.ops import na2d, qna2d, san_aggregation, san_subtraction

BEYOND = 2 ** 31  # the first offset past int32's


def _meta(shape, stride=None):
    return torch.empty_strided(shape, stride or torch.empty(shape, device="meta").stride(),
                               device="meta")


def test_wide_offsets_measures_one_sample_by_its_strides_and_the_outputs_by_their_size():
    assert not kernels.wide_offsets(_meta((4096, 64, 64, 8, 64)))  # 2**31 elements, 4096 samples
    assert kernels.wide_offsets(_meta((1, 2 ** 16, 2 ** 15 + 1)))  # one sample of 2**31 + 2**16
    row = BEYOND // 2 + 1  # 3 rows: the third starts past int32 (a view into a larger tensor)
    assert kernels.wide_offsets(_meta((1, 3, 4), (0, row, 1)))
    assert not kernels.wide_offsets(_meta((1, 2, 4), (0, row, 1)))
    assert not kernels.wide_offsets(_meta((2 ** 20, 3, 4), (BEYOND, 4, 1)))  # the batch: int64
    assert not kernels.wide_offsets(_meta((1, 0, 4), (0, BEYOND, 1)))  # empty
    assert not kernels.wide_offsets(None, elements=BEYOND - 1)
    assert kernels.wide_offsets(None, elements=BEYOND)


def _refusal(call) -> str:
    with pytest.raises(BackendUnsupportedError) as info:
        call()
    return str(info.value)


OFFSETS = "with 32-bit offsets; this call's tensors reach more than 2147483647 elements"


def test_every_family_refuses_what_its_offsets_cannot_reach():
    """On meta tensors (no memory): the reason is given beside the device's; each family's
    output size counts (SAN's subtraction writes a tap per channel and position, its aggregation
    one)."""
    row = BEYOND // 2 + 1
    q = _meta((1, 3, 3, 1, 16), (0, row, 16, 16, 1))
    assert OFFSETS in _refusal(lambda: na2d(q, q, q, kernel_size=3, backend="cuda"))
    small = _meta((1, 3, 3, 1, 16))
    assert OFFSETS not in _refusal(lambda: na2d(small, small, small, kernel_size=3,
                                                backend="cuda"))
    # QnA: sum_queries=False returns each of L queries' results: L times the values' elements
    logits, v = _meta((1, 512, 512, 64, 2)), _meta((1, 512, 512, 2, 64))
    assert OFFSETS not in _refusal(lambda: qna2d(logits, v, kernel_size=3, backend="cuda"))
    assert OFFSETS in _refusal(lambda: qna2d(logits, v, kernel_size=3, sum_queries=False,
                                             backend="cuda"))
    x = _meta((1, 4096, 256, 256))  # 2**28 elements; with 49 taps each, 2**31 * 6.1
    weight = _meta((1, 8, 49, 256 * 256))
    assert OFFSETS in _refusal(lambda: san_subtraction(x, kernel_size=7, backend="cuda"))
    assert OFFSETS not in _refusal(lambda: san_aggregation(x, weight, kernel_size=7,
                                                           backend="cuda"))


def _far_views(storage, shape, row):
    """Views of ``storage`` of ``shape`` [1, 3, 3, 1, d] whose rows are ``row`` apart."""
    d = shape[-1]
    return [storage[i * 3 * d:].as_strided(shape, (0, row, d, d, 1)) for i in range(4)]


@pytest.mark.interpreter
def test_na_beyond_the_offsets_is_refused_or_runs_the_reference_and_a_far_gradient_is_copied():
    """A view whose third row starts past int32 (its memory untouched but for its elements:
    4 GiB reserved, a few KiB written): cuda refuses it after running the same shape
    contiguous (the checks' cache holds the strides), auto runs the reference; a gradient
    that is such a view reaches the kernels' backward as a copy."""
    row = BEYOND // 2 + 2 ** 10
    storage = torch.empty(2 * row + 4 * 3 * 16, dtype=torch.float16)
    shape = (1, 3, 3, 1, 16)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = _far_views(storage, shape, row)
    for t in (q, k, v, do):
        t.copy_(torch.randn(shape, generator=g))
    contiguous = [t.contiguous() for t in (q, k, v)]
    reference = na2d(*(t.float() for t in contiguous), kernel_size=3, backend="torch")
    torch.testing.assert_close(na2d(*contiguous, kernel_size=3, backend="cuda").float(),
                               reference, atol=2e-3, rtol=0)
    assert OFFSETS in _refusal(lambda: na2d(q, k, v, kernel_size=3, backend="cuda"))
    torch.testing.assert_close(na2d(q, k, v, kernel_size=3).float(), reference, atol=2e-3,
                               rtol=0)  # auto: the reference

    leaves = [t.clone().requires_grad_() for t in contiguous]
    na2d(*leaves, kernel_size=3, backend="cuda").backward(do)
    exact = [t.double().requires_grad_() for t in contiguous]
    na2d(*exact, kernel_size=3, backend="torch").backward(do.double())
    for got, want in zip(leaves, exact):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=5e-3, rtol=0)
