"""The op registry and the one dispatch path: an op is one registration, and everything else
(auto, explicit requests, errors, MAC counting, observers) follows from it."""
from typing import NamedTuple

import pytest
import torch

import attnzoo
from attnzoo import backends
from attnzoo.profiling import count_macs


class ToyCall(NamedTuple):
    device: str
    dtype: torch.dtype


def toy_scale(x, *, factor=2.0, backend=None):
    """An elementwise op (FlopCounterMode counts nothing for it), as SAN's aggregation is."""
    return backends.dispatch("toy_scale", ToyCall(x.device.type, x.dtype), backend, x, factor)


@pytest.fixture
def toy_op(monkeypatch):
    calls = []
    monkeypatch.setattr(backends, "_OPS", dict(backends._OPS))  # registration undone after
    monkeypatch.setitem(backends.AUTO_ORDER, "cpu", ("cuda", "torch"))  # auto's table
    backends.register_op(
        "toy_scale", key_type=ToyCall, macs=lambda x, factor: x.numel(),
        backends={
            "torch": backends.Backend(lambda x, f: calls.append("torch") or x * f),
            "cuda": backends.Backend(lambda x, f: calls.append("cuda") or x * f,
                                     lambda call: None if call.dtype == torch.float16
                                     else f"toy cuda runs float16 only, not {call.dtype}"),
        })
    return calls


def test_registration_is_all_an_op_needs(toy_op):
    x = torch.ones(3)
    assert torch.equal(toy_scale(x), 2 * x) and toy_op == ["torch"]   # auto: cuda cannot
    toy_scale(x.half())
    assert toy_op[-1] == "cuda"                                         # auto's order
    assert backends.resolve("toy_scale", ToyCall("cpu", torch.float16)) == "cuda"
    assert "toy_scale" in backends.registered_ops()
    with attnzoo.use_backend("torch"):
        toy_scale(x.half())
    assert toy_op[-1] == "torch"
    with pytest.raises(attnzoo.BackendUnsupportedError) as info:
        toy_scale(x, backend="cuda")
    assert "float16 only" in str(info.value) and "'torch'" in str(info.value)
    with pytest.raises(attnzoo.BackendUnsupportedError, match="no 'natten' implementation"):
        toy_scale(x, backend="natten")
    assert backends.available_backends("toy_scale", ToyCall("cpu", torch.float32)) == {
        "torch": None, "cuda": "toy cuda runs float16 only, not torch.float32"}


def test_count_macs_counts_registered_ops_by_their_formula(toy_op):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 4, bias=False)

        def forward(self, x):
            return toy_scale(self.fc(x))

    # the Linear as FlopCounterMode sees it (2*4*8 MACs), the toy op by its formula (2*4)
    assert count_macs(Net(), (2, 8)) == 2 * 4 * 8 + 2 * 4


def test_observers_see_op_backend_and_macs(toy_op):
    import contextlib

    seen = []

    @contextlib.contextmanager
    def observer(op, backend, macs):
        seen.append((op, backend, macs))
        yield

    with backends.observe_ops(observer):
        toy_scale(torch.ones(5))
    toy_scale(torch.ones(5))
    assert seen == [("toy_scale", "torch", 5)]


def test_registration_errors():
    with pytest.raises(ValueError, match="unknown backends"):
        backends.register_op("bad", backends={"torch": backends.Backend(abs),
                                              "tpu": backends.Backend(abs)}, macs=len)
    with pytest.raises(ValueError, match="'torch' reference"):
        backends.register_op("bad", backends={"cuda": backends.Backend(abs)}, macs=len)
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        backends.resolve("nope", ())


def test_list_models_is_the_one_definition():
    import timm

    from attnzoo import cli
    ours = attnzoo.list_models()
    assert ours == sorted(ours) and "nat_mini" in ours and "resnet50" not in ours
    assert all(timm.is_model(n) for n in ours)
    assert attnzoo.list_models("dinat_*") == [n for n in ours if n.startswith("dinat_")]
    assert attnzoo.list_models(family="nat") == [n for n in ours
                                                 if attnzoo.models.model_family(n) == "nat"]
    assert "nat_mini.in1k" in attnzoo.list_models(pretrained=True)
    assert cli.main(["list"]) == 0


# ---------------------------------------------------------------------------------------------
# use_backend: checked when called, a context manager or a decorator, never silently ignored
# ---------------------------------------------------------------------------------------------

def test_use_backend_checks_the_name_when_called_even_without_with():
    with pytest.raises(ValueError, match="unknown backend 'nope'; accepted: torch, natten"):
        attnzoo.use_backend("nope")  # used to raise only when (if ever) entered
    with pytest.raises(TypeError, match="backend must be a str"):
        attnzoo.use_backend(None)


def test_use_backend_called_bare_warns_that_it_changed_nothing():
    with pytest.warns(RuntimeWarning, match=r"use_backend\('cuda'\) was never entered, so it "
                                            r"changed nothing.*set_backend\('cuda'\)"):
        attnzoo.use_backend("cuda")
    assert attnzoo.get_backend() == "auto"


