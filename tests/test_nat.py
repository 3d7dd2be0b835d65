"""NAT / DiNAT: configs, shapes, the small-input padding rule, timm's model contract,
checkpoint conversion and the offline pretrained path. Big models are built on 'meta'."""
import copy
import functools
import json
import math

import pytest
import timm
import torch
import torch.nn.functional as F

import attnzoo
from timm.layers import LayerScale
from attnzoo.layers import NeighborhoodAttention2d
from attnzoo.models.nat import checkpoint_filter_fn
from attnzoo.profiling import count_params
from hub_cache import offline_hf_cache, write_hf_cache
from model_checks import (check_bad_input_and_arguments, check_grad_checkpointing,
                          check_forward_intermediates_and_prune, check_head_contract,
                          check_in_chans_and_meta_dtype, check_torchscript_and_fx, leaf_calls)
from oracles import neighborhood_attention
import tiny_models
from checkpoint_layouts import nat_official_manifest, nat_official_to_transformers, nat_to_official
from checkpoint_layouts import nat_to_transformers as to_transformers_layout


@functools.lru_cache(maxsize=None)
def _meta(name):
    """Registered model on the meta device (no memory, no init cost); shared, do not mutate."""
    return timm.create_model(name, device='meta')


# ----------------------------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------------------------

# Params in M as in the spec table, with its precision (decimals). Where the table is silent:
# dinat_small has no layer scale (spec), so it lacks NAT-Small's 2 * dim gammas per block:
# 50.743297M - 2 * (3*96 + 4*192 + 18*384 + 5*768) = 50.719681M -> 50.72 (derived).
# dinat_large_384 only changes dilations (no params): as dinat_large. dinat_large_11x11_384 is
# checked below against dinat_large plus its bigger rpb tables (derived, not in the table).
EXPECTED_PARAMS = {
    'nat_mini': (19.98, 2), 'nat_tiny': (27.90, 2), 'nat_small': (50.74, 2),
    'nat_base': (89.77, 2),
    'dinat_mini': (19.98, 2), 'dinat_tiny': (27.90, 2), 'dinat_small': (50.72, 2),
    'dinat_base': (89.77, 2),
    'dinat_large': (200.9, 1), 'dinat_large_384': (200.9, 1), 'dinat_large_11x11_384': None,
}


def test_every_registered_variant_has_an_expected_count():
    assert set(timm.list_models(module='nat')) == set(EXPECTED_PARAMS)


@pytest.mark.parametrize('name', sorted(k for k, v in EXPECTED_PARAMS.items() if v))
def test_param_counts(name):
    expected, decimals = EXPECTED_PARAMS[name]
    model = _meta(name)
    assert round(count_params(model) / 1e6, decimals) == expected


def test_param_count_11x11():
    large = _meta('dinat_large')
    big = _meta('dinat_large_11x11_384')
    depths, heads = (3, 4, 18, 5), (6, 12, 24, 48)
    extra = sum(d * h for d, h in zip(depths, heads)) * ((2 * 11 - 1) ** 2 - (2 * 7 - 1) ** 2)
    assert count_params(big) - count_params(large) == extra
    assert big.stages[0].blocks[0].attn.rpb.shape == (6, 21, 21)


def test_variant_configs():
    dinat = _meta('dinat_tiny')
    dil = [[b.attn.dilation for b in lvl.blocks] for lvl in dinat.stages]
    assert dil == [[1, 8, 1], [1, 4, 1, 4], [1, 2] * 9, [1] * 5]
    mini = _meta('dinat_mini')
    assert [[b.attn.dilation for b in lvl.blocks] for lvl in mini.stages] == [
        [1, 8, 1], [1, 4, 1, 4], [1, 2, 1, 2, 1, 2], [1] * 5]
    d384 = _meta('dinat_large_384')
    assert [[b.attn.dilation for b in lvl.blocks] for lvl in d384.stages] == [
        [1, 13, 1], [1, 6, 1, 6], [1, 3] * 9, [1] * 5]
    assert all(b.attn.kernel_size == 11 for lvl in _meta('dinat_large_11x11_384').stages
               for b in lvl.blocks)
    # layer scale: NAT-Small/Base and DiNAT-Base, not DiNAT-Small
    for name, has in (('nat_small', True), ('nat_base', True), ('dinat_small', False),
                      ('dinat_base', True), ('nat_mini', False), ('dinat_large', False)):
        block = _meta(name).stages[0].blocks[0]
        assert isinstance(block.ls1, LayerScale) == has, name
        assert isinstance(block.ls2, LayerScale) == has, name
    cfg = timm.get_pretrained_cfg('nat_mini.in1k').to_dict()
    assert cfg['hf_hub_id'] == 'shi-labs/nat-mini-in1k-224'
    assert cfg['interpolation'] == 'bicubic' and cfg['crop_pct'] == 0.875
    assert timm.get_pretrained_cfg('dinat_large_384.in22k_ft_in1k').input_size == (3, 384, 384)


