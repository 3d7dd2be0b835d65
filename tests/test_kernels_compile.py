"""A compiled training step of every family on attnzoo's Triton kernels (the ``cuda`` backend):
``torch.compile(fullgraph=True)``, forward and backward, with eager's logits and every parameter's
gradient on ``cuda`` and on the ``torch`` reference, at two input sizes. Without a GPU the kernels
run under Triton's interpreter on CPU tensors (tests/conftest.py); with one, compiled on CUDA.

The compiler is ``aot_eager_decomp_partition_crossref``: Dynamo, AOT autograd with Inductor's
decompositions and partitioner, no code generation (Inductor's C++ compile takes minutes on CI's
two cores), and every custom op's output checked against what its fake implementation told the
graph (sizes, strides, dtype) as the graph runs: a fake that disagrees fails here as it fails
Inductor's ``assert_size_stride`` on a GPU (issue 45: QnA-ViT's compiled backward crashed there).
Where that backend does not exist (older torch), ``aot_eager``.
"""
from __future__ import annotations

import pytest
import timm
import torch
import torch._dynamo

import attnzoo
from attnzoo import kernels

if kernels.triton_missing():  # an optional dependency; its reason is shown (-ra)
    pytest.skip(kernels.triton_missing(), allow_module_level=True)

from attnzoo.layers import QnAUpsample  # noqa: E402
import tiny_models  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.interpreter
SUFFIX = "_inductor" if kernels.inductor_launches() else ""
COMPILER = ("aot_eager_decomp_partition_crossref"
            if "aot_eager_decomp_partition_crossref" in torch._dynamo.list_backends(())
            else "aot_eager")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(model, x, backend, autocast=None):
    """Logits and every parameter's gradient of one training step on ``backend``."""
    params = [p for p in model.parameters() if p.requires_grad]
    with attnzoo.use_backend(backend), torch.autocast(x.device.type, autocast or torch.float32,
                                                      enabled=autocast is not None):
        logits = model(x)
    grads = torch.autograd.grad(logits.float().logsumexp(-1).mean(), params)
    return logits.detach().float().cpu(), [g.float().cpu() for g in grads]


def _attnzoo_ops(gm) -> list:
    """The names of the attnzoo ops that Dynamo's graph ``gm`` calls."""
    return [str(n.target).split(".")[1] for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("attnzoo.")]


def check_compiled_step(model, inputs, tol=1e-4, autocast=None) -> set:
    """For each input: the compiled step on ``cuda`` equals the eager step on ``cuda`` (same
    kernels: within float32 reordering) and on ``torch`` (within ``tol``, gradients relative to
    their largest entry). Returns the attnzoo ops in Dynamo's graphs (their names without the
    ``_inductor`` of the kernels' ``triton_op``, checked to be there on a torch that has
    them): each pass is one call there, never its host code. (On CUDA tensors, AOT autograd
    then traces into that op: Inductor launches the kernels, tests/inductor_launches.py; under
    the interpreter it keeps the opaque op.)"""
    model = model.to(DEVICE).train()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    ops = set()

    def recording(gm, example_inputs):
        names = _attnzoo_ops(gm)
        assert all(name.endswith(SUFFIX) for name in names), names
        ops.update(name[:len(name) - len(SUFFIX)] for name in names)
        return torch._dynamo.lookup_backend(COMPILER)(gm, example_inputs)

    compiled = torch.compile(model, backend=recording, fullgraph=True)
    for x in inputs:
        x = x.to(DEVICE)
        with attnzoo.use_backend("cuda"):  # the trace bakes the backend in
            got = _step(compiled, x, "cuda", autocast)
        for backend, atol in (("cuda", 1e-5 if autocast is None else tol), ("torch", tol)):
            logits, grads = _step(model, x, backend, autocast)
            torch.testing.assert_close(got[0], logits, atol=atol, rtol=atol,
                                       msg=lambda m: f"logits against eager {backend}: {m}")
            for name, g, ref in zip(names, got[1], grads):
                norm = max(1.0, ref.abs().max().item())
                torch.testing.assert_close(g / norm, ref / norm, atol=atol, rtol=atol,
                                           msg=lambda m: f"grad {name}, eager {backend}: {m}")
    return ops


def _images(*sizes, batch=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, 3, s, s, generator=g) for s in sizes]


# a tiny model of each family, and the kernel ops its graph calls
MODELS = {
    "nat": (lambda: tiny_models.nat(tiny_models.NAT_ONE_STAGE, dilations=None), {"na_fused"}),
    "dinat": (lambda: tiny_models.nat(tiny_models.NAT_ONE_STAGE), {"na_fused"}),
    "nat_quest_norm": (lambda: tiny_models.nat(tiny_models.NAT_ONE_STAGE, dilations=None,
                                               attn_norm="quest"), {"na_fused"}),
    "qna_vit": (lambda: tiny_models.qna_vit(**tiny_models.QNA_VIT_TWO_STAGES), {"qna_fused"}),
    "san_pairwise": (lambda: tiny_models.san(**tiny_models.SAN_TWO_STAGES),
                     {"san_subtraction_fused", "san_aggregation_fused"}),
    "san_patchwise": (lambda: tiny_models.san("patchwise", **dict(
        tiny_models.SAN_TWO_STAGES, padding_mode="reflect")), {"san_aggregation_fused"}),
}


