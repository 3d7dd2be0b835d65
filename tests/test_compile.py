"""torch.compile on every torch the package admits (CI runs this file on the floor torch too).

The checks use the ``aot_eager`` backend: Dynamo's graph capture and AOT autograd, which is where
NAT used to break (the backend switch, the NA index plans, recompiles per block), without
inductor's C++ code generation, which takes minutes per model on a 2-core CPU. Inductor itself was
run by hand on each torch version (docs/maintaining.md)."""
import pytest
import torch
import torch._dynamo

import attnzoo
from tiny_models import NAT_SHALLOW, nat

pytestmark = pytest.mark.floor  # also run on the lowest torch and timm admitted (.ci/floor)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_fullgraph_two_batch_sizes_matches_eager():
    model = nat(NAT_SHALLOW, drop_path_rate=0.).train()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for batch in (2, 3):  # the second batch size recompiles with a dynamic batch dim
        x = torch.randn(batch, 3, 40, 40)  # small stages: the padding path is compiled too
        out_ref = model(x)
        grads_ref = torch.autograd.grad(out_ref.square().sum(), list(model.parameters()))
        out = compiled(x)
        grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14),
    reason=f"torch {torch.__version__}'s Dynamo: checked on 2.14; 2.4's fails to specialize a "
           "traced size (NAT's compile fails at a second map size there; docs/backends.md)")
def test_a_second_map_size_recompiles_once_without_a_graph_break():
    """A new input size makes Dynamo retrace with symbolic sizes; the NA plan (and the padding)
    must then specialize on the map size, not break the graph once per block (as they did:
    fullgraph raised, and a default compile split into a graph per block)."""
    model = nat(NAT_SHALLOW).eval()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=counting, fullgraph=True)
    with torch.no_grad():
        for size, total in ((40, 1), (48, 2), (40, 2)):  # the first size's graph is kept
            x = torch.randn(1, 3, size, size)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
            assert len(graphs) == total, (size, len(graphs))


@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14),
    reason=f"torch {torch.__version__}'s Dynamo: checked on 2.14; 2.4's does not specialize a "
           "traced size")
def test_a_compiled_training_step_specializes_on_the_image_size():
    """Inductor (torch 2.14) fails to compile a training step of NAT, QnA-ViT or SAN at a
    symbolic image size, where timm's ResNet compiles: with autograd the models specialize on
    the image size (a new size compiles a new graph with static sizes); inference keeps the
    symbolic sizes Dynamo gives a second size."""
    import tiny_models
    model = tiny_models.san(**tiny_models.SAN_TWO_STAGES)
    symbolic = []

    def recording(gm, example_inputs):
        symbolic.append(sum(isinstance(n.meta.get("example_value"), torch.SymInt)
                            for n in gm.graph.nodes if n.op == "placeholder"))
        return gm.forward

    compiled = torch.compile(model.train(), backend=recording, fullgraph=True)
    for size, graphs in ((32, 1), (40, 2), (32, 2), (48, 3)):
        compiled(torch.randn(1, 3, size, size)).square().sum().backward()
        assert len(symbolic) == graphs, size
    assert symbolic == [0, 0, 0]
    torch._dynamo.reset()
    symbolic.clear()
    compiled = torch.compile(model.eval(), backend=recording, fullgraph=True)
    with torch.no_grad():
        for size in (32, 40):
            compiled(torch.randn(1, 3, size, size))
    assert symbolic[0] == 0 and symbolic[1] > 0, symbolic


