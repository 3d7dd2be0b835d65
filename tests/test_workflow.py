"""timm workflow features on NAT: autocast, channels_last input, the backend switch through the
model (torch.compile: tests/test_compile.py)."""
import pytest
import timm
import torch

import attnzoo
from attnzoo import backends
from model_checks import check_autocast


@pytest.fixture(scope="module")
def nat_mini():
    torch.manual_seed(0)
    return timm.create_model("nat_mini", num_classes=10, drop_path_rate=0.)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_cpu(nat_mini, dtype):
    check_autocast(nat_mini.eval(), torch.randn(2, 3, 64, 64), dtype)


def test_channels_last_input(nat_mini):
    nat_mini.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(nat_mini(x.contiguous(memory_format=torch.channels_last)),
                                   nat_mini(x), rtol=1e-5, atol=1e-5)
    converted = timm.create_model("nat_mini", num_classes=10).to(memory_format=torch.channels_last)
    assert converted(x).shape == (2, 10)


def test_backend_switch_reaches_every_layer(nat_mini, monkeypatch):
    calls = []
    op = backends._OPS["na2d"]
    torch_impl = op.backends["torch"].impl
    spied = dict(op.backends, torch=backends.Backend(
        lambda *a: calls.append("torch") or torch_impl(*a)))
    monkeypatch.setitem(backends._OPS, "na2d", op._replace(backends=spied))
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad(), attnzoo.use_backend("torch"):
        nat_mini(x)
    assert len(calls) == sum(1 for m in nat_mini.modules()
                             if isinstance(m, attnzoo.layers.NeighborhoodAttention2d))
    # NAT has relative positional bias, which NATTEN >= 0.20 lacks: an explicit request fails
    # loudly instead of silently running another backend (or dropping the bias).
    pytest.importorskip("natten")
    with pytest.raises(attnzoo.BackendUnsupportedError, match="rpb"):
        with torch.no_grad(), attnzoo.use_backend("natten"):
            nat_mini(x)


def test_training_after_an_inference_mode_forward():
    """Cached index plans made under torch.inference_mode() must not poison a later training
    step at the same shape (timm's benchmark.py --bench both does exactly this)."""
    model = timm.create_model("nat_mini", num_classes=3, drop_path_rate=0.)
    x = torch.randn(1, 3, 48, 48)  # a shape no other test builds plans for
    with torch.inference_mode():
        model.eval()(x)
    model.train()(x).sum().backward()
    assert model.stages[0].blocks[0].attn.rpb.grad is not None
