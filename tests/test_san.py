"""SAN: configs and costs, input sizes, the backend switch, timm's model contract, official
checkpoints (the model-level oracle is tests/test_san_oracle.py). Big models are built on
'meta'; numerical tests use tiny configs."""
import copy
import functools

import pytest
import timm
import torch
import torch.nn as nn

import attnzoo
from attnzoo import backends
from attnzoo.layers import SAM
from attnzoo.models.san import SAN, checkpoint_filter_fn
from attnzoo.profiling import count_macs, count_params
from checkpoint_layouts import san_official_manifest, san_to_official, san_training_checkpoint
from model_checks import (check_autocast, check_bad_input_and_arguments,
                          check_compile_fullgraph, check_forward_intermediates_and_prune,
                          check_grad_checkpointing, check_head_contract, check_torchscript_and_fx)
from tiny_models import SAN_SMALL, randomize, san, san_small

VARIANTS = [f'san{n}_{t}' for n in (10, 15, 19) for t in ('pairwise', 'patchwise')]
DEPTHS = {10: (2, 1, 2, 4, 1), 15: (3, 2, 3, 5, 2), 19: (3, 3, 4, 6, 3)}

# The spec's table (official counter, 224 px): params, GMACs.
SPEC = {
    'san10_pairwise': (10_531_848, 2.16), 'san10_patchwise': (11_841_124, 1.87),
    'san15_pairwise': (14_065_436, 3.02), 'san15_patchwise': (16_181_310, 2.58),
    'san19_pairwise': (17_596_156, 3.84), 'san19_patchwise': (20_518_470, 3.26),
}


@functools.lru_cache(maxsize=None)
def _meta(name, **kwargs):
    """Registered model on the meta device; shared, do not mutate."""
    return timm.create_model(name, device='meta', **kwargs).eval()


# ----------------------------------------------------------------------------------------------
# configs and costs
# ----------------------------------------------------------------------------------------------

def test_every_variant_is_registered():
    assert attnzoo.list_models(family='san') == sorted(VARIANTS)
    assert set(timm.list_models(module='san')) == set(VARIANTS)


@pytest.mark.parametrize('name', VARIANTS)
def test_param_counts_equal_spec(name):
    assert count_params(_meta(name)) == SPEC[name][0]


def test_relation_and_footprint_param_counts_match_paper():
    """Table 4 (relation functions) and Table 7 (footprints) of the paper, SAN10, in M with
    their one decimal: the relation functions are built with the paper's dimensions."""
    table4 = {('pairwise', 'summation'): 10.5, ('pairwise', 'subtraction'): 10.5,
              ('pairwise', 'concatenation'): 10.6, ('pairwise', 'hadamard_product'): 10.5,
              ('pairwise', 'dot_product'): 10.5, ('patchwise', 'star_product'): 10.9,
              ('patchwise', 'clique_product'): 11.5, ('patchwise', 'concatenation'): 11.8}
    for (sa_type, relation), params in table4.items():
        model = _meta(f'san10_{sa_type}', relation=relation)
        assert round(count_params(model) / 1e6, 1) == params, relation
    table7 = {3: (10.5, 10.7), 5: (10.5, 11.2), 7: (10.5, 11.8), 9: (10.5, 12.7),
              11: (10.5, 13.8)}
    for k, params in table7.items():
        got = [round(count_params(_meta(f'san10_{t}', kernel_sizes=(3, k, k, k, k))) / 1e6, 1)
               for t in ('pairwise', 'patchwise')]
        assert tuple(got) == params, k


def official_counter(model, size=224):
    """SAN's official counter (util/complexity.py, from ptflops) rule by rule, batch 1: a conv
    k*k*Cin*Cout per output pixel plus 1 per output element for its bias, BN 2 per element,
    ReLU 1 per element, max / average pooling 1 per input element, Linear in*out; in each SAM
    its Subtraction2 / Subtraction modules 1 per output element ([rel, kk, L] and the position
    encoding's [2, kk, L]), Aggregation kk per output element; the softmax nothing."""
    total = [0]

    def add(n):
        total[0] += int(n)

    def conv(m, i, o):
        add(o.numel() * m.in_channels * m.kernel_size[0] * m.kernel_size[1])
        add(o.numel() if m.bias is not None else 0)

    def sam(m, i, o):
        kk, L = m.kernel_size ** 2, o.shape[2] * o.shape[3]
        add(o.shape[1] * L * kk)  # aggregation
        if m.sa_type == 'pairwise':
            add((m.conv1.out_channels + 2) * kk * L)  # subtraction2 and the position's

    rules = {nn.Conv2d: conv, SAM: sam,
             nn.BatchNorm2d: lambda m, i, o: add(2 * i[0].numel()),
             nn.ReLU: lambda m, i, o: add(o.numel()),
             nn.MaxPool2d: lambda m, i, o: add(i[0].numel()),
             nn.AdaptiveAvgPool2d: lambda m, i, o: add(i[0].numel()),
             nn.Linear: lambda m, i, o: add(m.in_features * m.out_features)}
    hooks = [m.register_forward_hook(fn) for m in model.modules()
             for cls, fn in rules.items() if isinstance(m, cls)]
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, size, size, device='meta'))
    finally:
        for h in hooks:
            h.remove()
    return total[0]