# ----------------------------------------------------------------------------------------------
# shapes, padding rule, errors
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def dinat_mini():
    torch.manual_seed(0)
    return timm.create_model('dinat_mini', num_classes=11).eval()


def _level_sizes(h, w):
    h, w = math.ceil(math.ceil(h / 2) / 2), math.ceil(math.ceil(w / 2) / 2)
    sizes = [(h, w)]
    for _ in range(3):
        h, w = math.ceil(h / 2), math.ceil(w / 2)
        sizes.append((h, w))
    return sizes


@pytest.mark.parametrize('size', [(32, 32), (33, 33), (57, 57), (224, 224), (33, 57), (40, 96)])
def test_output_shapes(dinat_mini, size):
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        feats = dinat_mini.forward_features(x)
        logits = dinat_mini.forward_head(feats)
        inter = dinat_mini.forward_intermediates(x, intermediates_only=True)
    sizes = _level_sizes(*size)
    assert feats.shape == (2, 512, *sizes[-1])  # NCHW, unpooled
    assert logits.shape == (2, 11) and torch.isfinite(logits).all()
    assert [tuple(t.shape) for t in inter] == [
        (2, 64 * 2 ** i, *hw) for i, hw in enumerate(sizes)]


@pytest.mark.parametrize('hw,K,d', [((5, 4), 3, 2), ((2, 9), 3, 1), ((7, 5), 3, 3)])
def test_small_input_padding_matches_reference(hw, K, d):
    torch.manual_seed(0)
    dim, heads = 8, 2
    attn = NeighborhoodAttention2d(dim, heads, kernel_size=K, dilation=d).eval()
    with torch.no_grad():
        attn.qkv.bias.normal_()  # padded tokens' k / v are the bias: make it matter
        attn.rpb.normal_()
        x = torch.randn(2, *hw, dim)
        out = attn(x)
        # reference: zero-pad the input right/bottom to K*d, qkv, NA, crop, proj
        ph, pw = max(K * d - hw[0], 0), max(K * d - hw[1], 0)
        assert ph or pw
        xp = F.pad(x, (0, 0, 0, pw, 0, ph))
        q, k, v = attn.qkv(xp).reshape(*xp.shape[:3], 3, heads, dim // heads).unbind(3)
        ref = neighborhood_attention(q, k, v, K, d, attn.rpb, (dim // heads) ** -0.5)
        ref = attn.proj(ref.flatten(-2)[:, :hw[0], :hw[1]])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_model_pads_small_levels():
    # at 32 px, level 0 is 8x8 while one of its blocks has K*d = 3*2 = 6 <= 8 and level 3
    # (1x1) is padded to 3x3: the model runs and the output depends on every input pixel
    model = tiny_models.nat()
    x = torch.randn(1, 3, 32, 32, requires_grad=True)
    model(x).sum().backward()
    assert (x.grad != 0).float().mean() > 0.9


def test_errors():
    check_bad_input_and_arguments(tiny_models.nat(), 'nat_mini', 32)
    with pytest.raises(ValueError, match='attn_drop'):
        timm.create_model('nat_mini', device='meta', attn_drop_rate=0.1)
    # an explicitly requested backend that cannot run the call is an error, never a fallback
    model = tiny_models.nat(backend='cuda')
    with pytest.raises(attnzoo.BackendUnsupportedError):
        model(torch.randn(1, 3, 32, 32))


def test_in_chans_and_meta_dtype():
    check_in_chans_and_meta_dtype(tiny_models.nat(in_chans=1), torch.randn(1, 1, 40, 33),
                                  'nat_small')


# ----------------------------------------------------------------------------------------------
# timm contract
# ----------------------------------------------------------------------------------------------

def test_head_contract():
    model = tiny_models.nat()
    x = torch.randn(2, 3, 48, 40)
    with torch.no_grad():
        torch.testing.assert_close(model(x.contiguous(memory_format=torch.channels_last)),
                                   model(x))
    check_head_contract(model, x, (2, 2), [
        'stem.conv1.weight', 'stages.0.blocks.0.attn.qkv.weight',
        'stages.1.downsample.conv.weight', 'stages.1.blocks.0.norm1.weight', 'norm.weight'])
    with torch.no_grad():
        model.reset_classifier(0, 'catavgmax')
        assert model(x).shape == (2, 2 * model.num_features) == (2, model.head_hidden_size)
    assert {'stages.0.blocks.0.attn.rpb'} <= model.no_weight_decay()
    assert all(n.endswith('.rpb') for n in model.no_weight_decay())


def test_module_tree_follows_timm_layout():
    model = tiny_models.nat(layer_scale=1e-5)
    names = [n for n, _ in model.named_children()]
    assert names == ['stem', 'stages', 'norm', 'head']
    assert isinstance(model.stages[0].downsample, torch.nn.Identity)
    block = model.stages[1].blocks[0]
    assert [n for n, _ in block.named_children()] == [
        'norm1', 'attn', 'ls1', 'drop_path1', 'norm2', 'mlp', 'ls2', 'drop_path2']
    assert isinstance(model.head, timm.layers.ClassifierHead)
    assert [f['module'] for f in model.feature_info] == [f'stages.{i}' for i in range(4)]


def test_features_only_out_indices():
    # every feature_cls returning the same stage outputs: tests/test_model_policy.py
    model = timm.create_model('dinat_mini', features_only=True, out_indices=(1, 3)).eval()
    assert model.feature_info.channels() == [128, 512]
    assert model.feature_info.reduction() == [8, 32]
    with torch.no_grad():
        outs = model(torch.randn(2, 3, 64, 96))
    assert [tuple(o.shape) for o in outs] == [(2, 128, 8, 12), (2, 512, 2, 3)]
    full = timm.create_model('nat_mini', features_only=True, device='meta')
    assert full.feature_info.channels() == [64, 128, 256, 512]
    assert full.feature_info.reduction() == [4, 8, 16, 32]


def test_forward_intermediates_and_prune():
    model = tiny_models.nat()
    x = torch.randn(2, 3, 64, 48)
    check_forward_intermediates_and_prune(model, x, range(4))
    with torch.no_grad():
        pruned = copy.deepcopy(model)
        pruned.prune_intermediate_layers([3], prune_head=False)
        torch.testing.assert_close(pruned(x), model(x), rtol=0, atol=0)


def test_grad_checkpointing_same_output():
    check_grad_checkpointing(tiny_models.nat().train(), torch.randn(2, 3, 40, 40))  # no drop path


def test_torchscript_and_fx():
    fx = check_torchscript_and_fx(tiny_models.nat(), torch.randn(1, 3, 40, 56))
    # FX leaves: the shape-dependent helpers are calls in the graph, not traced through
    names = leaf_calls(fx)
    assert any('na2d_qkv_dispatch' in n for n in names)
    assert any('pad_to_window' in n for n in names)


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------

def _assert_same_state(a, b):
    assert list(a) == list(b) or set(a) == set(b)
    for k in b:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize('prefix', ['nat.', 'dinat.'])
def test_filter_transformers_layout_round_trip(prefix):
    model = tiny_models.nat(layer_scale=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # every value distinct: a swapped q/k/v or gamma would show
    sd = model.state_dict()
    hf = to_transformers_layout(sd, prefix)
    assert not any(k.startswith(('levels.', 'head.')) for k in hf)
    assert f'{prefix}encoder.levels.0.layers.0.layer_scale_parameters' in hf
    _assert_same_state(checkpoint_filter_fn(hf, model), sd)
    fresh = tiny_models.nat(layer_scale=0.5)
    fresh.load_state_dict(checkpoint_filter_fn(hf, fresh))
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_filter_official_layout_and_wrappers():
    model = tiny_models.nat(layer_scale=1e-5)
    sd = model.state_dict()
    official = nat_to_official(sd)
    assert any(k.startswith('levels.') for k in official) and 'head.weight' in official
    for wrapped in (sd, official, {'state_dict': official}, {'model': sd},
                    {'model': {'module.' + k: v for k, v in official.items()}},
                    {'module.' + k: v for k, v in sd.items()}):
        _assert_same_state(checkpoint_filter_fn(dict(wrapped), model), sd)


# The official variants' configs, as in SHI-Labs' classification/nat.py and dinat.py.
OFFICIAL_CONFIGS = {
    'nat_mini': dict(embed_dim=64, depths=(3, 4, 6, 5), num_heads=(2, 4, 8, 16), mlp_ratio=3.),
    'dinat_tiny': dict(embed_dim=64, depths=(3, 4, 18, 5), num_heads=(2, 4, 8, 16),
                       mlp_ratio=3.),
    'nat_base': dict(embed_dim=128, depths=(3, 4, 18, 5), num_heads=(4, 8, 16, 32),
                     mlp_ratio=2., layer_scale=True),
}


@pytest.mark.parametrize('name', sorted(OFFICIAL_CONFIGS))
def test_official_checkpoint_manifest_loads(name):
    """A checkpoint with exactly the official key names and shapes (written from the official
    code, tests/checkpoint_layouts.py) maps onto the model, raw, wrapped and in the transformers
    layout, and nothing is left over or missing."""
    manifest = nat_official_manifest(**OFFICIAL_CONFIGS[name])
    gen = torch.Generator().manual_seed(0)
    official = {k: torch.randn(shape, generator=gen) for k, shape in manifest.items()}
    model = _meta(name)
    converted = checkpoint_filter_fn({'state_dict': {'module.' + k: v for k, v in official.items()}},
                                     model)
    assert {k: tuple(v.shape) for k, v in converted.items()} == \
        {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # every official tensor lands somewhere, unchanged
    assert sorted(v.sum().item() for v in converted.values()) == \
        sorted(v.sum().item() for v in official.values())
    hf = checkpoint_filter_fn(nat_official_to_transformers(official, 'dinat.'), model)
    _assert_same_state(hf, converted)


def test_filter_reports_mismatches():
    model = tiny_models.nat()
    sd = model.state_dict()
    bad = dict(sd)
    bad['stages.0.blocks.0.attn.bogus'] = torch.zeros(1)
    del bad['stages.1.blocks.1.mlp.fc2.bias']
    bad['stages.2.blocks.0.attn.rpb'] = torch.zeros(2, 7, 7)
    with pytest.raises(ValueError) as info:
        checkpoint_filter_fn(bad, model)
    msg = str(info.value)
    for text in ('stages.0.blocks.0.attn.bogus', 'stages.1.blocks.1.mlp.fc2.bias',
                 'stages.2.blocks.0.attn.rpb: checkpoint (2, 7, 7) vs model (2, 5, 5)'):
        assert text in msg
    # a NAT checkpoint into a model with layer scale: gammas missing
    with pytest.raises(ValueError, match='ls1.gamma'):
        checkpoint_filter_fn(nat_to_official(sd), tiny_models.nat(layer_scale=1e-5))
    # transformers layout with a lost projection
    hf = to_transformers_layout(sd)
    del hf['nat.encoder.levels.0.layers.0.attention.self.key.weight']
    with pytest.raises(ValueError, match='key'):
        checkpoint_filter_fn(hf, model)
    # the classifier and the stem's input channels are left for timm to adapt
    sd5 = dict(sd, **{'head.fc.weight': torch.zeros(5, 128), 'head.fc.bias': torch.zeros(5)})
    sd5['stem.conv1.weight'] = torch.zeros(8, 1, 3, 3)
    checkpoint_filter_fn(sd5, model)


@pytest.fixture
def hf_cache(tmp_path):
    with offline_hf_cache(tmp_path / 'hub') as cache_dir:
        yield cache_dir


def test_pretrained_from_offline_hub_cache(hf_cache, tmp_path):
    torch.manual_seed(123)
    source = timm.create_model('nat_mini').eval()
    weights = tmp_path / 'pytorch_model.bin'
    torch.save(to_transformers_layout(source.state_dict()), weights)
    config = json.dumps({'model_type': 'nat', 'embed_dim': 64, 'depths': [3, 4, 6, 5]}).encode()
    write_hf_cache(hf_cache, 'shi-labs/nat-mini-in1k-224',
                   {'pytorch_model.bin': weights, 'config.json': config}, link=True)

    model = timm.create_model('nat_mini.in1k', pretrained=True).eval()
    x = torch.randn(2, 3, 64, 40)
    with torch.no_grad():
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)
    # as timm's test_model_load_pretrained / test_model_features_pretrained
    adapted = timm.create_model('nat_mini.in1k', pretrained=True, in_chans=1, num_classes=5)
    assert adapted(torch.randn(1, 1, 32, 32)).shape == (1, 5)
    torch.testing.assert_close(adapted.stages[2].blocks[0].attn.rpb,
                               source.stages[2].blocks[0].attn.rpb)
    feats = timm.create_model('nat_mini.in1k', pretrained=True, features_only=True).eval()
    with torch.no_grad():
        expected = source.forward_intermediates(x, intermediates_only=True)
        for a, b in zip(feats(x), expected):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_hub_cache_layout(tmp_path):
    snap = write_hf_cache(tmp_path, 'org/name', {'a/b.txt': b'x'}, commit='0' * 40)
    assert (tmp_path / 'models--org--name' / 'refs' / 'main').read_text() == '0' * 40
    assert (snap / 'a' / 'b.txt').read_bytes() == b'x'
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError
    with offline_hf_cache(tmp_path):
        assert hf_hub_download('org/name', 'a/b.txt') == str(snap / 'a' / 'b.txt')
        with pytest.raises(EntryNotFoundError):  # what timm catches for model.safetensors
            hf_hub_download('org/name', 'model.safetensors')
    import huggingface_hub.constants as constants
    assert constants.HF_HUB_CACHE != str(tmp_path)
