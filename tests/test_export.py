"""ONNX export: every op's export formula, the switch that picks it while a model is traced for
export (whatever the backend), and whole models through timm's ``onnx_export`` with both
exporters, checked by onnxruntime against PyTorch at the export's input, at another batch and,
where the model takes any size, at another input size; and ``attnzoo export``.

Tiers: the default run exports the smallest model of each family with the TorchScript
exporter, and with the dynamo exporter every op and QUEST-ViT; ``slow`` the other families'
smallest models with the dynamo exporter (see ``_QUICK_DYNAMO_FAMILIES``) and, with
``ATTNZOO_TIMM_CHECKOUT`` set to a timm clone, that clone's own ``onnx_export.py
--check-forward`` with and without ``--dynamic-size`` and ``--dynamo``; timm's suite's ``full``
switch (``ATTNZOO_TIMM_SUITE=full``) every model with both exporters.
"""
from __future__ import annotations

import collections
import contextlib
import importlib.util
import inspect
import io
import itertools
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
import timm
import torch
from timm.utils.onnx import onnx_export

import attnzoo
from attnzoo import backends, cli
from attnzoo.ops.neighborhood import na_export, na_reference
from attnzoo.ops.qna import qna2d_export, qna2d_reference
from attnzoo.ops.san import _footprint, aggregation_export, aggregation_reference
import tiny_models
from timm_suite.families import full_run, smallest_per_family

# ---------------------------------------------------------------------------------------------
# the export formulas
# ---------------------------------------------------------------------------------------------


