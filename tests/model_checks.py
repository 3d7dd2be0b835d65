"""Checks each staged family runs on a small model of its own: the assertions, written once."""
import contextlib
import copy

import pytest
import timm
import torch
from timm.layers import get_notrace_functions, get_notrace_modules
from timm.models._manipulate import group_parameters

import attnzoo


def check_grad_checkpointing(model: torch.nn.Module, x: torch.Tensor) -> None:
    """Checkpointed blocks give the same output and parameter gradients (``model`` in train
    mode and deterministic: no drop path)."""
    out = model(x)
    out.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_grad_checkpointing(True)
    out2 = model(x)
    out2.square().mean().backward()
    torch.testing.assert_close(out2, out)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g)


def check_torchscript_and_fx(model: torch.nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    """The scripted model matches eager and still reads the backend switch at run time; an FX
    trace as timm's test_model_forward_fx makes matches too. Returns the traced module, for the
    family's own checks on its leaves."""
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    with torch.no_grad():
        ref = model(x)
        scripted = torch.jit.script(model)
        torch.testing.assert_close(scripted(x), ref)
        with attnzoo.use_backend('cuda'), pytest.raises(Exception, match='cuda'):
            scripted(x)
        kw = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
                  param_shapes_constant=True)
        train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=kw)
        fx = create_feature_extractor(model, train_return_nodes=[train_nodes[-1]],
                                      eval_return_nodes=[eval_nodes[-1]], tracer_kwargs=kw)
        torch.testing.assert_close(next(iter(fx(x).values())), ref)
    return fx


def leaf_calls(fx: torch.fx.GraphModule):
    """The functions an FX graph calls (its leaves among them), as names."""
    return {str(n.target) for n in fx.graph.nodes if n.op == 'call_function'}


def check_compile_fullgraph(model: torch.nn.Module, x: torch.Tensor) -> None:
    """One graph, forward and backward (aot_eager: Dynamo capture and AOT autograd without a
    compiler run), with eager's output and parameter gradients."""
    out_ref = model(x)
    grads_ref = torch.autograd.grad(out_ref.square().sum(), list(model.parameters()))
    out = torch.compile(model, backend='aot_eager', fullgraph=True)(x)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


