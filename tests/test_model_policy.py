"""The model policy (attnzoo/models/__init__.py), checked on the smallest model of every family:
a new family is held to it without writing these tests again."""
import re

import pytest
import timm
import torch

import attnzoo
from timm_suite.families import family, smallest_per_family

SMALLEST = sorted(smallest_per_family().values())
SPATIAL = [m for m in SMALLEST if not family(m).token_output]


def _input(model, batch=2):
    cfg = model.pretrained_cfg
    size = cfg["input_size"] if cfg.get("fixed_input_size") else (
        cfg.get("min_input_size") or (3, 64, 64))
    return torch.randn(batch, *size)


@pytest.mark.parametrize("name", SPATIAL)
def test_module_tree_in_timm_layout(name):
    model = timm.create_model(name, device="meta")
    children = [n for n, _ in model.named_children()]
    assert children[0] == "stem" and children[1] == "stages" and children[-1] == "head", children
    assert "norm" in children
    assert isinstance(model.head, (timm.layers.ClassifierHead, timm.layers.NormMlpClassifierHead))
    assert model.get_classifier() is model.head.fc
    assert [f["module"] for f in model.feature_info] == [
        f"stages.{i}" for i in range(len(model.stages))]
    assert model.pretrained_cfg["first_conv"].startswith("stem.")
    assert model.pretrained_cfg["classifier"] == "head.fc"
    assert model.output_fmt == "NCHW"