def _randn(*shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()


def _na_case(n, size, K, d, rpb):
    def build(seed):
        q, k, v = (_randn(2, *size, 3, 4, seed=seed + i) for i in range(3))
        table = _randn(3, *(2 * K - 1,) * n, seed=seed + 3) if rpb else None
        return (q, k, v, (K,) * n, (d,) * n, table, 0.4)
    return build


def _qna_case(H, W, L, k, stride, sum_queries, bias):
    def build(seed):
        logits, v = _randn(2, H, W, L, 3, seed=seed), _randn(2, H, W, 3, 4, seed=seed + 1)
        with torch.no_grad():
            logits.mul_(4)  # logits spanning more than one window's usual range
        rpb, ws = ((_randn(L, 3, k, k, seed=seed + 2), _randn(L, 3, k, k, seed=seed + 3))
                   if bias else (None, None))
        return (logits, v, rpb, ws, k, stride, sum_queries)
    return build


def _san_case(C, Cw, H, W, k, d, s, mode):
    def build(seed):
        x = _randn(2, C, H, W, seed=seed)
        fp = _footprint("san_aggregation", x, k, d, s, mode)
        Ho, Wo = (H - 1) // s + 1, (W - 1) // s + 1
        return (x, _randn(2, Cw, k * k, Ho * Wo, seed=seed + 1), fp)
    return build


FORMULAS = {
    "na2d k3 d2 rpb 9x11": (na_export, na_reference, _na_case(2, (9, 11), 3, 2, True)),
    "na2d k7 d1 7x8": (na_export, na_reference, _na_case(2, (7, 8), 7, 1, False)),
    "na2d k5 d1 rpb 12x10": (na_export, na_reference, _na_case(2, (12, 10), 5, 1, True)),
    "na1d k5 d3 rpb 17": (na_export, na_reference, _na_case(1, (17,), 5, 3, True)),
    "qna2d k3 s1": (qna2d_export, qna2d_reference, _qna_case(9, 11, 2, 3, 1, True, True)),
    "qna2d k5 s2 unsummed": (qna2d_export, qna2d_reference,
                             _qna_case(8, 7, 4, 5, 2, False, True)),
    "qna2d k7 s1 no bias": (qna2d_export, qna2d_reference, _qna_case(6, 6, 1, 7, 1, True, False)),
    "san k3 reflect": (aggregation_export, aggregation_reference,
                       _san_case(8, 2, 9, 11, 3, 1, 1, "reflect")),
    "san k7 s2 zeros": (aggregation_export, aggregation_reference,
                        _san_case(8, 4, 9, 11, 7, 1, 2, "zeros")),
    "san k3 d2 reflect": (aggregation_export, aggregation_reference,
                          _san_case(6, 3, 8, 8, 3, 2, 1, "reflect")),
}


@pytest.mark.parametrize("case", list(FORMULAS))
def test_export_formulas_equal_the_torch_reference_forward_and_backward(case):
    export, reference, build = FORMULAS[case]
    args_e, args_r = build(0), build(0)
    out_e, out_r = export(*args_e), reference(*args_r)
    torch.testing.assert_close(out_e, out_r, rtol=1e-10, atol=1e-10)
    grad = torch.randn(out_r.shape, generator=torch.Generator().manual_seed(9),
                       dtype=torch.float64)
    inputs_e = [a for a in args_e if isinstance(a, torch.Tensor)]
    inputs_r = [a for a in args_r if isinstance(a, torch.Tensor)]
    for ge, gr in zip(torch.autograd.grad(out_e, inputs_e, grad),
                      torch.autograd.grad(out_r, inputs_r, grad)):
        torch.testing.assert_close(ge, gr, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("mode", ["reflect", "zeros"])
def test_san_s_footprint_gather_while_exporting_equals_unfold(mode, monkeypatch):
    """ops/san._neighbours while exporting: one index_select of the flattened map
    (_footprint_index) equals F.unfold of the padded map, for every kernel, dilation and
    stride, down to maps one position wider than reflect's padding."""
    from attnzoo.ops import san

    checked = 0
    for k, d, s, (H, W) in itertools.product((3, 5, 7), (1, 2), (1, 2), ((9, 11), (5, 4))):
        if mode == "reflect" and d * (k - 1) // 2 >= min(H, W):
            continue  # beyond what reflection (F.pad's) takes
        x = torch.randn(2, 3, H, W, dtype=torch.float64)
        fp = _footprint("san_neighbours", x, k, d, s, mode)
        want = san._neighbours(x, fp)
        with monkeypatch.context() as patch:
            patch.setattr(backends, "exporting", lambda: True)
            got = san._neighbours(x, fp)
        assert torch.equal(got, want), (k, d, s, H, W)
        checked += 1
    assert checked >= 16


def test_na_export_formula_equals_the_brute_force_oracle():
    from oracles import neighborhood_attention

    q, k, v, ks, dil, rpb, scale = _na_case(2, (9, 11), 3, 2, True)(0)
    with torch.no_grad():
        torch.testing.assert_close(na_export(q, k, v, ks, dil, rpb, scale),
                                   neighborhood_attention(q, k, v, 3, 2, rpb, scale))


# (layer arguments, map size): padded or not, with and without rpb, dilated, QUEST's unit keys,
# a map smaller than the window in one axis and in both
@pytest.mark.parametrize("kwargs, size", [
    (dict(kernel_size=3), (5, 7)),
    (dict(kernel_size=3, dilation=2, rel_pos_bias=False), (9, 4)),
    (dict(kernel_size=5, attn_norm="quest"), (6, 8)),
    (dict(kernel_size=3, dilation=2), (2, 3)),
], ids=["k3", "k3-d2-no-rpb-narrow", "k5-quest", "k3-d2-tiny"])
def test_na_layer_s_export_path_on_rows_equals_its_forward(kwargs, size):
    """NeighborhoodAttention2d.forward_rows (what an export runs, on the map's rows, q, k and v
    gathered from the one qkv tensor, the padding as one token) against the layer's forward."""
    from attnzoo.layers import NeighborhoodAttention2d

    torch.manual_seed(0)
    layer = NeighborhoodAttention2d(16, 2, **kwargs).double().eval()
    if layer.rpb is not None:
        torch.nn.init.normal_(layer.rpb)  # rpb's init is small: a wrong row would hide
    x = torch.randn(2, *size, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer.export_forward(x), layer(x))


class _EveryOp(torch.nn.Module):
    """One call of each op family, on small maps derived from one input."""

    def forward(self, x):  # x [B, 8, 9, 4]
        q = x.reshape(*x.shape[:3], 2, 2)
        na = attnzoo.ops.na2d(q, q * 0.5, q, kernel_size=3, dilation=2)
        qna = attnzoo.ops.qna2d(q[..., 0].unsqueeze(3), q, kernel_size=3, stride=2)
        nchw = x.permute(0, 3, 1, 2)
        weight = nchw[:, :2].flatten(2).unsqueeze(2).expand(-1, -1, 9, -1) * 0.1
        san = attnzoo.ops.san_aggregation(nchw, weight, kernel_size=3)
        return na.sum((1, 2)), qna.sum((1, 2)), san.sum((2, 3))


def _reference_of_every_op(x):
    with backends.use_backend("torch"):
        return _EveryOp()(x)


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_a_trace_runs_every_op_s_export_formula_whatever_the_backend(backend):
    x = torch.randn(2, 8, 9, 4)
    with backends.use_backend(backend):
        if backend in ("natten", "cuda"):  # eagerly these backends cannot run qna2d on CPU
            with pytest.raises(backends.BackendUnsupportedError):
                _EveryOp()(x)
        traced = torch.jit.trace(_EveryOp(), (x,), check_trace=False)
    # the trace holds the export formulas, not a backend's kernels or attnzoo's custom op
    assert "attnzoo::" not in str(traced.graph)
    for got, want in zip(traced(x), _reference_of_every_op(x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_torch_export_runs_the_export_formulas():
    if _dynamo_skip_reason():
        pytest.skip(_dynamo_skip_reason())
    x = torch.randn(2, 8, 9, 4)
    with backends.use_backend("cuda"):
        program = torch.export.export(_EveryOp(), (x,), strict=False)
    assert "attnzoo" not in str(program.graph)
    for got, want in zip(program.module()(x), _reference_of_every_op(x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# family -> (build(blocks in the second stage), the two depths): tiny models whose second stage
# holds blocks of one map size; NAT's alternate dilations 1 and 2 (the two index formulas),
# QnA-ViT's window attention there and QnA in its downsampling blocks only (a dynamic-size
# trace of QnA-ViT's windows takes seconds per block)
_SHARED_INDEX_MODELS = {
    "nat": (lambda depth: tiny_models.nat(depths=(1, depth, 1, 1), dilations=(
        (2,), (1, 2) * (depth // 2), (2,), (1,))), (2, 4)),
    "qna_vit": (lambda depth: tiny_models.qna_vit(qna_depths=(0, 0, 0, 0),
                                                  lsa_depths=(0, depth, 0, 0)), (1, 2)),
}


def _torch_export(model, x, size_too):
    """``torch.export`` as the dynamo ONNX exporter calls it (Dim.DYNAMIC, size-oblivious)."""
    dims = {axis: torch.export.Dim.DYNAMIC for axis in ((0, 2, 3) if size_too else (0,))}
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):
        return torch.export.export(model, (x,), dynamic_shapes=(dims,), strict=False)


@pytest.mark.parametrize("family", list(_SHARED_INDEX_MODELS))
def test_a_torch_export_trace_builds_each_stage_s_indices_once(family):
    """backends.export_memo: the blocks of a stage share the index tensors their map size
    gives (the graph, and the dynamo exporter's time, then follow the blocks' own work), and
    the graph is right at other sizes: 45x77 is no multiple of 4 (QnA-ViT's stem pads), pads
    NAT's last stage in one axis and not the other, and pads QnA-ViT's windows."""
    if _dynamo_skip_reason():
        pytest.skip(_dynamo_skip_reason())
    if "check_guards" not in inspect.signature(torch.export.ExportedProgram.module).parameters:
        pytest.skip(f"torch {torch.__version__}'s exported programs always check their guards")
    build, (shallow, deep) = _SHARED_INDEX_MODELS[family]
    x = torch.randn(2, 3, 64, 64)

    def op_count(program, op):
        return sum(node.target == op for node in program.graph.nodes)

    programs = {depth: _torch_export(build(depth), x, True) for depth in (shallow, deep)}
    arange = torch.ops.aten.arange.default
    assert op_count(programs[shallow], arange) > 0
    assert op_count(programs[deep], arange) == op_count(programs[shallow], arange)
    model = build(deep)
    # the program's guards hold the export size's view and padding decisions, which an ONNX
    # graph does not have: the values are what an exported graph must get right
    graph = programs[deep].module(check_guards=False)
    for inp in (x, torch.randn(3, 3, 45, 77), torch.randn(1, 3, 96, 40)):
        with torch.no_grad():
            torch.testing.assert_close(graph(inp), model(inp), rtol=1e-5, atol=1e-5)
    if family == "qna_vit":  # sizes fixed by the export: no padding where the windows tile
        masked = op_count(_torch_export(model, x, False), torch.ops.aten.masked_fill.Scalar)
        assert masked == 0 < op_count(programs[deep], torch.ops.aten.masked_fill.Scalar)


def test_nat_s_blocks_run_on_the_map_s_rows_in_a_torch_export_trace():
    """Stage.blocks_on_rows: while exporting, every norm of NAT's blocks takes the map's rows
    [B*H*W, C] (2-D tensors: less symbolic-shape work per node than [B, H, W, C] maps), and
    the stem's and downsamplers' norms keep their maps."""
    if _dynamo_skip_reason():
        pytest.skip(_dynamo_skip_reason())
    model = tiny_models.nat(depths=(1, 2, 1, 1), dilations=((1,), (1, 2), (1,), (1,)))
    program = _torch_export(model, torch.randn(2, 3, 64, 64), True)
    dims = [node.meta["val"].dim() for node in program.graph.nodes
            if node.target == torch.ops.aten.layer_norm.default]
    blocks = sum(len(stage.blocks) for stage in model.stages)
    assert dims.count(2) == 2 * blocks and set(dims) == {2, 4}, dims


def test_qna_vit_s_traced_sizes_are_one_division_of_the_input_size():
    """QnA-ViT's stem pads to ((n - 1) // 4 + 1) * 4, a strided conv's own form: every size of
    a dynamic-size trace is then one division of the input's, (s - 1) // 2**i + 1, where
    (n + 3) // 4 nested divisions that sympy does not merge (every later shape carried them,
    and the dynamo export took 77 s instead of 50)."""
    if _dynamo_skip_reason():
        pytest.skip(_dynamo_skip_reason())
    model = tiny_models.qna_vit(qna_depths=(0, 0, 0, 0), lsa_depths=(0, 0, 0, 0))
    program = _torch_export(model, torch.randn(2, 3, 64, 64), True)
    from torch.utils._sympy.functions import FloorDiv

    sizes = {size.node.expr for node in program.graph.nodes
             if isinstance(node.meta.get("val"), torch.Tensor)
             for size in node.meta["val"].shape if isinstance(size, torch.SymInt)}
    divisions = [d for size in sizes for d in size.atoms(FloorDiv)]
    assert divisions and not [d for d in divisions if d.args[0].has(FloorDiv)], sizes


def test_export_memo_shares_only_within_a_torch_export_trace():
    calls = []

    def make():
        calls.append(1)
        return torch.arange(3)

    x = torch.randn(2)
    backends.export_memo(("k", 3), x, make)
    backends.export_memo(("k", 3), x, make)
    assert len(calls) == 2  # eager: every call builds its own


@pytest.mark.floor
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_every_op_exports_to_onnx_for_any_batch_and_map_size(exporter, tmp_path):
    if exporter == "dynamo" and _dynamo_skip_reason():
        pytest.skip(_dynamo_skip_reason())
    x, path = torch.randn(2, 8, 9, 4), tmp_path / "ops.onnx"
    with torch.no_grad(), backends.use_backend("cuda"):
        if exporter == "dynamo":
            dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("height", min=6),
                    2: torch.export.Dim("width", min=6)}
            torch.onnx.export(_EveryOp(), (x,), str(path), dynamo=True, input_names=["x"],
                              dynamic_shapes=(dims,))
        else:
            torch.onnx.export(_EveryOp(), (x,), str(path), dynamo=False, opset_version=17,
                              input_names=["x"], dynamic_axes={"x": [0, 1, 2]})
    onnx.checker.check_model(str(path), full_check=True)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    # the export's shape, then another batch and map (the windows clamp at other borders)
    for inp in (x, torch.randn(3, 11, 7, 4)):
        for got, want in zip(session.run(None, {"x": inp.numpy()}), _reference_of_every_op(inp)):
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_san_s_position_grid_exports_for_a_map_of_side_1(exporter, tmp_path):
    """A pairwise SAM's position encoding ([-1, 1] per axis, linspace's) on a map of side 1
    is -1, as in eager: SAN with zero padding reaches 1x1 maps at its 32 px minimum. The
    export formula once divided by the side - 1 (0 * inf: NaN logits at 32-63 px)."""
    if exporter == "dynamo" and _dynamo_skip_reason():
        pytest.skip(_dynamo_skip_reason())
    from attnzoo.layers.san import SAM
    torch.manual_seed(5)
    sam = SAM(8, 2, 8, share_planes=4, kernel_size=3, sa_type="pairwise",
              padding_mode="zeros").eval()
    x, path = torch.randn(2, 8, 4, 5), tmp_path / "sam.onnx"
    with torch.no_grad():
        if exporter == "dynamo":
            dims = {0: torch.export.Dim("batch"), 2: torch.export.Dim("height"),
                    3: torch.export.Dim("width")}
            torch.onnx.export(sam, (x,), str(path), dynamo=True, input_names=["x"],
                              dynamic_shapes=(dims,))
        else:
            torch.onnx.export(sam, (x,), str(path), dynamo=False, opset_version=17,
                              input_names=["x"], dynamic_axes={"x": [0, 2, 3]})
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for inp in (torch.randn(1, 8, 1, 1), torch.randn(3, 8, 1, 6), torch.randn(1, 8, 3, 2)):
        with torch.no_grad():
            want = sam(inp)
        got = torch.from_numpy(session.run(None, {"x": inp.numpy()})[0])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_eager_calls_never_run_an_export_formula(monkeypatch):
    def refuse(*args):
        raise AssertionError("an eager call ran an export formula")

    for op in backends.registered_ops():
        monkeypatch.setitem(backends._OPS, op, backends._OPS[op]._replace(export=refuse))
    assert not backends.exporting()
    _EveryOp()(torch.randn(2, 8, 9, 4))


# ---------------------------------------------------------------------------------------------
# whole models, timm's onnx_export, onnxruntime
# ---------------------------------------------------------------------------------------------

# With a dynamic size, the dynamo exporter and the checks take 1-3 minutes per model for the
# smallest NAT, QnA-ViT and SAN models on a 2-core CPU (symbolic-shape work in torch.export, its
# decompositions and onnxscript's optimizer), 10-20 s for QUEST-ViT: the default run exports
# QUEST-ViT with it, every op above and tiny NAT / QnA-ViT models through torch.export (dynamic
# batch and size); the others are `slow`. On the floor (torch 2.4) the TorchScript exporter
# exports the smallest NAT and QnA-ViT models.
_QUICK_DYNAMO_FAMILIES = {"quest_vit"}
_FLOOR_FAMILIES = {"nat", "qna_vit"}


def _cases():
    if full_run():
        return [(name, exporter) for name in attnzoo.list_models()
                for exporter in ("torchscript", "dynamo")]
    cases = []
    for fam, name in sorted(smallest_per_family().items(), key=lambda item: item[1]):
        cases.append(pytest.param(name, "torchscript", marks=[pytest.mark.floor]
                                  if fam in _FLOOR_FAMILIES else []))
        cases.append(pytest.param(name, "dynamo", marks=[] if fam in _QUICK_DYNAMO_FAMILIES
                                  else [pytest.mark.slow]))
    return cases


def _sizes(cfg):
    """The export's input size and, where the model takes any size, another one: small maps
    (128 px, SAN's least) keep the default tier quick; 128x150 pads NAT's last stages, and its
    width is no multiple of 4, which QnA-ViT's stem pads ('SAME'). A fixed-size model exports
    at its size only."""
    if attnzoo.hub.dynamic_size_refusal(cfg):
        return tuple(cfg["input_size"][1:]), None
    return (128, 128), (128, 150)


def _dynamo_skip_reason():
    if "dynamic_shapes" not in inspect.signature(torch.onnx.export).parameters:
        return (f"torch {torch.__version__}'s torch.onnx.export has no dynamic_shapes: its "
                "dynamo exporter cannot export a dynamic batch")
    if not hasattr(torch.compiler, "is_exporting"):
        return (f"torch {torch.__version__} has no torch.compiler.is_exporting(), by which "
                "attnzoo's ops know a torch.export trace")
    return None


def _onnxruntime_logits(path, x):
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])


def _assert_onnxruntime_matches(path, model, name, inputs):
    """onnxruntime's logits equal the model's within issue 26's 1e-4 at every input."""
    for inp in inputs:
        with torch.no_grad():
            expected = model(inp)
        torch.testing.assert_close(_onnxruntime_logits(path, inp), expected, rtol=0, atol=1e-4,
                                   msg=lambda m: f"{name}, input {list(inp.shape)}: {m}")


@pytest.mark.parametrize("name, exporter", _cases())
def test_model_exports_and_onnxruntime_gives_pytorch_s_logits(name, exporter, tmp_path):
    dynamo = exporter == "dynamo"
    if dynamo and _dynamo_skip_reason():
        pytest.skip(_dynamo_skip_reason())
    torch.manual_seed(0)
    model = timm.create_model(name).eval()
    size, other_size = _sizes(model.pretrained_cfg)
    x = torch.randn(2, 3, *size)
    path = tmp_path / f"{name}.onnx"
    # check=True: onnx.checker.check_model(full_check=True) on the written file; the dynamo
    # exporter writes its own opset (18 and up), the TorchScript one the 17
    with warnings.catch_warnings(record=True) as caught:
        attnzoo._quiet_tracer_warnings()  # as `import attnzoo` did (pytest drops its filters)
        onnx_export(model, str(path), example_input=x, opset=None if dynamo else 17,
                    dynamic_size=other_size is not None, use_dynamo=dynamo, check=True)
    # timm's onnx_export.py shows no warning of attnzoo's own code (its input checks once gave
    # five TracerWarnings per export)
    package = os.path.dirname(attnzoo.__file__)
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if os.path.abspath(w.filename).startswith(package)]
    assert not ours, ours
    graph = onnx.load(str(path)).graph
    assert not any(node.domain.startswith("attnzoo") for node in graph.node)
    inputs = [x, torch.randn(3, 3, *size)]  # the export's batch, then another
    if other_size:
        inputs.append(torch.randn(1, 3, *other_size))
    _assert_onnxruntime_matches(path, model, name, inputs)


# ---------------------------------------------------------------------------------------------
# attnzoo export
# ---------------------------------------------------------------------------------------------

def _run_cli(argv, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_exports_a_checkpoint_s_weights_and_checks_onnxruntime(tmp_path, capsys):
    torch.manual_seed(1)
    checkpoint, out_file = tmp_path / "quest.pth", tmp_path / "quest.onnx"
    state = timm.create_model("quest_vit_tiny_patch16_224").state_dict()
    torch.save(state, checkpoint)
    code, out, err = _run_cli(["export", "quest_vit_tiny_patch16_224", str(out_file),
                               "--checkpoint", str(checkpoint), "--check"], capsys)
    assert code == 0, err
    weights = {t.name: onnx.numpy_helper.to_array(t)
               for t in onnx.load(str(out_file)).graph.initializer}
    np.testing.assert_array_equal(weights["head.weight"], state["head.weight"].numpy())
    diffs = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines()
             if line.startswith("onnxruntime vs PyTorch")]
    assert len(diffs) == 2 and max(diffs) < 1e-4, out  # the export's batch and another


def test_cli_exports_a_fine_tuned_train_py_checkpoint_with_its_head(tmp_path, capsys):
    """A train.py checkpoint of a 2-class fine-tune: export builds the model as train.py did
    (its args: the class count, the model arguments), as attention, convert and publish do."""
    import argparse
    torch.manual_seed(3)
    cut = {k: v for k, v in tiny_models.NAT_MINI_CUT.items() if k != "num_classes"}
    model = timm.create_model("nat_mini", num_classes=2, **cut).eval()
    checkpoint, out_file = tmp_path / "model_best.pth.tar", tmp_path / "ft.onnx"
    args = argparse.Namespace(model="nat_mini", num_classes=2, model_kwargs=cut)
    torch.save({"arch": "nat_mini", "epoch": 3, "state_dict": model.state_dict(), "args": args},
               checkpoint)
    code, out, err = _run_cli(["export", "nat_mini", str(out_file), "--checkpoint",
                               str(checkpoint), "--img-size", "64", "--check"], capsys)
    assert code == 0, err
    session = onnxruntime.InferenceSession(str(out_file), providers=["CPUExecutionProvider"])
    x = torch.randn(1, 3, 64, 64)
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    assert got.shape == (1, 2)
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), atol=1e-4, rtol=1e-4)


def test_cli_rejects_a_checkpoint_that_does_not_fit_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.pth"
    torch.save({"head.weight": torch.zeros(3, 3)}, bad)
    code, out, err = _run_cli(["export", "quest_vit_tiny_patch16_224", str(tmp_path / "a.onnx"),
                               "--checkpoint", str(bad)], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"attnzoo export: error: --checkpoint {bad}: ")


@pytest.mark.parametrize("flags,message", [
    (["--dynamo", "--opset", "11"], "--opset 11: the dynamo exporter writes opsets 18 to "),
    (["--opset", "99"], "--opset 99: the TorchScript exporter writes opsets 7 to ")])
def test_cli_refuses_an_opset_the_exporter_cannot_write(flags, message, tmp_path, capsys):
    out_file = tmp_path / "a.onnx"
    code, out, err = _run_cli(["export", "nat_mini", str(out_file)] + flags, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err
    assert not out_file.exists()


def test_cli_rejects_a_corrupt_checkpoint_in_one_line(tmp_path, capsys):
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"PK\x03\x04 not really a zip archive")
    code, out, err = _run_cli(["export", "nat_mini", str(tmp_path / "a.onnx"),
                               "--checkpoint", str(garbage)], capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith(f"attnzoo export: error: --checkpoint {garbage}: '{garbage}' is not a "
                          "readable torch or safetensors checkpoint (corrupted or truncated?)")


def test_cli_says_in_one_line_why_a_fixed_size_model_has_no_dynamic_size(tmp_path, capsys):
    code, out, err = _run_cli(["export", "quest_vit_tiny_patch16_224", str(tmp_path / "q.onnx"),
                               "--dynamic-size"], capsys)
    assert code == 2
    assert "random weights (nothing is downloaded)" in out  # no --checkpoint
    last = err.strip().splitlines()[-1]
    assert "--dynamic-size" in last and "fixed at 224x224" in last
    assert not (tmp_path / "q.onnx").exists()


def test_cli_says_in_one_line_why_the_exporter_failed(tmp_path, capsys, monkeypatch):
    """An exporter's failure (torch.export wraps the model's own error) is one line naming the
    model, the size and the first cause, not some 300 lines of traceback."""
    import timm.utils.onnx

    def fail(model, path, **kwargs):
        with open(path, "wb") as partial:
            partial.write(b"half an ONNX file")
        try:
            raise ZeroDivisionError("division by zero")
        except ZeroDivisionError as e:
            raise RuntimeError("Failed to export the model with torch.export.\nmany lines") from e

    monkeypatch.setattr(timm.utils.onnx, "onnx_export", fail)
    code, out, err = _run_cli(["export", "nat_mini", str(tmp_path / "n.onnx"), "--img-size",
                               "64"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("attnzoo export: error: nat_mini at 64x64: the TorchScript exporter "
                          "failed: ZeroDivisionError: division by zero; nothing written"), err
    assert not (tmp_path / "n.onnx").exists()


def test_cli_names_the_extra_when_onnx_is_missing(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    code, out, err = _run_cli(["export", "nat_mini", str(tmp_path / "n.onnx"), "--check"], capsys)
    # README "Command line": every mistake is one line, no usage, exit status 2
    assert code == 2 and out == ""
    assert err == ('attnzoo export: error: exporting needs onnxruntime, not installed: '
                   'pip install onnxruntime\n')


def test_cli_rejects_a_size_the_model_cannot_run(tmp_path, capsys):
    code, out, err = _run_cli(["export", "san10_pairwise", str(tmp_path / "s.onnx"),
                               "--img-size", "64"], capsys)
    assert code == 2 and "--img-size 64" in err.strip().splitlines()[-1]


def test_model_cards_say_whether_a_model_exports_with_a_dynamic_size():
    for name, dynamic in (("nat_mini", True), ("quest_vit_tiny_patch16_224", False)):
        line = attnzoo.hub.export_line(timm.create_model(name, device="meta").pretrained_cfg)
        assert ("--dynamic-size" in line) is dynamic, line


# NAT_MINI_CUT as --model-kwargs: nat_mini cut to 5 blocks of 16-32 channels, which exports in
# about a second; KEY=repr(VALUE) is what the command parses back
_TINY_NAT_KWARGS = [f"{key}={value!r}" for key, value in tiny_models.NAT_MINI_CUT.items()]


def _tiny_nat_checkpoint(path, seed):
    torch.manual_seed(seed)
    model = timm.create_model("nat_mini", **tiny_models.NAT_MINI_CUT).eval()
    torch.save(model.state_dict(), path)
    return model


def test_cli_exports_a_dynamic_size_at_an_opset_that_onnxruntime_runs_at_other_sizes(
        tmp_path, capsys):
    checkpoint, out_file = tmp_path / "nat.pth", tmp_path / "nat.onnx"
    model = _tiny_nat_checkpoint(checkpoint, seed=2)
    code, out, err = _run_cli(["export", "nat_mini", str(out_file), "--checkpoint",
                               str(checkpoint), "--img-size", "64", "--dynamic-size", "--opset",
                               "16", "--check", "--model-kwargs", *_TINY_NAT_KWARGS], capsys)
    assert code == 0, err
    assert "at 64x64 with the TorchScript exporter, dynamic batch and size" in out
    # --check ran the export's input, another batch and size (64 + 32) and the smallest size,
    # where the last maps are 1x1
    checked = [line for line in out.splitlines() if line.startswith("onnxruntime vs PyTorch")]
    assert [line.split(":")[0] for line in checked] == [
        "onnxruntime vs PyTorch, input [2, 3, 64, 64]",
        "onnxruntime vs PyTorch, input [3, 3, 96, 96]",
        "onnxruntime vs PyTorch, input [3, 3, 32, 32]"], out
    opsets = {o.domain: o.version for o in onnx.load(str(out_file)).opset_import}
    assert opsets[""] == 16
    # a size --check did not try, not square, with the last stage (3x4) below the 7x7 window
    x = torch.randn(1, 3, 80, 112)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(_onnxruntime_logits(out_file, x), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("offset", [3e-4, math.nan], ids=["above-tolerance", "nan"])
def test_cli_check_exits_1_in_one_line_when_onnxruntime_differs_from_pytorch(
        offset, tmp_path, capsys, monkeypatch):
    real = onnxruntime.InferenceSession

    class Drifting(real):  # what a wrong export formula would give: logits off by ``offset``
        def run(self, *args, **kwargs):
            outputs = super().run(*args, **kwargs)
            outputs[0] = outputs[0] + np.float32(offset)
            return outputs

    monkeypatch.setattr(onnxruntime, "InferenceSession", Drifting)
    checkpoint, out_file = tmp_path / "nat.pth", tmp_path / "nat.onnx"
    _tiny_nat_checkpoint(checkpoint, seed=3)
    code, out, err = _run_cli(["export", "nat_mini", str(out_file), "--checkpoint",
                               str(checkpoint), "--img-size", "64", "--check",
                               "--model-kwargs", *_TINY_NAT_KWARGS], capsys)
    assert code == 1
    assert len([line for line in out.splitlines() if "largest difference" in line]) == 2, out
    worst = "nan" if math.isnan(offset) else "3.0"
    assert err.count("\n") == 1 and err.startswith(
        f"attnzoo export: FAILED: {out_file} differs from PyTorch by {worst}"), err
    assert err.rstrip().endswith("above the tolerance 1e-04"), err


# ---------------------------------------------------------------------------------------------
# graph size
# ---------------------------------------------------------------------------------------------

def _onnx_op_counts(model, size):
    """ONNX op type -> nodes of ``model``'s TorchScript export (opset 17, dynamic batch and
    size, the exporter's constant folding on, as timm's onnx_export runs it)."""
    buffer, x = io.BytesIO(), torch.randn(2, 3, size, size)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(model, (x,), buffer, dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": [0, 2, 3]})
    return collections.Counter(node.op_type for node in onnx.load_from_string(
        buffer.getvalue()).graph.node)


# family -> (build(kernel size, blocks in one stage), input size): the tiny models of
# tests/tiny_models.py, one stage's depth varied and cut to what the property needs (about a
# second an export): NAT without dilation (its export formula differs between d = 1 and d > 1),
# QnA-ViT without its window-attention blocks, which have no kernel
_GRAPH_SIZE_MODELS = {
    "nat": (lambda k, depth: tiny_models.nat(kernel_size=k, depths=(1, depth, 1, 1),
                                             dilations=None), 32),
    "qna_vit": (lambda k, depth: tiny_models.qna_vit(kernel_size=k, qna_depths=(1, depth, 0, 0),
                                                     lsa_depths=(0, 0, 0, 0)), 64),
    "san": (lambda k, depth: tiny_models.san_small(kernel_sizes=k, depths=(1, depth, 1, 1, 1)),
            128),
}


@pytest.mark.parametrize("family", list(_GRAPH_SIZE_MODELS))
def test_the_exported_graph_grows_with_depth_not_with_the_kernel(family):
    build, size = _GRAPH_SIZE_MODELS[family]
    counts = {(k, depth): _onnx_op_counts(build(k, depth), size)
              for k, depth in ((3, 1), (7, 1), (3, 2))}
    # the same graph, op by op, for 9 and 49 taps: no node per tap
    assert counts[7, 1] == counts[3, 1]
    # one block more: more nodes, and no fewer of any op type
    grown = counts[3, 2] - counts[3, 1]
    assert sum(grown.values()) > 0 and not counts[3, 1] - counts[3, 2], grown


# ---------------------------------------------------------------------------------------------
# timm's own onnx_export.py, from a timm checkout
# ---------------------------------------------------------------------------------------------

def _timm_script_cases():
    """Each family's smallest model with each exporter, and with ``--dynamic-size`` where the
    family allows it."""
    cases = []
    for fam, name in sorted(smallest_per_family().items()):
        cfg = timm.create_model(name, device="meta").pretrained_cfg
        sizes = (False,) if attnzoo.hub.dynamic_size_refusal(cfg) else (False, True)
        for dynamo in (False, True):
            for size in sizes:
                flags = ["--dynamo"] * dynamo + ["--dynamic-size"] * size
                kind = ["dynamo" if dynamo else "torchscript"] + ["dynamic-size"] * size
                cases.append(pytest.param(name, flags, id="-".join([name] + kind)))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("name, flags", _timm_script_cases())
def test_timm_s_onnx_export_py_checks_the_forward_from_a_timm_checkout(name, flags, tmp_path):
    checkout = os.environ.get("ATTNZOO_TIMM_CHECKOUT")
    if not checkout:
        pytest.skip("set ATTNZOO_TIMM_CHECKOUT to a timm clone to run its onnx_export.py")
    torch.manual_seed(0)
    model = timm.create_model(name).eval()
    checkpoint, out_file = tmp_path / f"{name}.pth", tmp_path / f"{name}.onnx"
    torch.save(model.state_dict(), checkpoint)  # no --checkpoint: timm's script downloads
    size, other_size = _sizes(model.pretrained_cfg)
    proc = subprocess.run(
        [sys.executable, "-m", "attnzoo", "timm", "onnx_export.py", str(out_file), "-m", name,
         "--checkpoint", str(checkpoint), "--img-size", str(size[0]), *flags,
         "--check-forward"], cwd=checkout, capture_output=True, text=True, timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "2"})
    # --check-forward: onnxruntime's logits equal PyTorch's to 3 decimals, or it raises
    assert proc.returncode == 0, proc.stderr[-3000:]
    inputs = [torch.randn(3, 3, *size)]  # another batch than the script's 1
    if "--dynamic-size" in flags:
        inputs.append(torch.randn(1, 3, *other_size))
    _assert_onnxruntime_matches(out_file, model, name, inputs)


def test_qna_vit_s_blocks_export_on_rows_through_the_dynamo_exporter(tmp_path):
    """QnA-ViT's blocks on rows while exporting (QnA and the window attention gather their
    windows from the batch's rows): the dynamo exporter's decompositions take them (they made
    the reshape after the window attention a view, which its strides refuse) and onnxruntime
    equals the model at other batches and sizes, the windows padded or not."""
    if _dynamo_skip_reason():
        pytest.skip(_dynamo_skip_reason())
    model = tiny_models.qna_vit(**tiny_models.QNA_VIT_TWO_STAGES)  # a QnA block, then an LSA one
    path = tmp_path / "qna_vit.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        onnx_export(model, str(path), example_input=torch.randn(2, 3, 64, 64), dynamic_size=True,
                    use_dynamo=True, check=False)
    _assert_onnxruntime_matches(path, model, "tiny qna_vit", [
        torch.randn(1, 3, 64, 64), torch.randn(3, 3, 45, 77), torch.randn(1, 3, 96, 40)])
    graph = onnx.shape_inference.infer_shapes(onnx.load(str(path))).graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in graph.value_info}
    norms = [ranks[node.input[0]] for node in graph.node if node.op_type == "LayerNormalization"]
    assert norms.count(2) == 2 * 2, norms  # the two blocks' norms take rows