@pytest.mark.parametrize('name', VARIANTS)
def test_gmacs_against_spec_table(name):
    """count_macs (fvcore's convention: conv and matmul multiply-adds, the SAN ops by their
    registered formulas) is within 5% of the paper's table (measured 3.9-4.9% below); the
    official counter also counts conv biases, BN, ReLU and pooling element by element. Those
    terms added, the table is reproduced to its two decimals."""
    model = _meta(name)
    macs = count_macs(model, (1, 3, 224, 224))
    table = SPEC[name][1]
    assert abs(macs / 1e9 - table) / table < 0.05
    assert round(official_counter(model) / 1e9, 2) == table


# ----------------------------------------------------------------------------------------------
# input sizes, errors
# ----------------------------------------------------------------------------------------------

def test_input_size_minimum():
    """Reflection by 3 in the last stage (7x7) needs its map >= 4 px: H // 32 >= 4."""
    model = san(depths=(1,) * 5)
    for size in ((96, 96), (127, 200), (200, 127)):
        # the message says what lowers the minimum, and to what
        with pytest.raises(ValueError, match=r'at least 128x128 pixels.*got '
                                             rf"{size[0]}x{size[1]}; padding_mode='zeros'.*"
                                             r'lowers it to 32 px'):
            model(torch.randn(1, 3, *size))
    with torch.no_grad():
        for size in ((128, 144), (161, 131)):
            out, inter = model.forward_intermediates(torch.randn(1, 3, *size))
            assert out.shape == (1, 64, size[0] // 32, size[1] // 32)
            assert [t.shape[-2:] for t in inter] == [
                (size[0] >> (i + 1), size[1] >> (i + 1)) for i in range(5)]
    assert all(timm.get_pretrained_cfg(n).min_input_size == (3, 128, 128) for n in VARIANTS)
    assert _meta('san19_patchwise').min_size == 128
    # zero padding has no such limit: 32 px (one pixel in the last stage)
    zeros = san(padding_mode='zeros', depths=(1,) * 5)
    assert zeros.min_size == 32 and zeros(torch.randn(1, 3, 32, 40)).shape == (1, 7)
    with pytest.raises(ValueError, match=r'at least 32x32 pixels.*got 31x40$'):
        zeros(torch.randn(1, 3, 31, 40))


def test_errors():
    check_bad_input_and_arguments(san(), 'san10_pairwise', 128)
    with pytest.raises(ValueError, match='not a pairwise relation.*dot_product'):
        timm.create_model('san10_pairwise', device='meta', relation='star_product')
    with pytest.raises(ValueError, match="sa_type"):
        SAN(sa_type='global', device='meta')
    with pytest.raises(ValueError, match='padding_mode'):
        SAN(padding_mode='circular', device='meta')
    with pytest.raises(ValueError, match='share_planes'):
        SAM(16, 4, 8, share_planes=3)
    with pytest.raises(ValueError, match='odd'):
        SAM(16, 4, 8, kernel_size=4)


def test_backends_through_the_model(monkeypatch):
    """Every SAM runs its ops through the backend switch; an explicit backend that cannot run
    them is an error, never a silent fallback."""
    calls = []
    for op in ('san_aggregation', 'san_subtraction', 'san_subtraction2'):
        spec = backends._OPS[op]
        impl = spec.backends['torch'].impl
        spied = dict(spec.backends, torch=backends.Backend(
            lambda *a, op=op, impl=impl: calls.append(op) or impl(*a)))
        monkeypatch.setitem(backends._OPS, op, spec._replace(backends=spied))
    model = san_small()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad(), attnzoo.use_backend('torch'):
        model(x)
    blocks = sum(SAN_SMALL['depths'])
    assert sorted(set(calls)) == ['san_aggregation', 'san_subtraction', 'san_subtraction2']
    assert len(calls) == 3 * blocks
    calls.clear()
    with torch.no_grad():
        san_small('patchwise')(x)
    assert calls == ['san_aggregation'] * blocks  # the patchwise gather is not an op
    # cuda: attnzoo's Triton kernels refuse CPU tensors outside Triton's interpreter
    for backend, reason in (('natten', 'NATTEN has no'), ('cuda', 'Triton')):
        with pytest.raises(attnzoo.BackendUnsupportedError, match=reason):
            san_small(backend=backend)(x)
        with attnzoo.use_backend(backend), pytest.raises(attnzoo.BackendUnsupportedError):
            model(x)


# ----------------------------------------------------------------------------------------------
# timm contract
# ----------------------------------------------------------------------------------------------

def test_module_tree_follows_timm_layout():
    model = san()
    assert [n for n, _ in model.named_children()] == ['stem', 'stages', 'norm', 'head']
    assert [n for n, _ in model.stages[1].named_children()] == ['downsample', 'blocks']
    assert isinstance(model.stages[0].downsample.norm, nn.Identity)  # the stem has BN + ReLU
    assert isinstance(model.stages[1].downsample.norm, nn.BatchNorm2d)
    block = model.stages[1].blocks[0]
    assert [n for n, _ in block.named_children()] == ['norm1', 'attn', 'norm2', 'conv',
                                                      'drop_path']
    assert isinstance(block.attn, SAM) and isinstance(model.head, timm.layers.ClassifierHead)
    assert [f['module'] for f in model.feature_info] == [f'stages.{i}' for i in range(5)]
    assert [f['reduction'] for f in model.feature_info] == [2, 4, 8, 16, 32]
    assert model.no_weight_decay() == set()


def test_head_contract():
    check_head_contract(san_small(), torch.randn(2, 3, 64, 96), (2, 3), [  # official: avg pool
        'stem.conv.weight', 'stages.0.blocks.0.attn.conv1.weight',
        'stages.1.downsample.norm.weight', 'stages.1.blocks.0.norm1.weight', 'norm.weight'])


@pytest.mark.parametrize('feature_cls', [None, 'getter', 'hook', 'fx'])
def test_features_only_every_feature_cls(feature_cls, tmp_path):
    """Every timm feature extractor returns the same NCHW taps, each stage's output."""
    kwargs = {} if feature_cls is None else dict(feature_cls=feature_cls)
    source = san_small()
    torch.save(source.state_dict(), tmp_path / 'weights.pth')
    model = timm.create_model('san10_pairwise', features_only=True, pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / 'weights.pth')),
                              **SAN_SMALL, **kwargs).eval()
    assert model.feature_info.channels() == [16, 32, 32, 64, 64]
    assert model.feature_info.reduction() == [2, 4, 8, 16, 32]
    x = torch.randn(1, 3, 64, 72)
    with torch.no_grad():
        outs = model(x)
        expected = source.forward_intermediates(x, intermediates_only=True)
    assert [tuple(o.shape[-2:]) for o in outs] == [(32, 36), (16, 18), (8, 9), (4, 4), (2, 2)]
    for o, e in zip(outs, expected):
        torch.testing.assert_close(o, e, rtol=0, atol=0)
    assert timm.create_model('san15_patchwise', features_only=True, out_indices=(2, 4),
                             device='meta').feature_info.channels() == [512, 2048]