@pytest.mark.parametrize("name", SMALLEST)
def test_every_feature_cls_returns_the_stage_outputs(name, tmp_path):
    """Every feature_cls gives forward_intermediates' maps; a token model (whose blocks output
    token sequences, not maps) takes the getter only and says so for the others."""
    torch.manual_seed(0)
    source = timm.create_model(name).eval()
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    x = _input(source)
    taps = ("hook", "fx", "dict")
    if family(name).token_output:
        for feature_cls in taps:
            with pytest.raises(ValueError, match=f"'getter'.*got feature_cls='{feature_cls}'"):
                timm.create_model(name, features_only=True, feature_cls=feature_cls)
        taps = ()
    for feature_cls in (None, "getter") + taps:
        kwargs = {} if feature_cls is None else dict(feature_cls=feature_cls)
        model = timm.create_model(name, features_only=True, pretrained=True,
                                  pretrained_cfg_overlay=dict(file=str(path)), **kwargs).eval()
        with torch.no_grad():
            expected = source.forward_intermediates(
                x, indices=list(model.feature_info.out_indices), intermediates_only=True)
            outs = model(x)
        if feature_cls == "dict":  # {layer name: map}, in feature_info order
            outs = list(outs.values())
        assert len(outs) == len(expected), feature_cls
        for o, e, chs, red in zip(outs, expected, model.feature_info.channels(),
                                  model.feature_info.reduction()):
            assert o.shape == e.shape and o.shape[1] == chs, feature_cls
            assert o.shape[-1] == -(-x.shape[-1] // red), (feature_cls, red)
            torch.testing.assert_close(o, e, rtol=0, atol=0)


@pytest.mark.parametrize("name", SMALLEST)
def test_a_file_trained_on_the_classes_asked_for_keeps_its_head(name, tmp_path):
    """timm drops a checkpoint's classifier when num_classes differs from the tag's 1000: a
    train.py checkpoint of 4 classes, or a safetensors file of them, loads whole; ImageNet's
    1000-class head is left out for 4 classes (fine-tuning), the rest loaded."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    trained = timm.create_model(name, num_classes=4).eval()
    x = _input(trained)
    files = [tmp_path / "last.pth.tar", tmp_path / "model.safetensors"]
    torch.save({"epoch": 3, "arch": name, "state_dict": trained.state_dict()}, files[0])
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, files[1])
    for path in files:
        loaded = timm.create_model(name, pretrained=True, num_classes=4,
                                   pretrained_cfg_overlay=dict(file=str(path))).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), trained(x), rtol=0, atol=0)
    imagenet = timm.create_model(name).eval()
    torch.save(imagenet.state_dict(), tmp_path / "in1k.pth")
    tuned = timm.create_model(name, pretrained=True, num_classes=4,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / "in1k.pth")))
    assert tuned.get_classifier().weight.shape[0] == 4
    body = {k: v for k, v in imagenet.state_dict().items() if not k.startswith("head")}
    assert all(torch.equal(tuned.state_dict()[k], v) for k, v in body.items())


@pytest.mark.parametrize("name", SMALLEST)
def test_torch_fx_traces_the_model_as_timm_s_tracer_does(name):
    """Plain ``torch.fx.symbolic_trace`` (docs/models.md lists torch.fx), not only timm's tracer,
    which honours register_notrace_function: the checks and dispatches are leaves for both."""
    model = timm.create_model(name).eval()
    traced = torch.fx.symbolic_trace(model)
    x = _input(model)
    with torch.no_grad():
        torch.testing.assert_close(traced(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", SMALLEST)
def test_pretrained_tags_are_honest(name):
    """A tag loads downloadable weights or says how to get the official ones (or, where none
    exist, how to initialise from standard ones): never random."""
    for tag in timm.list_models(name, include_tags=True):
        cfg = timm.get_pretrained_cfg(tag)
        if cfg.hf_hub_id or cfg.url or cfg.file:
            continue
        with pytest.raises(ValueError, match="attnzoo convert|from_timm_weights"):
            timm.create_model(tag, pretrained=True, device="meta")
    # an unknown tag is timm's error, not a complaint about the default tag's weights
    with pytest.raises(RuntimeError, match=f"Invalid pretrained tag \\(bogus\\) for {name}"):
        timm.create_model(f"{name}.bogus", pretrained=True, device="meta")


@pytest.mark.parametrize("name", SMALLEST)
def test_bad_input_is_a_clear_error(name):
    model = timm.create_model(name).eval()
    x = _input(model, batch=1)
    with pytest.raises(ValueError, match="channels|in_chans"):
        model(x[:, :1])
    with pytest.raises(TypeError):
        timm.create_model(name, device="meta", not_a_model_arg=1)


@pytest.mark.parametrize("name", SMALLEST)
def test_bad_constructor_arguments_are_named_when_the_model_is_built(name):
    """in_chans and the drop rates are checked by the constructor, each error naming its
    argument (0 channels built a model silently, or divided by zero in QnA-ViT's stem; a drop
    path rate of 2 failed in the first training forward's bernoulli_)."""
    for kwargs, error, message in [
            (dict(in_chans=0), ValueError, "in_chans must be >= 1"),
            (dict(in_chans="3"), TypeError, "in_chans must be an int, got str '3'"),
            (dict(drop_path_rate=2.0), ValueError, "drop_path_rate must be in [0, 1), got 2.0"),
            (dict(drop_rate=-0.1), ValueError, "drop_rate must be in [0, 1), got -0.1"),
            (dict(drop_rate="0.1"), TypeError, "drop_rate must be a number")]:
        with pytest.raises(error) as info:
            timm.create_model(name, device="meta", **kwargs)
        assert str(info.value).startswith(f"{name}: {message}"), info.value
    timm.create_model(name, device="meta", in_chans=1, drop_rate=0.5, drop_path_rate=0.)


@pytest.mark.parametrize("name", SMALLEST)
def test_bad_feature_indices_are_named_with_the_range_accepted(name):
    """out_indices (features_only) and forward_intermediates' / prune_intermediate_layers'
    indices out of range or of another type: one error naming the argument and the range (timm
    gave a list IndexError, or an assertion with the index converted)."""
    n = len(timm.create_model(name, device="meta").feature_info)
    for indices, error in [((n,), ValueError), ((-n - 1,), ValueError), (n + 1, ValueError),
                           (0, ValueError), ((), ValueError), ("1", TypeError),
                           ((1.5,), TypeError), ((True,), TypeError)]:
        with pytest.raises(error, match=rf"^out_indices={re.escape(repr(indices))}: accepted: "
                                        rf"None \(all\), an int from 1 to {n} "):
            timm.create_model(name, device="meta", features_only=True, out_indices=indices)
    timm.create_model(name, device="meta", features_only=True, out_indices=(-n, n - 1))
    if family(name).token_output:
        return  # timm's ViT: forward_intermediates is timm's own
    model = timm.create_model(name).eval()
    with pytest.raises(ValueError, match=rf"^indices=\[{n}\]: accepted: "):
        model.forward_intermediates(_input(model, batch=1), indices=[n])
    with pytest.raises(ValueError, match=rf"^indices={n + 1}: accepted: "):
        model.prune_intermediate_layers(n + 1)


@pytest.mark.parametrize("name", SMALLEST)
def test_feature_indices_take_numpy_ints_and_out_indices_come_in_order(name):
    """timm's models take NumPy integers as indices; out_indices naming a stage twice or out of
    order is refused (a features model returned each stage once, in the model's order, while
    its feature_info listed them as given: an FPN built from it got other channels)."""
    import numpy as np
    n = len(timm.create_model(name, device="meta").feature_info)
    model = timm.create_model(name, device="meta", features_only=True,
                              out_indices=np.array([n - 2, n - 1]))
    assert len(model.feature_info.channels()) == 2
    timm.create_model(name, device="meta", features_only=True, out_indices=[np.int64(n - 1)])
    model = timm.create_model(name, device="meta", features_only=True, out_indices=np.int64(2))
    assert len(model.feature_info.channels()) == 2  # (a NumPy int is "the last n" too)
    for indices in ((n - 1, n - 2), (n - 1, n - 1), (n - 1, -1)):
        with pytest.raises(ValueError, match=rf"^out_indices={re.escape(repr(indices))}: name "
                                             rf"distinct (stages|blocks) in increasing order"):
            timm.create_model(name, device="meta", features_only=True, out_indices=indices)
    if family(name).token_output:
        return  # timm's ViT: forward_intermediates is timm's own
    model = timm.create_model(name).eval()
    x = _input(model, batch=1)
    with torch.no_grad():
        assert len(model.forward_intermediates(x, indices=[np.int64(n - 1)],
                                               intermediates_only=True)) == 1
        assert len(model.forward_intermediates(x, indices=np.int64(2),
                                               intermediates_only=True)) == 2
        with pytest.raises(ValueError, match="^output_fmt must be 'NCHW' or 'NHWC', got 'NLC'"):
            model.forward_intermediates(x, output_fmt='NLC')


@pytest.mark.parametrize("name", [n for n in SMALLEST if not family(n).token_output])
@pytest.mark.parametrize("feature_cls", [None, "hook", "dict", "fx", "getter"])
def test_a_features_model_checks_its_input_as_the_model_does(name, feature_cls):
    """Every feature_cls runs the stem first, which checks the images: wrong channels, a
    missing batch dimension, too small (timm's 'list', 'hook' and 'dict' wrappers call the
    modules, not the model's forward: they had given torch's conv or layout errors, and SAN's
    op an error about an inner map); and a SAN's minimum is that of the stages it runs, for
    every feature_cls alike ('fx' had kept the whole model's)."""
    kwargs = {} if feature_cls is None else dict(feature_cls=feature_cls)
    full = timm.create_model(name)
    model = timm.create_model(name, features_only=True, **kwargs).eval()
    x = _input(full, batch=1)
    with pytest.raises(ValueError, match="^the model was built with in_chans=3 but the input"):
        model(x[:, :1])
    with pytest.raises(ValueError, match="^expected a 4-D NCHW image batch"):
        model(x[0])
    if full.min_size > 1:  # SAN
        small = x[..., :full.min_size - 1, :full.min_size - 1]
        with pytest.raises(ValueError, match=f"^input images must be at least "
                                             f"{full.min_size}x{full.min_size} pixels"):
            model(small)
        early = timm.create_model(name, features_only=True, out_indices=(0, 1, 2),
                                  **kwargs).eval()
        full.prune_intermediate_layers((0, 1, 2))
        assert full.min_size < small.shape[-1]
        with torch.no_grad():
            outs = early(small)
            outs = list(outs.values()) if isinstance(outs, dict) else outs
            want = full.forward_intermediates(small, indices=(0, 1, 2), intermediates_only=True)
        assert [o.shape for o in outs] == [w.shape for w in want]


def test_every_spelling_of_a_feature_cls_checks_the_minimum_of_its_stages():
    """timm reads any name holding 'hook' as its hook wrapper, and takes its classes as they
    are: each is the wrapper that tells a SAN which stages it runs (its minimum input)."""
    from timm.models._features import FeatureHookNet, FeatureListNet
    full = timm.create_model("san10_pairwise", device="meta").min_size
    for feature_cls in ("hooks", "FeatureHookNet", "LIST", FeatureListNet, FeatureHookNet):
        model = timm.create_model("san10_pairwise", device="meta", features_only=True,
                                  out_indices=(0, 1, 2), feature_cls=feature_cls)
        assert model.stem.min_size < full, feature_cls


@pytest.mark.parametrize("name", SMALLEST)
def test_an_empty_batch_gives_empty_outputs_forward_and_backward(name):
    """As timm's ResNet and ViT do: batch 0 in, batch 0 out (logits and unpooled features of
    batch 1's shapes), and a backward pass with gradients of the input's shape."""
    model = timm.create_model(name)
    x = _input(model, batch=0).requires_grad_()
    with torch.no_grad():
        features = model.forward_features(_input(model, batch=1))
    assert model.forward_features(x).shape == (0, *features.shape[1:])
    out = model(x)
    assert out.shape == (0, model.num_classes)
    out.sum().backward()
    assert x.grad.shape == x.shape and not x.grad.any()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("name", SMALLEST)
def test_attn_drop_rate_is_taken_or_refused_in_one_line(name):
    """timm's ``attn_drop_rate``: a family whose attention can drop its weights (QUEST-ViT,
    timm's ViT) takes it; the others refuse any rate but 0 with one ValueError naming the
    argument, as NAT did alone (QnA-ViT and SAN said ``unexpected keyword``)."""
    timm.create_model(name, device="meta", attn_drop_rate=0.)
    if family(name).token_output:  # timm's ViT: its attention's dropout takes the rate
        model = timm.create_model(name, device="meta", attn_drop_rate=0.1)
        assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)
                and m is getattr(getattr(model.blocks[0], "attn", None), "attn_drop", None)} \
            == {0.1}
        return
    with pytest.raises(ValueError) as info:
        timm.create_model(name, device="meta", attn_drop_rate=0.1)
    message = str(info.value)
    assert message.startswith("attn_drop_rate=0.1: ") and "\n" not in message
    assert "no attention-weight dropout" in message and "drop_path_rate" in message


