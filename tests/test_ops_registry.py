"""Every registered op on every backend that can run it here, against the float64 torch reference.

The cases are the ops' own (``attnzoo.backends.op_cases``: small calls covering each op's options,
registered with the op), so a new op, or a new backend of an op, is checked by registering it.
Each (op, case, backend, dtype) is one test: the backend's output and the gradients of every
input against the torch reference in float64 on the same values (``attnzoo.backends.check_case``,
which ``attnzoo check`` runs too), within ``attnzoo.backends.TOLERANCE`` of the dtype. The chain:
the brute forces (tests/oracles.py) check the torch reference (tests/test_ops_*.py), the
reference checks every backend (here).

Which backend runs which case is the op's own answer (``case_support``): the torch reference,
NATTEN where it is installed (forward only on CPU), attnzoo's Triton kernels on a GPU or, without
one, under Triton's interpreter. Dtypes: the reference in each but float64 (where it is the
reference itself), the others in each on a GPU but only in float64 and float32 on CPU (NATTEN's
CPU path and the interpreter are slow, and half precision is what GPUs run;
tests/test_kernels_neighborhood.py checks the kernels in half precision under the interpreter).
"""
import itertools

import pytest
import torch

from attnzoo import backends
from attnzoo.backends import BackendUnsupportedError

pytestmark = pytest.mark.floor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _interpreted(backend: str) -> bool:
    return backend == "cuda" and DEVICE == "cpu"


def _dtypes(backend: str):
    if backend == "torch":
        return DTYPES[1:]
    return DTYPES if DEVICE == "cuda" else DTYPES[:2]


def _param(op: str, label: str, backend: str, dtype: torch.dtype, backward: bool):
    marks = [pytest.mark.interpreter] if _interpreted(backend) else []
    if backend == "natten":  # its CPU path: flex_attention's warnings
        marks.append(pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"))
    name = "-".join([op, backend, str(dtype)[6:], label] + ([] if backward else ["forward-only"]))
    return pytest.param(op, label, backend, dtype, backward, marks=marks, id=name)


def _checks():
    """A param per case and dtype a backend can run here: with its backward where it can
    (NATTEN's CPU path cannot), else forward only."""
    params = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")  # what the tests marked `interpreter` run under
        for op, dtype in itertools.product(backends.registered_ops(), DTYPES):
            for case, backend in itertools.product(backends.op_cases(op, DEVICE, dtype),
                                                   backends.CONCRETE_BACKENDS):
                if dtype not in _dtypes(backend):
                    continue
                backward = backends.case_support(case, backend) is None
                if backward or backends.case_support(case, backend, backward=False) is None:
                    params.append(_param(op, case.label, backend, dtype, backward))
    backends.reset()  # forget the choices made under the interpreter
    return params


CHECKS = _checks()


def _case(op: str, label: str, dtype: torch.dtype) -> backends.Case:
    (case,) = [c for c in backends.op_cases(op, DEVICE, dtype) if c.label == label]
    return case


@pytest.mark.parametrize("op,label,backend,dtype,backward", CHECKS)
def test_backend_matches_the_float64_reference(op, label, backend, dtype, backward):
    result = backends.check_case(_case(op, label, dtype), backend, backward)
    tolerance = backends.TOLERANCE[dtype]
    assert result.forward <= tolerance, result
    assert not backward or result.backward <= tolerance, result


def test_every_op_checks_every_option_on_the_reference():
    """Every registered op has cases (distinct labels) in every dtype, and the torch reference
    runs each of them, forward and backward: none is left out of the checks above."""
    checked = {(p.values[0], p.values[1]) for p in CHECKS if p.values[2] == "torch"}
    for op in backends.registered_ops():
        for dtype in DTYPES:
            labels = [case.label for case in backends.op_cases(op, DEVICE, dtype)]
            assert labels and len(set(labels)) == len(labels), (op, labels)
            assert {(op, label) for label in labels} <= checked


def test_unsupported_backends_raise_what_case_support_says():
    """The dry run tells the truth: a backend it rules out raises BackendUnsupportedError with
    the same reason when really asked (and computes nothing)."""
    refused = 0
    for op in backends.registered_ops():
        for case in backends.op_cases(op, DEVICE, torch.float32):
            for backend in backends.CONCRETE_BACKENDS:
                reason = backends.case_support(case, backend)
                if reason is not None:
                    refused += 1
                    with pytest.raises(BackendUnsupportedError) as info:
                        backends.check_case(case, backend)
                    assert str(info.value) == reason
    assert refused  # natten cannot run QnA or SAN anywhere


@pytest.fixture
def faulty_cuda(monkeypatch):
    """na2d's `cuda` backend replaced by the torch reference run on slightly wrong inputs,
    supported everywhere; ``faulty_cuda(fault)`` sets the fault (a function of the args)."""
    spec = backends._OPS["na2d"]
    reference = spec.backends["torch"].impl
    fault = []

    def impl(*args):
        return reference(*fault[-1](*args))

    monkeypatch.setitem(backends._OPS, "na2d", spec._replace(
        backends=dict(spec.backends, cuda=backends.Backend(impl))))
    backends.reset()
    return fault.append


def test_check_case_catches_wrong_outputs_and_wrong_gradients(faulty_cuda):
    case = backends.op_cases("na2d", DEVICE, torch.float32)[0]
    tolerance = backends.TOLERANCE[torch.float32]
    faulty_cuda(lambda q, k, v, *rest: (q, k, v * (1 + 1e-3), *rest))   # every output off
    assert backends.check_case(case, "cuda").forward > tolerance
    # the same output, but no gradient reaches v
    faulty_cuda(lambda q, k, v, *rest: (q, k, v.detach() + (v - v.detach()) * 0.5, *rest))
    result = backends.check_case(case, "cuda")
    assert result.forward <= tolerance < result.backward
    assert backends.check_case(case, "cuda", backward=False).backward is None
