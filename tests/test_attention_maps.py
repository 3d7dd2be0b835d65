"""Attention maps of every family (``attnzoo.record_attention`` / ``attention_maps`` and each
layer's ``attention_map``).

Per family: recording leaves the model's logits unchanged; the weights are non-negative and sum
to 1 over each query's keys (SAN patchwise: unnormalised, as the paper); and they are the
weights the forward uses: applied by a weighted sum written here (each key's value fetched at the
map's ``keys`` positions, zero outside the map) they give the layer's own output. That checks
the weights, their axis order and the key positions at once.
"""
from __future__ import annotations

import pytest
import torch

import attnzoo
from attnzoo.layers import (LocalSelfAttention, NeighborhoodAttention2d, QnA, QnAUpsample,
                            attention_layers, attention_maps, record_attention)
from tiny_models import nat, qna_vit, quest_vit, randomize, san

pytestmark = pytest.mark.floor


def at_keys(values: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``values [B, H, W, ...]`` at ``keys [Ho, Wo, T, 2]`` -> ``[B, Ho, Wo, T, ...]``, zero where
    a key lies outside the map."""
    H, W = values.shape[1:3]
    y, x = keys[..., 0], keys[..., 1]
    inside = (y >= 0) & (y < H) & (x >= 0) & (x < W)
    got = values[:, y.clamp(0, H - 1), x.clamp(0, W - 1)]
    return got * inside.view(1, *inside.shape, *([1] * (values.dim() - 3))).to(values.dtype)


def check_normalised(weights: torch.Tensor, dim: int = -1) -> None:
    assert (weights >= 0).all()
    torch.testing.assert_close(weights.sum(dim), torch.ones_like(weights.sum(dim)))


# --------------------------------------------------------------------------------------------
# each layer: the weights reproduce its output
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size,kernel,dilation,attn_norm", [
    ((9, 11), 3, 2, "none"), ((5, 4), 5, 1, "none"), ((13, 12), 5, 2, "quest")])
def test_na_layer_weights_make_its_output(size, kernel, dilation, attn_norm):
    torch.manual_seed(0)
    layer = NeighborhoodAttention2d(16, 2, kernel, dilation, attn_norm=attn_norm).double().eval()
    x = torch.randn(2, *size, 16, dtype=torch.float64)
    amap = layer.attention_map(x)
    H, W = size
    assert amap.axes == ("batch", "y", "x", "head", "key") and amap.map_size == size
    assert amap.weights.shape == (2, H, W, 2, kernel * kernel)
    check_normalised(amap.weights)
    # the padded map (small inputs) holds the qkv bias at the padding: values from it
    padded = torch.nn.functional.pad(x, (0, 0, 0, max(kernel * dilation - W, 0), 0,
                                         max(kernel * dilation - H, 0)))
    _, _, v = layer.heads_qkv(padded)
    out = torch.einsum("byxht,byxthc->byxhc", amap.weights, at_keys(v, amap.keys))
    torch.testing.assert_close(layer.proj(out.flatten(-2)), layer(x))
    # every key of a query's window is in its dilation group and within the (padded) map
    centre = torch.stack(torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij"), -1)
    assert ((amap.keys - centre.unsqueeze(2)) % dilation == 0).all()


@pytest.mark.parametrize("stride", [1, 2])
def test_qna_layer_weights_make_its_output(stride):
    torch.manual_seed(0)
    layer = randomize(QnA(8, 16, num_heads=2, kernel_size=3, stride=stride, num_queries=2))
    layer = layer.double().eval()
    x = torch.randn(2, 7, 6, 8, dtype=torch.float64)
    amap = layer.attention_map(x)
    Ho, Wo = (7 - 1) // stride + 1, (6 - 1) // stride + 1
    assert amap.axes == ("batch", "y", "x", "query", "head", "key")
    assert amap.weights.shape == (2, Ho, Wo, 2, 2, 9) and amap.stride == stride
    check_normalised(amap.weights)
    outside = (amap.keys < 0).any(-1) | (amap.keys[..., 0] >= 7) | (amap.keys[..., 1] >= 6)
    assert outside.any() and (amap.weights.permute(0, 3, 4, 1, 2, 5)[..., outside] == 0).all()
    v = layer.v(x).reshape(2, 7, 6, 2, 8)
    scaled = amap.weights * layer.window_weights.flatten(-2)                 # [B,y,x,L,h,t]
    out = torch.einsum("byxlht,byxthc->byxhc", scaled, at_keys(v, amap.keys))
    torch.testing.assert_close(layer.proj(out.flatten(-2)), layer(x))


def test_qna_upsample_weights_make_its_output():
    torch.manual_seed(0)
    layer = randomize(QnAUpsample(8, 8, num_heads=2, scale=2, kernel_size=3)).double().eval()
    x = torch.randn(1, 5, 4, 8, dtype=torch.float64)
    amap = layer.attention_map(x)
    assert amap.weights.shape == (1, 5, 4, 4, 2, 9)
    check_normalised(amap.weights)
    v = layer.v(x).reshape(1, 5, 4, 2, 4)
    out = torch.einsum("byxlht,byxthc->byxlhc", amap.weights, at_keys(v, amap.keys))
    sub = layer.proj(out.flatten(-2)).reshape(1, 5, 4, 2, 2, 8)             # [B,y,x,i,j,C]
    torch.testing.assert_close(sub.permute(0, 1, 3, 2, 4, 5).reshape(1, 10, 8, 8), layer(x))


@pytest.mark.parametrize("size", [(7, 7), (9, 5), (16, 14)])
def test_lsa_layer_weights_make_its_output(size):
    torch.manual_seed(0)
    layer = randomize(LocalSelfAttention(16, 2, window_size=7)).double().eval()
    x = torch.randn(2, *size, 16, dtype=torch.float64)
    amap = layer.attention_map(x)
    assert amap.weights.shape[:4] == (2, *size, 2)
    check_normalised(amap.weights)
    v = layer.qkv(x).reshape(2, *size, 3, 2, 8)[..., 2, :, :]
    out = torch.einsum("byxht,byxthc->byxhc", amap.weights, at_keys(v, amap.keys))
    torch.testing.assert_close(layer.proj(out.flatten(-2)), layer(x))


@pytest.mark.parametrize("sa_type,padding_mode,stride", [
    ("pairwise", "reflect", 1), ("patchwise", "reflect", 1), ("pairwise", "zeros", 2),
    ("patchwise", "zeros", 1)])
def test_san_weights_make_its_output(sa_type, padding_mode, stride):
    model = randomize(san(sa_type, padding_mode=padding_mode)).double().eval()
    layer = model.stages[1].blocks[0].attn
    layer.stride = stride
    x = torch.randn(2, layer.conv1.in_channels, 9, 10, dtype=torch.float64)
    amap = layer.attention_map(x)
    assert amap.axes == ("batch", "y", "x", "group", "key")
    if sa_type == "pairwise":
        check_normalised(amap.weights)
    x3 = layer.conv3(x).permute(0, 2, 3, 1)                                 # [B, H, W, C]
    values = at_keys(x3, amap.keys)                                          # [B,y,x,t,C]
    groups = amap.weights.shape[3]  # feature channel c uses group c % groups
    weight_of_channel = amap.weights[..., torch.arange(x3.shape[-1]) % groups, :]
    out = torch.einsum("byxct,byxtc->bcyx", weight_of_channel, values)
    torch.testing.assert_close(out, layer(x))


def test_quest_weights_make_its_output():
    model = quest_vit().double()
    layer = model.blocks[1].attn
    x = torch.randn(2, 17, model.embed_dim, dtype=torch.float64)
    amap = layer.attention_map(x)
    assert amap.axes == ("batch", "head", "query", "key") and amap.keys is None
    check_normalised(amap.weights)
    _, _, v = layer.heads_qkv(x)
    out = (amap.weights @ v).transpose(1, 2).reshape(2, 17, -1)
    torch.testing.assert_close(layer.proj(layer.norm(out)), layer(x))


# --------------------------------------------------------------------------------------------
# models: recording changes nothing, names resolve, errors are clear
# --------------------------------------------------------------------------------------------

MODELS = {
    "nat": (lambda: nat(), 64, "1.1", 5),
    "qna_vit": (lambda: qna_vit(), 64, "0.0", 6),
    "san": (lambda: randomize(san("patchwise")), 128, "2.0", 5),
    "quest_vit": (lambda: quest_vit(), 32, "1", 4),
}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_recording_leaves_the_logits_unchanged(family):
    build, size, short, ndim = MODELS[family]
    model = build()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected = model(x)
        with record_attention(model) as maps:
            logits = model(x)
        after = model(x)
    assert torch.equal(logits, expected) and torch.equal(after, expected)
    assert list(maps) == list(attention_layers(model)) and len(maps) >= 2
    for amap in maps.values():
        assert amap.weights.dim() == len(amap.axes) and amap.weights.shape[0] == 2
        assert amap.weights.dtype == logits.dtype and torch.isfinite(amap.weights).all()
    chosen = attention_maps(model, x, short)
    (name,) = chosen
    assert chosen[name].weights.dim() == ndim
    torch.testing.assert_close(chosen[name].weights, maps[name].weights)
    assert not any(m._forward_hooks for m in model.modules())  # hooks removed


def test_layer_names():
    model = nat()
    names = list(attention_layers(model))
    assert names[0] == "stages.0.blocks.0.attn"
    x = torch.randn(1, 3, 64, 64)
    for alias in ("1.1", "stages.1.blocks.1", "stages.1.blocks.1.attn"):
        assert list(attention_maps(model, x, alias)) == ["stages.1.blocks.1.attn"]
    assert list(attention_maps(model, x, ["0.0", "3.0"])) == ["stages.0.blocks.0.attn",
                                                             "stages.3.blocks.0.attn"]
    with pytest.raises(ValueError, match=r"layers: '7\.0' is not an attention layer of NAT; "
                                         r"accepted: 'STAGE\.BLOCK' or a name, e\.g\. "
                                         r"stages\.0\.blocks\.0\.attn"):
        attention_maps(model, x, "7.0")
    with pytest.raises(ValueError, match="has no attnzoo attention layer"):
        attention_maps(torch.nn.Linear(3, 3), x)
    assert not any(m._forward_hooks for m in model.modules())
    vit = quest_vit()  # blocks, no stages: the short form is BLOCK
    with pytest.raises(ValueError, match=r"'99' is not an attention layer of VisionTransformer; "
                                         r"accepted: 'BLOCK' or a name, e\.g\. blocks\.0\.attn"):
        attention_maps(vit, torch.randn(1, 3, *vit.pretrained_cfg["input_size"][1:]), "99")


def test_maps_follow_the_model_backend_and_do_not_need_grad():
    """The forward runs its backend (here the torch reference; on a GPU the kernels), the maps
    come from the unfused ops; in training mode with gradients on, the logits keep theirs."""
    model = nat().train()
    x = torch.randn(1, 3, 64, 64)
    with attnzoo.use_backend("torch"), record_attention(model, "0.0") as maps:
        logits = model(x)
    assert logits.requires_grad and maps["stages.0.blocks.0.attn"].weights.requires_grad


def test_the_heat_of_a_query_is_its_window():
    """The picture's heat (attnzoo.visualize.query_heat): a corner query of dilated NA lights
    exactly its clamped window (the brute force's), with the query's weights."""
    from attnzoo.visualize import query_heat
    from oracles import na_window
    torch.manual_seed(0)
    layer = NeighborhoodAttention2d(8, 2, 3, 2).eval()
    amap = layer.attention_map(torch.randn(1, 9, 10, 8))
    heat = query_heat(amap, (8, 0), head=1)
    assert heat.shape == (1, 9, 10)
    ys, xs = na_window(9, 3, 2, 8), na_window(10, 3, 2, 0)
    lit = torch.zeros(9, 10, dtype=torch.bool)
    lit[torch.tensor(ys).view(-1, 1), torch.tensor(xs).view(1, -1)] = True
    assert torch.equal(heat[0] > 0, lit)
    torch.testing.assert_close(heat[0][lit], amap.weights[0, 8, 0, 1])
    torch.testing.assert_close(query_heat(amap, (8, 0))[0], amap.weights[0, 8, 0].mean(0)
                               .new_zeros(9, 10).index_put_(
                                   (torch.tensor(ys).repeat_interleave(3),
                                    torch.tensor(xs).repeat(3)), amap.weights[0, 8, 0].mean(0)))


def test_the_picture_has_a_scale_the_query_and_signed_weights(tmp_path, monkeypatch):
    """draw_attention: a colour bar with the weights' range on each panel and the query marked;
    weights below 0 (SAN patchwise) drawn in a diverging map centred on 0, not left out;
    positions of weight exactly 0 (outside the window) left transparent; softmax weights on a
    sequential map from 0."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes
    from matplotlib.colorbar import Colorbar
    from PIL import Image

    from attnzoo.visualize import draw_attention
    labels, layers, marks = [], [], []
    for cls, name, record in ((Colorbar, "set_label", lambda a, k: a[0] and labels.append(a[0])),
                              (Axes, "imshow", lambda a, k: layers.append((a[0], k))),
                              (Axes, "plot", lambda a, k: marks.append(a))):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, real=real, record=record, **k: (
            record(a, k), real(self, *a, **k))[1])
    image = Image.new("RGB", (80, 40), (128, 128, 128))
    heat = torch.zeros(1, 2, 4)
    heat[0, :, 0], heat[0, :, 1] = -1.0, 0.5
    draw_attention(image, heat, (70.0, 30.0), str(tmp_path / "s.png"), "signed", ["mean"])
    assert labels == ["weight, -1 to 0.5"]
    (_, _), (weights, style) = layers  # the image, then the weights over it
    assert style["cmap"] == "RdBu_r" and (style["vmin"], style["vmax"]) == (-1.0, 1.0)
    assert weights.mask.tolist() == [[False, False, True, True]] * 2  # zeros: transparent
    assert weights.min() == -1.0  # the negative weights are drawn
    assert all(mark[:2] == (70.0, 30.0) for mark in marks) and marks
    labels.clear()
    layers.clear()
    draw_attention(image, heat.clamp(min=0), (70.0, 30.0), str(tmp_path / "p.png"), "softmax")
    (_, _), (weights, style) = layers
    assert style["cmap"] == "inferno" and (style["vmin"], style["vmax"]) == (0, 0.5)
    assert labels == ["weight, 0 to 0.5"]