def test_the_layers_name_bad_sizes_and_inputs():
    """A zero, negative or bool size is named when a layer is built (it divided by zero, or
    built a layer that failed at its first forward); an input that is not its channels-last
    map is named at the forward (a matmul's shape error before)."""
    from attnzoo.layers import LocalSelfAttention, NeighborhoodAttention2d, QnA
    for make, message in (
            (lambda: NeighborhoodAttention2d(32, 0), "NeighborhoodAttention2d: num_heads must be "
                                                     ">= 1, got 0"),
            (lambda: NeighborhoodAttention2d(0, 4), "dim must be >= 1, got 0"),
            (lambda: QnA(32, num_heads=-4), "QnA: num_heads must be >= 1, got -4"),
            (lambda: QnA(32, num_queries=0), "QnA: num_queries must be >= 1, got 0"),
            (lambda: LocalSelfAttention(32, 0), "LocalSelfAttention: num_heads must be >= 1"),
            (lambda: NeighborhoodAttention2d(32, 4, True), "kernel_size must be an odd int >= 1, "
                                                           "got True")):
        with pytest.raises(ValueError, match=re.escape(message)):
            make()
    with pytest.raises(TypeError, match=re.escape("QnA: dim must be an int, got float 32.0")):
        QnA(32.0)
    for layer in (NeighborhoodAttention2d(32, 4), QnA(32), LocalSelfAttention(32, 4)):
        name = type(layer).__name__
        for x in (torch.randn(1, 32, 8, 8), torch.randn(1, 8, 8, 16), torch.randn(1, 64, 32)):
            with pytest.raises(ValueError, match=re.escape(
                    f"{name}: the input must be a channels-last map [B, H, W, 32] (NHWC), got "
                    f"shape {tuple(x.shape)}")):
                layer(x)
        assert layer(torch.randn(1, 8, 8, 32)).shape[-1] == 32
