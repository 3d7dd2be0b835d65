"""Checks each staged family runs on a small model of its own: the assertions, written once."""
import pytest
import torch
from timm.layers import get_notrace_functions, get_notrace_modules

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