def test_dynamic_true_trains_without_a_graph_break():
    """``torch.compile(dynamic=True)``: every size symbolic, and Dynamo makes the layers' float
    attributes (NA's ``scale``) symbolic too, which the op's checks must take without a graph
    break (``math.isfinite`` broke it). A training step equals eager's. (QnA-ViT's and SAN's
    tiny models compile so too: checked by hand, they have no float argument to check.)"""
    import tiny_models
    model = nat(tiny_models.NAT_ONE_STAGE, dilations=None).train()
    x = torch.randn(2, 3, 32, 32)
    params = list(model.parameters())
    want = model(x)
    grads_want = torch.autograd.grad(want.square().sum(), params)
    got = torch.compile(model, backend="aot_eager", dynamic=True, fullgraph=True)(x)
    grads = torch.autograd.grad(got.square().sum(), params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, g_want in zip(grads, grads_want):
        torch.testing.assert_close(g, g_want, rtol=1e-4, atol=1e-5)


def test_fullgraph_autocast_bf16_with_drop_path():
    model = nat(NAT_SHALLOW, drop_path_rate=0.2).train()  # per-block drop-path rates: no recompiles
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(torch.randn(2, 3, 40, 40))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_a_compiled_training_step_runs_na_as_one_custom_op_each_way():
    """With autograd, torch.compile sees NA's torch reference as one opaque custom op forward
    and one backward per layer: its gathers, bias contraction and softmax backward stay out of
    AOT autograd's and Inductor's graphs (NAT's first compiled training step took 1.7x
    swin_tiny's). Without autograd it is still traced, for Inductor to fuse. Logits and
    gradients are eager's."""
    from attnzoo.layers.neighborhood import NeighborhoodAttention2d
    from torch._dynamo.backends.common import aot_autograd

    model = nat(NAT_SHALLOW, drop_path_rate=0.).train()
    layers = sum(isinstance(m, NeighborhoodAttention2d) for m in model.modules())
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return gm
        return compiler

    recording = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    x = torch.randn(2, 3, 40, 40)
    params = list(model.parameters())
    want = model(x)
    grads_want = torch.autograd.grad(want.square().sum(), params)
    got = torch.compile(model, backend=recording, fullgraph=True)(x)
    grads = torch.autograd.grad(got.square().sum(), params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, g_want in zip(grads, grads_want):
        torch.testing.assert_close(g, g_want, rtol=1e-4, atol=1e-5)
    assert graphs["forward"].count("attnzoo.na_reference.default") == layers == 5
    assert graphs["backward"].count("attnzoo.na_reference_backward.default") == layers
    assert not any("index" in op or "softmax" in op for op in graphs["forward"]), graphs
    assert not any("index" in op or "softmax" in op for op in graphs["backward"]), graphs

    torch._dynamo.reset()
    graphs.clear()
    with torch.no_grad():
        torch.compile(model.eval(), backend=recording, fullgraph=True)(x)
    assert not any("attnzoo" in op for op in graphs["forward"])
    assert any("softmax" in op or "attention" in op for op in graphs["forward"])


def test_default_compile_has_no_graph_break():
    model = nat(NAT_SHALLOW).eval()
    explanation = torch._dynamo.explain(model)(torch.randn(1, 3, 40, 40))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_a_compiled_model_is_not_exporting():
    """torch.compile is no export: the ops keep their backends (torch 2.11's Dynamo folds
    torch.compiler.is_exporting() to True under any torch.compile; a test of that call would have
    put every compiled model on the export formulas, and the cuda backend on none of its kernels).
    torch.export is one, where torch has the flag (>= 2.5)."""
    from attnzoo import backends

    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + 1 if backends.exporting() else x - 1

    x = torch.zeros(1)
    assert torch.compile(Probe(), backend="eager", fullgraph=True)(x).item() == -1
    if hasattr(torch.compiler, "is_exporting"):
        assert torch.export.export(Probe(), (x,)).module()(x).item() == 1


def test_unsupported_backend_raises_its_own_error_under_compile():
    model = nat(NAT_SHALLOW, backend="cuda").eval()  # the layers ask for cuda explicitly; CPU input
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.raises(attnzoo.BackendUnsupportedError, match="cannot run na2d"):
        compiled(torch.randn(1, 3, 40, 40))


def test_backend_switch_after_compiling_recompiles():
    model = nat(NAT_SHALLOW).eval()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(1, 3, 40, 40)
    with torch.no_grad():
        expected = compiled(x)
        with attnzoo.use_backend("torch"):  # a guard on the switch: a new graph, same result
            torch.testing.assert_close(compiled(x), expected)
        # fullgraph: Dynamo reports the raise as unsupported; torch >= 2.6 includes our message,
        # torch 2.4-2.5 show the raise of BackendUnsupportedError in the user-code trace
        with attnzoo.use_backend("cuda"), pytest.raises(
                Exception, match="backend 'cuda' cannot run|BackendUnsupportedError"):
            compiled(x)
        torch.testing.assert_close(compiled(x), expected)


def test_san_compiles_its_aggregation_without_a_traced_tap_loop_equal_to_eager():
    """The torch reference's SAN aggregation under torch.compile: without autograd the unfolded
    product (one reduction whatever the footprint), with it the tap loops as opaque custom ops,
    never the kk traced ops per call that made SAN's first compiled call 3x swin_tiny's
    (inference) and 6x (training). Logits and gradients are eager's."""
    import tiny_models
    model = tiny_models.san(**tiny_models.SAN_TWO_STAGES)
    x = torch.randn(2, 3, 32, 32)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g)(
            gm, example_inputs)

    with torch.no_grad():
        want = model.eval()(x)
        got = torch.compile(model, backend=recording, fullgraph=True)(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(graphs) == 1 and not any("addcmul" in op for op in graphs[0]), graphs[0]
    assert any("unfold" in op for op in graphs[0])
    torch._dynamo.reset()
    graphs.clear()
    params = list(model.train().parameters())
    want = model(x)
    grads_want = torch.autograd.grad(want.square().sum(), params)
    got = torch.compile(model, backend=recording, fullgraph=True)(x)
    grads = torch.autograd.grad(got.square().sum(), params)
    assert len(graphs) == 1 and not any("addcmul" in op for op in graphs[0]), graphs[0]
    assert graphs[0].count("attnzoo.san_aggregation_reference.default") == 2  # one per block
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, g_want in zip(grads, grads_want):
        torch.testing.assert_close(g, g_want, rtol=1e-4, atol=1e-5)
