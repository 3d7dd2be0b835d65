"""Determinism under ``torch.use_deterministic_algorithms(True)`` (docs/backends.md,
"Determinism"): every Triton kernel runs under it and two runs are bitwise equal, forward and
backward; the autotuner then always takes a key's first configuration (a timed choice could
differ from one process to the next); SAN's torch reference reflects its borders by a gather
instead of ``F.pad``, whose CUDA backward has no deterministic implementation."""
import pytest
import torch

from attnzoo import kernels
from attnzoo.ops import na2d, qna2d, san_aggregation, san_neighbours, san_subtraction2
from kernel_checks import CPU, fake_tuner

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def deterministic():
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


def _inputs(*shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype).to(DEVICE).requires_grad_() for s in shapes]


KERNEL_CALLS = {
    "na2d": (lambda q, k, v, rpb: na2d(q, k, v, kernel_size=3, dilation=2, rpb=rpb,
                                        backend="cuda"),
             [(2, 6, 7, 2, 4)] * 3 + [(2, 5, 5)]),
    "qna2d": (lambda logits, v, rpb, ws: qna2d(logits, v, kernel_size=3, stride=2, rpb=rpb,
                                               window_weights=ws, backend="cuda"),
              [(2, 5, 6, 2, 3), (2, 5, 6, 3, 4), (2, 3, 3, 3), (2, 3, 3, 3)]),
    "san_subtraction2": (lambda x1, x2: san_subtraction2(x1, x2, kernel_size=3, backend="cuda"),
                         [(2, 4, 5, 6)] * 2),
    "san_aggregation": (lambda x, w: san_aggregation(x, w, kernel_size=3, backend="cuda"),
                        [(2, 4, 5, 6), (2, 2, 9, 30)]),
}


@pytest.mark.interpreter
@pytest.mark.skipif(kernels.triton_missing() is not None, reason=str(kernels.triton_missing()))
@pytest.mark.parametrize("op", KERNEL_CALLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_kernel_runs_deterministically(op, dtype, deterministic):
    fn, shapes = KERNEL_CALLS[op]
    runs = []
    for _ in range(2):
        inputs = _inputs(*shapes, dtype=dtype)
        out = fn(*inputs)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad((out * weights.to(out)).sum(), inputs)
        runs.append((out, *grads))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_the_autotuner_takes_the_first_configuration_under_deterministic_algorithms():
    """The autotuner would time both configurations and keep the faster; under deterministic
    algorithms it takes the first one, timed or not, even for a key it tuned before."""
    pytest.importorskip("triton")
    tuner, launch, launched = fake_tuner({"slow": 2.0, "fast": 1.0})
    assert tuner.choose("key", ["slow", "fast"], launch, tune=True, device=CPU) == "fast"
    torch.use_deterministic_algorithms(True)
    try:
        launched.clear()
        assert tuner.choose("key", ["slow", "fast"], launch, tune=True, device=CPU) == "slow"
        assert tuner.choose("other", ["slow", "fast"], launch, tune=True, device=CPU) == "slow"
        assert launched == []  # nothing timed
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("stride", [1, 2])
def test_san_reference_reflects_by_a_gather_under_deterministic_algorithms(stride):
    """SAN's torch reference with reflected borders (the subtraction's gather, the
    aggregation's backward, the patchwise SAM's neighbours) under deterministic algorithms: the
    same values and gradients as F.pad's reflection, and none of F.pad's reflection ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__)
            return func(*args, **(kwargs or {}))

    geometry = dict(kernel_size=3, dilation=(1, 2), stride=stride)
    calls = [lambda x, y, w: san_subtraction2(x, y, backend="torch", **geometry),
             lambda x, y, w: san_aggregation(x, w, backend="torch", **geometry),
             lambda x, y, w: san_neighbours(y, **geometry)]
    Ho, Wo = -(-5 // stride), -(-6 // stride)
    results = []
    for mode in (False, True):
        torch.use_deterministic_algorithms(mode)
        try:
            x, y, w = (t.cpu().double().detach().requires_grad_() for t in _inputs(
                (2, 4, 5, 6), (2, 4, 5, 6), (2, 2, 9, Ho * Wo)))
            with Ops() as seen:
                outs = [call(x, y, w) for call in calls]
                grads = torch.autograd.grad(sum(o.square().sum() for o in outs), (x, y, w))
        finally:
            torch.use_deterministic_algorithms(False)
        results.append([*outs, *grads])
        reflection = {n for n in seen.names if n.startswith("reflection_pad")}
        assert bool(reflection) != mode, (mode, reflection)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