@pytest.mark.parametrize("family", MODELS)
def test_a_compiled_training_step_on_the_kernels_equals_eager(family):
    """NAT, DiNAT, NAT with QUEST's key normalisation, QnA-ViT (a QnA block with its stride-2
    downsampling, then an LSA block), SAN pairwise and patchwise: 32 and 40 px (a second size
    compiles a second graph)."""
    build, kernel_ops = MODELS[family]
    ops = check_compiled_step(tiny_models.randomize(build()), _images(32, 40))
    assert ops == kernel_ops, sorted(ops)


def test_qna_upsampling_layer_compiled_training_step():
    """QnAUpsample: four learned queries, per-query outputs (``sum_queries=False``), the rpb."""
    torch.manual_seed(0)
    layer = QnAUpsample(8, 4, num_heads=2, scale=2)
    with torch.no_grad():
        layer.rpb.normal_()
    model = torch.nn.Sequential(layer, torch.nn.Flatten(1))
    g = torch.Generator().manual_seed(0)
    ops = check_compiled_step(model, [torch.randn(2, h, w, 8, generator=g)
                                      for h, w in ((5, 6), (7, 4))])
    assert ops == {"qna_fused"}, sorted(ops)


def test_the_issue_45_qna_vit_snippet_compiles_its_backward():
    """Issue 45's snippet, at a small size: a QnA-ViT compiled for training under bf16
    autocast, ``logsumexp`` loss, backward. Its backward failed on the QnA kernel's rpb and
    window-weight gradients, whose layout the fake misstated."""
    model = tiny_models.qna_vit(**tiny_models.QNA_VIT_TWO_STAGES)
    check_compiled_step(model, _images(32), tol=5e-2, autocast=torch.bfloat16)


@pytest.mark.parametrize("family", ["nat", "qna_vit", "san_pairwise"])
def test_train_py_s_torchcompile_path_on_the_kernels(family):
    """timm's train.py with ``--torchcompile``: ``ClassificationTask.compile`` wraps the model in
    ``torch.compile`` (no fullgraph) before training; the training steps (the loss outside the
    compiled model, then SGD) and the validation after them (eval mode under ``no_grad``, its
    last batch smaller) all go through that compiled model. On NAT (NA with its rpb), QnA-ViT
    and SAN pairwise (both SAN kernels, and BatchNorm, whose running statistics the compiled
    training steps update and validation reads). The losses, the weights after the steps and
    the validation logits equal eager's on the same kernels; no graph breaks, and every graph
    (a training one, an eval one, one for the last batch) calls the kernels."""
    from timm.task import ClassificationTask
    build, kernel_ops = MODELS[family]

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(set(_attnzoo_ops(gm)))
        return torch._dynamo.lookup_backend(COMPILER)(gm, example_inputs)

    def run(compile_backend):
        torch.manual_seed(0)  # (the same weights in both runs, whatever build draws)
        model = tiny_models.randomize(build()).to(DEVICE)
        task = ClassificationTask(model, criterion=torch.nn.CrossEntropyLoss(label_smoothing=0.1),
                                  verbose=False)
        if compile_backend:
            task.compile(backend=compile_backend)
        module = task.get_trainable_module()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        losses, logits = [], []
        with attnzoo.use_backend("cuda"):
            module.train()
            for _ in range(2):
                x = torch.randn(2, 3, 32, 32, generator=g).to(DEVICE)
                target = torch.randint(0, 5, (2,), generator=g).to(DEVICE)
                optimizer.zero_grad(set_to_none=True)
                loss = task(x, target)["loss"]
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            evaluated = task.get_eval_model()
            evaluated.eval()
            with torch.no_grad():
                for batch in (2, 1):
                    logits.append(evaluated(torch.randn(batch, 3, 32, 32, generator=g).to(
                        DEVICE)).cpu())
        return losses, model.state_dict(), logits

    torch._dynamo.utils.counters.clear()
    losses, state, logits = run(recording)
    assert not torch._dynamo.utils.counters["graph_break"], dict(
        torch._dynamo.utils.counters["graph_break"])
    assert len(graphs) == 3 and all(
        {op.removesuffix(SUFFIX) for op in ops} == kernel_ops for ops in graphs), graphs
    eager_losses, eager_state, eager_logits = run(None)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-5)
    for name, ref in eager_state.items():
        torch.testing.assert_close(state[name].cpu(), ref.cpu(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name} after the steps: {m}")
    for got, ref in zip(logits, eager_logits):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
