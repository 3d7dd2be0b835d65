"""Model-level oracle for NAT / DiNAT: a reference forward written here from the papers' and the
spec's equations (explicit LayerNorm with eps 1e-5, fused qkv in [q | k | v] head-major order,
brute-force neighborhood attention with the relative positional bias added unscaled, MLP with
exact GELU, layer scale, the small-input zero-padding rule, mean pooling), run on the model's
own weights in float64. A changed activation, epsilon or layer scale in the model fails it."""
import pytest
import torch
import torch.nn.functional as F

from oracles import gelu_exact, layer_norm, linear, neighborhood_attention
from tiny_models import NAT_SHALLOW as CFG, nat

pytestmark = pytest.mark.floor  # also run on the lowest torch and timm admitted (.ci/floor)

EPS = 1e-5  # the official LayerNorm eps (PyTorch's default)


def ref_block(x, w, prefix, heads, K, d, layer_scale):
    """x: [B, H, W, C] -> the NAT block's output (spec: pre-norm, NA, MLP, layer scale when
    ``layer_scale``: then the gammas must be in ``w``)."""
    B, H, W, C = x.shape
    hd = C // heads
    h = layer_norm(x, w[prefix + "norm1.weight"], w[prefix + "norm1.bias"], EPS)
    # inputs smaller than K*d: zero-pad the normalised map right/bottom before qkv, crop after
    ph, pw = max(K * d - H, 0), max(K * d - W, 0)
    h = F.pad(h, (0, 0, 0, pw, 0, ph))
    qkv = linear(h, w[prefix + "attn.qkv.weight"], w[prefix + "attn.qkv.bias"])
    q, k, v = qkv.reshape(*h.shape[:3], 3, heads, hd).unbind(3)
    a = neighborhood_attention(q, k, v, K, d, w[prefix + "attn.rpb"], hd ** -0.5)
    a = a.reshape(*h.shape[:3], C)[:, :H, :W]
    a = linear(a, w[prefix + "attn.proj.weight"], w[prefix + "attn.proj.bias"])
    gamma1 = w[prefix + "ls1.gamma"] if layer_scale else 1.0
    gamma2 = w[prefix + "ls2.gamma"] if layer_scale else 1.0
    x = x + gamma1 * a
    h = layer_norm(x, w[prefix + "norm2.weight"], w[prefix + "norm2.bias"], EPS)
    h = linear(gelu_exact(linear(h, w[prefix + "mlp.fc1.weight"], w[prefix + "mlp.fc1.bias"])),
               w[prefix + "mlp.fc2.weight"], w[prefix + "mlp.fc2.bias"])
    return x + gamma2 * h


def ref_nat(img, w, depths, heads, K, dilations, layer_scale):
    """The whole network (NAT paper, Fig. 2 and Sec. 3.2): conv stem, levels, downsamplers."""
    x = F.conv2d(img, w["stem.conv1.weight"], w["stem.conv1.bias"], stride=2, padding=1)
    x = F.conv2d(x, w["stem.conv2.weight"], w["stem.conv2.bias"], stride=2, padding=1)
    x = layer_norm(x.permute(0, 2, 3, 1), w["stem.norm.weight"], w["stem.norm.bias"], EPS)
    for i, depth in enumerate(depths):
        if i > 0:  # overlapping 3x3 stride-2 conv, no bias, then LayerNorm
            x = F.conv2d(x.permute(0, 3, 1, 2), w[f"stages.{i}.downsample.conv.weight"],
                         stride=2, padding=1).permute(0, 2, 3, 1)
            x = layer_norm(x, w[f"stages.{i}.downsample.norm.weight"],
                           w[f"stages.{i}.downsample.norm.bias"], EPS)
        for j in range(depth):
            x = ref_block(x, w, f"stages.{i}.blocks.{j}.", heads[i], K, dilations[i][j],
                          layer_scale)
    x = layer_norm(x, w["norm.weight"], w["norm.bias"], EPS)
    return linear(x.mean((1, 2)), w["head.fc.weight"], w["head.fc.bias"])


def _model(layer_scale):
    model = nat(CFG, layer_scale=layer_scale).double()
    with torch.no_grad():
        for p in model.parameters():  # every weight distinct and far from its init
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return model


@pytest.mark.parametrize("layer_scale", [None, 0.5])
def test_nat_matches_reference_forward(layer_scale):
    model = _model(layer_scale)
    w = model.state_dict()
    img = torch.randn(2, 3, 40, 36, dtype=torch.float64)
    with torch.no_grad():
        out = model(img)
    expected = ref_nat(img, w, CFG["depths"], CFG["num_heads"], CFG["kernel_size"],
                       CFG["dilations"], layer_scale is not None)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


def test_block_matches_reference():
    model = _model(0.5)
    block = model.stages[1].blocks[1]  # dilation 2 on a 5x5 map: the padding path
    x = torch.randn(2, 5, 5, 32, dtype=torch.float64)
    prefix = "stages.1.blocks.1."
    w = {k[len(prefix):]: v for k, v in model.state_dict().items() if k.startswith(prefix)}
    with torch.no_grad():
        torch.testing.assert_close(block(x), ref_block(x, w, "", 2, 3, 2, True),
                                   rtol=1e-9, atol=1e-9)


def test_oracle_catches_changed_activation_eps_and_layer_scale():
    """The oracle is sharp enough to see each mistake a model could make: every mutant runs on
    the correct model's weights."""
    img = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    weights = _model(0.5).state_dict()

    def mismatch(model):
        with torch.no_grad():
            out = model(img)
        ref = ref_nat(img, weights, CFG["depths"], CFG["num_heads"], 3, CFG["dilations"], True)
        return not torch.allclose(out, ref, rtol=1e-9, atol=1e-9)

    assert not mismatch(_model(0.5))
    model = _model(0.5)
    for m in model.modules():
        if isinstance(m, torch.nn.GELU):
            m.approximate = "tanh"
    assert mismatch(model)
    model = _model(0.5)
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.eps = 1e-6
    assert mismatch(model)
    model = _model(0.5)
    for block in model.stages[2].blocks:
        block.ls1 = torch.nn.Identity()
    assert mismatch(model)