def test_use_backend_as_block_and_decorator_restores_on_exit(recwarn):
    @attnzoo.use_backend("natten")
    def inner():
        return attnzoo.get_backend()

    outer = attnzoo.use_backend("torch")
    with outer as name:
        assert name == "torch" and inner() == "natten" and attnzoo.get_backend() == "torch"
        with outer:  # the same object re-entered
            assert attnzoo.get_backend() == "torch"
        assert attnzoo.get_backend() == "torch"
        with pytest.raises(KeyError), attnzoo.use_backend("cuda"):
            raise KeyError
        assert attnzoo.get_backend() == "torch"
    assert attnzoo.get_backend() == "auto" and inner() == "natten"
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_one_use_backend_entered_by_two_threads_restores_each_its_own():
    """A module-level ``use_backend`` object entered by two threads at once: each exit restores
    what that thread had (one stack for both handed a thread the other's backend)."""
    import threading
    shared = attnzoo.use_backend("torch")
    entered, leave, seen = threading.Event(), threading.Event(), {}

    def worker():
        with shared:
            entered.set()
            leave.wait(5)
        seen["worker"] = attnzoo.get_backend()

    thread = threading.Thread(target=worker)
    thread.start()
    entered.wait(5)
    with attnzoo.use_backend("natten"):
        with shared:
            leave.set()
            thread.join(5)
            assert attnzoo.get_backend() == "torch"
        seen["main"] = attnzoo.get_backend()
    assert seen == {"worker": "auto", "main": "natten"}
    assert attnzoo.get_backend() == "auto"
    import copy
    with copy.deepcopy(shared):  # (a plain object still: copied, pickled)
        assert attnzoo.get_backend() == "torch"


# ---------------------------------------------------------------------------------------------
# empty batches
# ---------------------------------------------------------------------------------------------

def _empty_batch_calls():
    """One small call of every public op, at batch ``B``: ``call(B, new) -> output``."""
    from attnzoo.ops import (na1d, na1d_av, na1d_qk, na2d, na2d_av, na2d_qk, qna2d,
                             san_aggregation, san_subtraction, san_subtraction2)
    return {
        "na1d": lambda B, new: na1d(new(B, 9, 2, 4), new(B, 9, 2, 4), new(B, 9, 2, 3),
                                    kernel_size=3, dilation=2, rpb=new(2, 5)),
        "na2d": lambda B, new: na2d(new(B, 6, 5, 2, 4), new(B, 6, 5, 2, 4), new(B, 6, 5, 2, 4),
                                    kernel_size=3, rpb=new(2, 5, 5)),
        "na1d_qk": lambda B, new: na1d_qk(new(B, 9, 2, 4), new(B, 9, 2, 4), kernel_size=3,
                                          dilation=2, rpb=new(2, 5)),
        "na1d_av": lambda B, new: na1d_av(new(B, 9, 2, 3), new(B, 9, 2, 5), kernel_size=3,
                                          dilation=2),
        "na2d_qk": lambda B, new: na2d_qk(new(B, 6, 5, 2, 4), new(B, 6, 5, 2, 4), kernel_size=3,
                                          rpb=new(2, 5, 5)),
        "na2d_av": lambda B, new: na2d_av(new(B, 6, 5, 2, 9), new(B, 6, 5, 2, 3), kernel_size=3),
        "qna2d": lambda B, new: qna2d(new(B, 5, 6, 2, 3), new(B, 5, 6, 3, 4), kernel_size=3,
                                      stride=2, rpb=new(2, 3, 3, 3),
                                      window_weights=new(2, 3, 3, 3)),
        "san_subtraction": lambda B, new: san_subtraction(new(B, 3, 6, 5), kernel_size=3),
        "san_subtraction2": lambda B, new: san_subtraction2(new(B, 3, 6, 5), new(B, 3, 6, 5),
                                                            kernel_size=3, stride=2),
        "san_aggregation": lambda B, new: san_aggregation(new(B, 4, 6, 5), new(B, 2, 9, 30),
                                                          kernel_size=3),
    }


def test_empty_calls_cover_every_registered_op():
    assert set(_empty_batch_calls()) == set(backends.registered_ops())


@pytest.mark.parametrize("op", sorted(_empty_batch_calls()))
def test_every_op_maps_an_empty_batch_to_an_empty_output_forward_and_backward(op):
    """As timm's ResNet and ViT do: the output of batch 1's shape with batch 0, gradients of
    the inputs' shapes (zeros for the unbatched bias tables)."""
    call = _empty_batch_calls()[op]
    inputs = []

    def new(*shape):
        inputs.append(torch.randn(shape, requires_grad=True))
        return inputs[-1]

    one = call(1, new)
    inputs.clear()
    out = call(0, new)
    assert out.shape == (0, *one.shape[1:])
    out.sum().backward()
    for t in inputs:
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


def test_an_empty_call_is_resolved_but_computed_by_the_reference():
    """A backend that cannot run the call still raises at batch 0; one that can (NATTEN here,
    which itself fails on an empty batch) gets an empty result from the torch reference."""
    from attnzoo.ops import na2d, na2d_qkv
    q = torch.randn(0, 6, 6, 2, 8)
    rpb = torch.zeros(2, 5, 5)
    with pytest.raises(attnzoo.BackendUnsupportedError, match="relative positional bias"):
        na2d(q, q, q, kernel_size=3, rpb=rpb, backend="natten")
    full = torch.randn(1, 6, 6, 2, 8)
    with torch.no_grad():
        try:
            na2d(full, full, full, kernel_size=3, backend="natten")
        except attnzoo.BackendUnsupportedError:
            return  # NATTEN is not installed here (CI installs it): nothing more to check
        assert na2d(q, q, q, kernel_size=3, backend="natten").shape == q.shape
        qkv = torch.stack([q, q, q], 3)  # the packed op: its checks tell dispatch it is empty
        assert na2d_qkv(qkv, kernel_size=3, backend="natten").shape == q.shape
