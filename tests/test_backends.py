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