def test_forward_intermediates_and_prune():
    model = san_small()
    x = torch.randn(1, 3, 64, 64)
    check_forward_intermediates_and_prune(model, x, [1])
    pruned = copy.deepcopy(model)
    pruned.prune_intermediate_layers([1], prune_norm=True)
    pruned.reset_classifier(0, 'avg')
    with torch.no_grad():  # pruned to stage 1 (3x3 at reduction 4), inputs from 8 px work
        assert pruned.min_size == 8 and pruned(torch.randn(1, 3, 8, 10)).shape == (1, 32)


def test_grad_checkpointing_same_output():
    check_grad_checkpointing(san(kernel_sizes=3).train(), torch.randn(2, 3, 64, 64))


@pytest.mark.parametrize('sa_type', ['pairwise', 'patchwise'])
def test_torchscript_and_fx(sa_type):
    fx = check_torchscript_and_fx(san_small(sa_type), torch.randn(1, 3, 64, 72))
    # every SAN op is a leaf of the graph (its argument checks depend on shapes)
    ops = {n.args[0] for n in fx.graph.nodes
           if n.op == 'call_function' and getattr(n.target, '__name__', '') == 'sa_op'}
    assert ops == ({'subtraction', 'subtraction2', 'aggregation'} if sa_type == 'pairwise'
                   else {'neighbours', 'aggregation'})


