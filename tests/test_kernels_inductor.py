"""torch.compile and the kernels on torch >= 2.6: each pass is a ``torch.library.triton_op``
(:class:`attnzoo.kernels.KernelOp`) whose host code AOT autograd runs on the trace's fake CUDA
tensors, so that Inductor sees every kernel launch and launches it from its own wrapper (no
attnzoo Python per call in a compiled model). Checked without a GPU in a process of its own
without TRITON_INTERPRET (tests/inductor_launches.py: the joint graphs, Inductor's compile of
each pass for a simulated sm90 GPU, and each family's compiled training step as Inductor
compiles it for CUDA graphs); the compiled steps' numbers are tests/test_kernels_compile.py's
(on a GPU, through these kernel calls)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnzoo import kernels

ROOT = Path(__file__).resolve().parents[1]

if kernels.triton_missing():  # an optional dependency; its reason is shown (-ra)
    pytest.skip(kernels.triton_missing(), allow_module_level=True)
if not kernels.inductor_launches():
    pytest.skip(f"torch {torch.__version__} has no torch.library.triton_op (torch >= 2.6): "
                "each pass is one opaque custom op", allow_module_level=True)

FAMILIES = ["na2d_qkv", "dinat", "qna2d", "san_aggregation", "san_subtraction2"]
# na2d_qkv's eager backward writes dq, dk and dv into one packed gradient (their strides); a
# trace's backward returns them apart, for the graph's unbind backward to join
PACKED_GRADIENTS = ("sdq", "sdk", "sdv")


@pytest.fixture(scope="module")
def findings() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "inductor_launches.py")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_compiled_training_call_launches_what_the_eager_call_launches(findings, family):
    """The forward and backward graphs AOT autograd traces hold the family's kernels as
    Inductor's kernel calls, no attnzoo op, and launch what the eager host code launches for
    the same call: kernel, grid, num_warps and num_stages, every argument but tensors (the
    graph's values), one by one."""
    joint = findings["joint"][family]
    forward, backward = joint["graphs"]
    assert forward["ops"] == backward["ops"] == []
    traced = forward["kernels"] + backward["kernels"]
    assert len(forward["kernels"]) == 1 and len(traced) == len(joint["eager"]) >= 2
    for got, want in zip(traced, joint["eager"]):
        if family in ("na2d_qkv", "dinat"):
            for args in (got["args"], want["args"]):
                for name in [n for n in args if n.startswith(PACKED_GRADIENTS)]:
                    del args[name]
        assert got == want


def test_a_symbolic_batch_keeps_to_the_opaque_ops(findings):
    """A call with a symbolic batch size (torch.compile's recompilation for another one),
    traced as the static call of the joint test is (which has no attnzoo op): the host code
    keys its plans by static sizes, so the trace keeps the opaque custom ops."""
    assert findings["dynamic"] == dict(ops=["attnzoo.na_fused.default",
                                            "attnzoo.na_fused_backward.default"], kernels=[])
    assert findings["joint"]["na2d_qkv"]["graphs"][0]["kernels"]


@pytest.mark.parametrize("label", [f"{family} {step}" for family in FAMILIES
                                   for step in ("forward", "backward") if family != "dinat"
                                   or step == "forward"])
def test_inductor_compiles_each_pass_for_sm90(findings, label):
    """Inductor generates the wrapper and compiles the kernels' source for sm90 (its own copy
    of them: the scales, which it passes as fp64, are cast in the kernels)."""
    compiled = findings["inductor"][label]
    assert compiled["result"] == "ok"
    [graph] = compiled["graphs"]
    assert graph["compiled"] and graph["ops"] == [] and graph["kernels"]


def test_a_trace_tunes_its_call_on_real_tensors(monkeypatch):
    """A traced NA call that a run would tune is tuned while tracing: the host code runs once
    on real tensors of the traced ones' sizes, strides and dtypes, outside the trace, with
    tuning allowed (torch.compile's trace counts as compiling)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    seen = []

    def impl(x, n):
        seen.append(dict(kind=type(x).__name__, shape=tuple(x.shape), stride=x.stride(),
                         dtype=x.dtype, finite=bool(x.isfinite().all()), n=n,
                         tune=kernels.can_tune(torch.device("cuda"))))
    monkeypatch.setattr(kernels, "will_tune", lambda device: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(kernels, "_TUNING_DEVICE", "cpu")  # (no GPU here)
    with FakeTensorMode():
        x = torch.empty(4, 3, 2, dtype=torch.bfloat16).transpose(0, 1)[:, :3].expand(2, 3, 3, 2)
    kernels.tune_for_trace(impl, (x, 7))
    assert seen == [dict(kind="Tensor", shape=(2, 3, 3, 2), stride=x.stride(),
                         dtype=torch.bfloat16, finite=True, n=7, tune=True)]
    assert not kernels.can_tune(torch.device("cuda"))  # (compiling again, once done)

    monkeypatch.setattr(kernels, "will_tune", lambda device: False)  # ATTNZOO_AUTOTUNE=0, ...
    kernels.tune_for_trace(impl, (x, 7))
    assert len(seen) == 1

    # per thread: another thread's trace, tuning meanwhile, neither sees nor resets this one's
    import threading
    monkeypatch.setattr(kernels, "will_tune", lambda device: True)
    inside, release, other = threading.Event(), threading.Event(), []

    def slow(x, n):
        inside.set()
        release.wait(5)
        other.append(kernels.can_tune(torch.device("cuda")))
    thread = threading.Thread(target=kernels.tune_for_trace, args=(slow, (x, 7)))
    thread.start()
    inside.wait(5)
    assert not kernels.can_tune(torch.device("cuda"))
    release.set()
    thread.join(5)
    assert other == [True] and not kernels.can_tune(torch.device("cuda"))


CUDAGRAPH_STEPS = ["nat", "qna_vit", "san_pairwise", "san_patchwise"]


@pytest.mark.parametrize("model", CUDAGRAPH_STEPS)
def test_a_compiled_training_step_is_one_cuda_graph_each_way(findings, model):
    """``torch.compile(model, mode="reduce-overhead")`` on the kernels, as far as it goes
    without a GPU: a tiny model of each family (NAT with DiNAT's dilation) compiled for
    training (fullgraph: no graph break) and its forward and backward graphs compiled by
    Inductor for CUDA graphs. Each graph launches the kernels itself, with no opaque op, and is
    one partition that a CUDA graph captures: nothing skips it (no host tensor, no
    synchronising or CUDA-graph-unsafe op, no mutated input that is not a buffer)."""
    forward, backward = findings["cudagraphs"][model]
    for graph in (forward, backward):
        assert "error" not in graph, graph["error"]
        assert graph["ops"] == [] and graph["kernels"]
        assert graph["disabled"] is None and graph["fail_reasons"] == []
        [[partition]] = graph["partitions"]
        assert partition["cudagraph"] and partition["reasons"] == [] and graph["cudagraphs"]


def test_the_cuda_graph_check_sees_what_a_cuda_graph_cannot_capture(findings):
    """The check's control: a step that copies a CPU buffer to the device gets a partition
    that no CUDA graph captures, for that copy (so the check above can fail)."""
    forward, backward = findings["cudagraphs"]["control"]
    assert [p["reasons"] for p in forward["partitions"][0] if not p["cudagraph"]] == [
        ["DeviceCopy ops"]]
    assert all(p["cudagraph"] for p in backward["partitions"][0])