def check_autocast(model: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Under CPU autocast to ``dtype`` the output is in ``dtype``, finite and close to float32's
    (``model`` in eval mode); returns the float32 output."""
    with torch.no_grad():
        ref = model(x)
        with torch.autocast('cpu', dtype=dtype):
            out = model(x)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)
    return ref


def check_bad_input_and_arguments(model: torch.nn.Module, name: str, size: int) -> None:
    """``model`` (3 input channels, taking ``size`` px images) refuses one channel and a 3-D
    input with clear messages; registered ``name`` refuses an unknown argument and an unknown
    backend when built."""
    with pytest.raises(ValueError, match='in_chans=3.*1 channels'):
        model(torch.randn(1, 1, size, size))
    with pytest.raises(ValueError, match='4-D'):
        model(torch.randn(3, size, size))
    with pytest.raises(TypeError):
        timm.create_model(name, device='meta', not_a_model_arg=1)
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        timm.create_model(name, device='meta', backend='bogus')


def check_in_chans_and_meta_dtype(model: torch.nn.Module, x: torch.Tensor, name: str) -> None:
    """``model``, built with ``in_chans=1``, maps one-channel ``x`` to its classes; registered
    ``name`` built on the meta device in bfloat16 has every parameter there and returns
    bfloat16 logits."""
    assert model(x).shape == (x.shape[0], model.num_classes)
    meta = timm.create_model(name, device='meta', dtype=torch.bfloat16)
    assert all(p.device.type == 'meta' and p.dtype == torch.bfloat16 for p in meta.parameters())
    out = meta(torch.randn(1, 3, 64, 64, device='meta', dtype=torch.bfloat16))
    assert out.shape == (1, 1000) and out.dtype == torch.bfloat16


def check_head_contract(model: torch.nn.Module, x: torch.Tensor, feature_hw: tuple,
                        layer_order: list) -> torch.Tensor:
    """timm's head contract on a staged model (in eval mode): ``forward_features`` gives NCHW
    maps of ``feature_hw``, unpooled; the pre-logits are their mean over H, W (the official
    heads); the classifier (``head.fc``) maps them to the logits; ``reset_classifier(0)`` leaves
    the pooled features, ``(0, '')`` the maps themselves. Layer decay (``group_matcher``) orders
    ``layer_order``, one parameter each of the stem, stage 0, stage 1's downsampling, stage 1's
    first block and the final norm: stem < stage 0 < stage 1 (its downsampling with its first
    block) < norm. Leaves the model without classifier or pooling; returns the maps."""
    batch = x.shape[0]
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (batch, model.num_features, *feature_hw)
        pre = model.forward_head(feats, pre_logits=True)
        torch.testing.assert_close(pre, feats.mean((2, 3)))
        torch.testing.assert_close(model(x), model.get_classifier()(pre))
        assert model.get_classifier() is model.head.fc
        model.reset_classifier(0)
        assert model(x).shape == (batch, model.num_features) == (batch, model.head_hidden_size)
        model.reset_classifier(0, '')
        torch.testing.assert_close(model(x), feats)  # no pooling, no classifier
    groups = group_parameters(model, model.group_matcher(), reverse=True)
    ids = [groups[n] for n in layer_order]
    assert ids == sorted(ids) and len(set(ids)) == 4 and ids[2] == ids[3]
    return feats


def check_forward_intermediates_and_prune(model: torch.nn.Module, x: torch.Tensor,
                                          indices) -> list:
    """``forward_intermediates``: its final output is ``forward_features``', the last map
    normed too, NHWC maps are the NCHW ones permuted; for each of ``indices``, ``stop_early``
    gives the same map, and the model pruned there (norm included) outputs that map as its
    features and as its output (head and pooling gone), its pooled channels with an average
    pooling head, and the map again from its own ``forward_intermediates``. Returns the
    NCHW maps."""
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x), rtol=0, atol=0)
        normed = model.forward_intermediates(x, indices=1, norm=True, intermediates_only=True)
        torch.testing.assert_close(normed[0], final)
        nhwc = model.forward_intermediates(x, output_fmt='NHWC', intermediates_only=True)
        for a, b in zip(inter, nhwc):
            torch.testing.assert_close(a, b.permute(0, 3, 1, 2))
        for i in indices:
            early = model.forward_intermediates(x, indices=[i], stop_early=True,
                                                intermediates_only=True)
            torch.testing.assert_close(early[0], inter[i], rtol=0, atol=0)
            pruned = copy.deepcopy(model)
            take = pruned.prune_intermediate_layers([i], prune_norm=True)
            assert take == [i]
            torch.testing.assert_close(pruned.forward_features(x), inter[i], rtol=0, atol=0)
            assert pruned(x).shape == inter[i].shape
            pruned.reset_classifier(0, 'avg')
            assert pruned(x).shape == (x.shape[0], model.feature_info[i]['num_chs'])
            again = pruned.forward_intermediates(x, indices=take, intermediates_only=True)
            torch.testing.assert_close(again[0], inter[i], rtol=0, atol=0)
    return inter


def check_backends_agree(model: torch.nn.Module, x: torch.Tensor, backends=("cuda", "torch"),
                         atol: float = 1e-4, rtol: float = 1e-4, grad_rtol: float = None,
                         grads_relative_to_largest: bool = True) -> None:
    """``model`` gives the same logits and parameter gradients on each of ``backends``, and every
    op it calls runs on the backend asked for (observed, not assumed). Logits within
    ``atol``/``rtol``; gradients within ``atol``/``grad_rtol`` (default ``rtol``), divided first by
    their largest reference entry when over 1 (``grads_relative_to_largest``: the rpb and weight
    gradients are sums over every output). On a GPU, fp32 stays fp32 on both sides: TF32 is off
    in cuDNN's convolutions and in matmuls while it runs."""
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    with attnzoo.backends.exact_fp32():
        for backend in backends:
            results.append(_logits_and_grads(model, x, params, backend))
    (ref, ref_grads), others = results[-1], results[:-1]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for logits, grads in others:
        torch.testing.assert_close(logits, ref, atol=atol, rtol=rtol)
        for name, g, r in zip(names, grads, ref_grads):
            norm = max(1.0, r.abs().max().item()) if grads_relative_to_largest else 1.0
            torch.testing.assert_close(g / norm, r / norm, atol=atol,
                                       rtol=rtol if grad_rtol is None else grad_rtol,
                                       msg=lambda m: f"grad {name}: {m}")


def _logits_and_grads(model, x, params, backend):
    seen = set()

    def observer(op, chosen, macs):
        seen.add(chosen)
        return contextlib.nullcontext()

    with attnzoo.use_backend(backend), attnzoo.backends.observe_ops(observer):
        logits = model(x)
        grads = torch.autograd.grad(logits.square().sum(), params)
    assert seen == {backend}, f"asked for {backend}, ops ran on {sorted(seen)}"
    return logits.detach().cpu(), [g.cpu() for g in grads]