@pytest.mark.floor
def test_torch_compile_fullgraph_forward_backward():
    # pairwise: its path holds every kind of op the patchwise one has
    check_compile_fullgraph(san_small().train(), torch.randn(1, 3, 64, 72))


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_autocast_channels_last_meta(dtype):
    model = san_small()
    x = torch.randn(2, 3, 64, 64)
    ref = check_autocast(model, x, dtype)
    with torch.no_grad():
        torch.testing.assert_close(model(x.contiguous(memory_format=torch.channels_last)), ref,
                                   rtol=1e-5, atol=1e-5)
        cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
        torch.testing.assert_close(cl(x), ref, rtol=1e-5, atol=1e-5)
    meta = timm.create_model('san10_patchwise', device='meta', dtype=dtype)
    assert all(p.device.type == 'meta' and p.dtype == dtype for p in meta.parameters())
    assert meta(torch.randn(1, 3, 128, 128, device='meta', dtype=dtype)).shape == (1, 1000)


# ----------------------------------------------------------------------------------------------
# official checkpoints and the pretrained policy
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize('name', VARIANTS)
def test_official_manifest_maps_onto_model(name):
    """A checkpoint with exactly the official keys and shapes (written from the official code,
    tests/checkpoint_layouts.py), in tool/train.py's wrapper, maps onto the model with nothing
    missing or left over."""
    n, sa_type = name[3:5], name.split('_')[1]
    manifest = san_official_manifest(DEPTHS[int(n)], sa_type)
    gen = torch.Generator().manual_seed(0)
    official = {k: torch.randn(shape, generator=gen) if shape else torch.tensor(7)
                for k, shape in manifest.items()}
    model = _meta(name)
    converted = checkpoint_filter_fn(san_training_checkpoint(official), model)
    assert {k: tuple(v.shape) for k, v in converted.items()} == \
        {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert sorted(v.sum().item() for v in converted.values()) == \
        sorted(v.sum().item() for v in official.values())  # every tensor lands, unchanged


def test_official_training_checkpoint_loads_and_reproduces(tmp_path):
    """Our model's weights written in the official training layout (spec key names, module.
    prefix, the state_dict wrapper) load with pretrained=True and a file overlay, and through
    attnzoo.convert, and give exactly the same outputs."""
    torch.manual_seed(1)
    source = randomize(timm.create_model('san10_pairwise')).eval()
    path = tmp_path / 'model_best.pth'
    torch.save(san_training_checkpoint(san_to_official(source.state_dict())), path)
    model = timm.create_model('san10_pairwise', pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(path))).eval()
    x = torch.randn(1, 3, 128, 144)
    with torch.no_grad():
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)
    from attnzoo.hub import load_official
    converted = load_official('san10_pairwise', path)
    assert set(converted) == set(source.state_dict())
    assert all(torch.equal(converted[k], v) for k, v in source.state_dict().items())
    # as timm's pretrained tests: other classes and input channels adapt
    adapted = timm.create_model('san10_pairwise', pretrained=True, in_chans=1, num_classes=5,
                                pretrained_cfg_overlay=dict(file=str(path)))
    assert adapted.head.fc.out_features == 5 and adapted.stem.conv.in_channels == 1


def test_filter_reports_mismatches(tmp_path):
    pairwise = san_to_official(san('pairwise').state_dict())
    with pytest.raises(ValueError, match=r'(?s)not in the model.*conv_p.*shape mismatch.*conv_w'):
        checkpoint_filter_fn({'state_dict': pairwise}, san('patchwise'))
    sd = dict(san().state_dict())
    del sd['stages.2.blocks.0.attn.conv3.bias']
    with pytest.raises(ValueError, match=r'(?s)missing.*stages\.2\.blocks\.0\.attn\.conv3\.bias'):
        checkpoint_filter_fn(sd, san())
    torch.save({'state_dict': pairwise}, tmp_path / 'bad.pth')
    from attnzoo.hub import load_official
    with pytest.raises(ValueError, match='san10_patchwise|SAN'):
        load_official('san10_patchwise', tmp_path / 'bad.pth')


def test_pretrained_cfgs_are_honest():
    """The official weights are not on the Hub yet: the tags are not pretrained to timm, and
    pretrained=True says so in one line, with the authors' link and the convert path."""
    for name in VARIANTS:
        cfg = timm.get_pretrained_cfg(f'{name}.in1k')
        assert not (cfg.hf_hub_id or cfg.url or cfg.file)
        assert cfg.origin_url == 'https://github.com/hszhao/SAN'
        assert cfg.paper_ids == 'arXiv:2004.13621'
        assert cfg.interpolation == 'bilinear' and cfg.crop_pct == 0.875
    assert attnzoo.list_models('san*', pretrained=True) == []
    assert not any(timm.is_model_pretrained(name) for name in VARIANTS)
    with pytest.raises(ValueError, match=r'(?s)^san10_pairwise.in1k: its weights are not on the '
                                         r'Hugging Face Hub yet.*github.com/hszhao/SAN.*'
                                         r'attnzoo convert san10_pairwise.*pretrained_cfg_overlay'):
        timm.create_model('san10_pairwise', pretrained=True)
