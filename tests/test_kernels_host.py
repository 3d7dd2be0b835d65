"""The kernels' host path (issue 46): an eager call runs the host code through a plain
``autograd.Function`` (no custom-op dispatch; torch.compile still sees the custom ops:
tests/test_kernels_compile.py), a warm call key redoes nothing that depends only on the key, an
untuned choice made where tuning cannot happen (tracing, CUDA-graph capture) is not kept, and
scripts/bench_host.py runs."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo import kernels

if kernels.triton_missing():  # an optional dependency; its reason is shown (-ra)
    pytest.skip(kernels.triton_missing(), allow_module_level=True)

from attnzoo.kernels import neighborhood as kn  # noqa: E402
from kernel_checks import DispatchedOps  # noqa: E402
from attnzoo.ops import na2d, na2d_qkv, qna2d, san_aggregation, san_subtraction2  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.interpreter
ROOT = Path(__file__).resolve().parents[1]


def _leaves(*shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(DEVICE).requires_grad_() for s in shapes]


CALLS = {
    "na2d": (lambda q, k, v, rpb: na2d(q, k, v, kernel_size=3, rpb=rpb, backend="cuda"),
             [(1, 5, 6, 2, 4)] * 3 + [(2, 5, 5)]),
    "na2d_qkv": (lambda qkv, rpb: na2d_qkv(qkv, kernel_size=3, rpb=rpb, backend="cuda"),
                 [(1, 5, 6, 3, 2, 4), (2, 5, 5)]),
    "qna2d": (lambda logits, v: qna2d(logits, v, kernel_size=3, stride=2, backend="cuda"),
              [(1, 5, 6, 2, 3), (1, 5, 6, 3, 4)]),
    "san_subtraction2": (lambda a, b: san_subtraction2(a, b, kernel_size=3, backend="cuda"),
                         [(1, 2, 5, 6)] * 2),
    "san_aggregation": (lambda x, w: san_aggregation(x, w, kernel_size=3, backend="cuda"),
                        [(1, 4, 5, 6), (1, 2, 9, 30)]),
}


@pytest.mark.parametrize("op", CALLS)
def test_an_eager_call_runs_the_kernels_without_the_custom_op(op):
    fn, shapes = CALLS[op]
    inputs = _leaves(*shapes)
    with DispatchedOps() as seen:
        out = fn(*inputs)
        torch.autograd.grad(out.square().sum(), inputs)
    assert not [n for n in seen.names if n.startswith("attnzoo.")], seen.names


@pytest.mark.parametrize("op", CALLS)
def test_direct_launches_give_what_tritons_launches_give(op):
    """A warm call with attnzoo's direct launches and one through Triton's JITFunction.run at
    every launch: the same outputs and gradients, bitwise. On a GPU every kernel then has
    direct launchers (tests/test_kernels_launch.py compares the launches themselves on a
    simulated GPU); interpreted kernels always launch through Triton's interpreter."""
    fn, shapes = CALLS[op]
    inputs = _leaves(*shapes)
    results = []
    for direct in (False, True, True):
        previous = kernels.direct_launches(direct)
        try:
            out = fn(*inputs)
            results.append([out, *torch.autograd.grad(out.square().sum(), inputs)])
        finally:
            kernels.direct_launches(previous)
    for a, b in zip(results[0], results[2]):
        assert torch.equal(a, b)
    direct = [kernel for kernel, launched in kernels._direct_kernels.values() if launched]
    assert bool(direct) == torch.cuda.is_available()
    assert bool(kernels._launchers) == torch.cuda.is_available()


@pytest.mark.parametrize("version, direct", [("3.3.1", False), ("3.4.0", True),
                                              ("3.8.0", True), ("3.9.0", False)])
def test_direct_launches_keep_to_the_tritons_whose_launch_was_read(monkeypatch, version,
                                                                   direct):
    """A compiled kernel launches directly on Triton 3.4 to 3.8 only (kernels._DIRECT_TRITON);
    deciding so on another Triton imports nothing it may lack (3.3 has no ``triton.knobs``)."""
    import sys
    import triton
    monkeypatch.setattr(kernels, "_interpreted", lambda: False)
    monkeypatch.setattr(kernels, "_direct_kernels", {})
    monkeypatch.setattr(kernels, "triton_version", lambda: version)
    if not direct:
        monkeypatch.delattr(triton, "knobs")
        monkeypatch.setitem(sys.modules, "triton.knobs", None)  # importing it fails
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def probe(x):
        pass

    compiled = triton.jit(probe)  # a JITFunction (the interpreter is off for this test)
    assert kernels._direct_kernel(compiled) is direct
    assert kernels._direct_kernel(kn._na_fwd_kernel) is False  # interpreted: never direct


@pytest.mark.parametrize("op", CALLS)
def test_a_double_backward_through_the_kernels_raises(op):
    """The kernels' gradients have no graph of their own: a loss with a gradient penalty
    through them is an error, not a penalty silently taken as a constant."""
    fn, shapes = CALLS[op]
    inputs = _leaves(*shapes)
    out = fn(*inputs)
    grads = torch.autograd.grad(out.square().sum(), inputs, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (out.sum() + sum(g.square().sum() for g in grads)).backward()


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("shape", [(2, 3, 4), (3, 1, 5), (2, 0, 3), (0,), ()])
def test_an_allocation_is_a_new_contiguous_tensor_each_call(shape, device):
    alloc = kernels.allocation(shape, torch.float16, torch.device(device))
    a, b = alloc(), alloc()
    like = torch.empty(shape)  # torch's own contiguous strides (a 0-size dim counts as 1)
    for t in (a, b):
        assert (t.shape, t.stride(), t.dtype, t.device.type) == (
            like.shape, like.stride(), torch.float16, device)
    assert device == "meta" or a.numel() == 0 or a.data_ptr() != b.data_ptr()


@pytest.mark.parametrize("op", CALLS)
def test_a_warm_call_allocates_only_through_empty_strided(op):
    """The host code's tensors come from allocations bound once per call key
    (kernels.allocation): no ``new_empty`` or ``empty_like``, whose meta functions are Python
    (5-6 us a tensor where launches are captured on meta), and every output and input gradient
    is contiguous. (Launches captured: the interpreter allocates as it runs them.)"""
    fn, shapes = CALLS[op]
    inputs = _leaves(*shapes)
    torch.autograd.grad(fn(*inputs).sum(), inputs)  # the key warm
    with kernels.capture_launches(arguments=False), DispatchedOps() as seen:
        out = fn(*inputs)
        grads = torch.autograd.grad(out.square().sum(), inputs)
    allocations = {n for n in seen.names if "empty" in n}
    assert allocations <= {"aten.empty_strided.default", "aten.empty.memory_format"}, allocations
    assert "aten.empty_strided.default" in allocations
    assert all(t.is_contiguous() for t in (out, *grads))


def test_a_warm_key_plans_nothing_again(monkeypatch):
    plans = []
    plan = kn._plan
    monkeypatch.setattr(kn, "_plan", lambda *args: plans.append(args[0]) or plan(*args))
    q, k, v, rpb = _leaves((1, 6, 5, 2, 4), (1, 6, 5, 2, 4), (1, 6, 5, 2, 4), (2, 5, 5))
    for _ in range(3):
        out = na2d(q, k, v, kernel_size=3, rpb=rpb, backend="cuda")
        torch.autograd.grad(out.sum(), (q, k, v, rpb))
    assert sorted(plans) == ["dkdv", "dq", "fwd"]  # the first call's three kernels, once each


@pytest.mark.parametrize("op", ["na2d", "na2d_qkv"])
def test_a_call_looks_up_its_plans_once_and_launches_them_positionally(op, monkeypatch):
    """A call's forward looks its key's plans up and hands them to its backward; each launch
    passes the kernel's arguments positionally, its options (warps, stages) by keyword."""
    lookups, keywords = [], []
    call_plans, run = kn._call_plans, kn._run
    monkeypatch.setattr(kn, "_call_plans", lambda *a: lookups.append(1) or call_plans(*a))
    monkeypatch.setattr(kn, "_run", lambda kernel, grid, *a, **kw: keywords.append(sorted(kw))
                        or run(kernel, grid, *a, **kw))
    fn, shapes = CALLS[op]
    inputs = _leaves(*shapes)
    for _ in range(2):
        out = fn(*inputs)
        torch.autograd.grad(out.sum(), inputs)
    assert len(lookups) == 2  # one per call, forward and backward
    assert keywords[-3:] == [["num_stages", "num_warps", "warmup"]] * 3


def test_an_untuned_choice_is_kept_only_where_no_call_will_tune(monkeypatch):
    """Where tuning will happen on a later call (compiled kernels) but cannot now (tracing,
    capturing a CUDA graph), the default configuration runs and is not kept: the next call
    plans again, and tunes."""
    plans, tuned = [], []
    plan = kn._plan
    monkeypatch.setattr(kn, "_plan", lambda *args: plans.append(args[0]) or plan(*args))
    monkeypatch.setattr(kn, "will_tune", lambda device: True)
    monkeypatch.setattr(kn, "can_tune", lambda device: False)
    q = _leaves((1, 7, 6, 1, 8))[0].detach()
    for _ in range(2):
        na2d(q, q, q, kernel_size=3, backend="cuda")
    assert plans == ["fwd", "fwd"]
    monkeypatch.setattr(kn, "can_tune", lambda device: True)
    monkeypatch.setattr(kn, "tuning_scope", lambda device: "simulated")
    monkeypatch.setattr(kn._TUNER, "choose", lambda key, space, launch, tune, scope, device: (
        tuned.append(key), kn._TUNER.best.setdefault(key, space[0]))[1])
    for _ in range(2):
        na2d(q, q, q, kernel_size=3, backend="cuda")
    assert plans == ["fwd"] * 3 and len(tuned) == 1


def test_bench_host_runs_its_tables(capsys, tmp_path):
    from attnzoo.kernels import qna, san
    checks = [module.support for module in (kn, qna, san)]
    spec = importlib.util.spec_from_file_location("bench_host", ROOT / "scripts" / "bench_host.py")
    bench_host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_host)
    assert bench_host.main(["--number", "4", "--repeat", "1", "--steps", "--models", "nat_mini",
                            "--batch", "1", "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    assert "| na2d_qkv nat_tiny s3 7x7 h16 k7 rpb | fwd+bwd |" in out
    assert "glibc's malloc keeping freed memory" in out  # (this machine's C library)
    row = next(line for line in out.splitlines() if line.startswith("| nat_mini |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 14 and float(cells[5]) > 0 and float(cells[8]) > 0  # meta, narrow ms
    assert int(cells[2]) >= int(cells[3])  # copies on meta and narrow
    # the same step with meta functions at a GPU host's cost (a process of its own): its ops
    # the same but for clones of LayerNorm's gradients (meta's Python gives other strides),
    # its time well under the Python meta functions' (LayerNorm's alone some 3 ms each way)
    [step] = json.loads((tmp_path / "rows.json").read_text())["steps"]
    assert step["ops"] == int(cells[1]) and 0 <= step["ops"] - step["shape_ops"] <= 10, step
    assert 0 < step["shape_ms"] < 0.7 * step["ms"] and float(cells[6]) > 0, step
    # and there with each NA call at its floor (its allocations in an autograd.Function)
    assert 0 < step["na_floor_ms"] < step["shape_ms"] and float(cells[7]) > 0, step
    # the script told every support check yes while it measured only
    assert [module.support for module in (kn, qna, san)] == checks


def test_launches_captured_without_arguments_keep_no_tensor():
    """bench_host's capture: ``arguments=False`` records each launch's kernel and grid only,
    keeping no tensor alive, as a launch on a GPU: the rpb's gradient is then autograd's own
    (stolen into ``.grad``, not copied, as in a real training step)."""
    q, k, v = (torch.empty(1, 6, 5, 2, 4, device="meta", requires_grad=True) for _ in range(3))
    rpb = torch.nn.Parameter(torch.empty(2, 5, 5, device="meta"))
    with kernels.capture_launches(arguments=False) as launches, DispatchedOps() as seen:
        kn.na_fused(q, k, v, (3, 3), (1, 1), rpb, 0.5).sum().backward()
    assert [launch[0] for launch in launches] == [
        kn._na_fwd_kernel, kn._na_bwd_dq_kernel, kn._na_bwd_dkdv_kernel]
    assert all(launch[2:] == ((), {}) for launch in launches)
    assert rpb.grad is not None and not [n for n in seen.names if "copy" in n], seen.names
    with kernels.capture_launches() as launches:  # the default keeps them (compile_kernels.py)
        kn.na_fused(q, k, v, (3, 3), (1, 1), rpb, 0.5)
    assert launches[0][2][0] is q


class _HostTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """The ATen ops that take or make a tensor off the meta device (a host tensor, a copy
    between host and device)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_flatten((args, kwargs, out))[0]
        if any(isinstance(t, torch.Tensor) and t.device.type != "meta" for t in flat):
            self.ops.append(func.__name__)
        return out


# the launches of a step: NAT's 18 blocks launch 3 kernels each (forward, backward's dq and dk dv)
@pytest.mark.parametrize("name, launches", [
    ("nat_mini", 3 * 18), ("dinat_mini", 3 * 18), ("qna_vit_tiny", 30),
    ("san10_pairwise", 70), ("san10_patchwise", 30)])
def test_an_eager_training_step_on_the_kernels_leaves_the_device_only_to_launch(
        name, launches):
    """Issue 46: no host-device synchronisation in a training step. A training step of each
    family's registered model on the ``cuda`` backend, on meta tensors with the launches
    captured (meta stands for the GPU: a read of a value back to the host, ``.item()`` or a
    tensor's truth, raises on meta): every one of its NA, QnA or SAN layers launches the kernels
    each way, and no op takes or makes a host tensor (no copy between host and device). On a
    GPU, gpu_verify's bench runs the step under ``torch.cuda.set_sync_debug_mode("error")``."""
    import timm
    with torch.device("meta"):
        model = timm.create_model(name).train()
    x = torch.empty(2, 3, 224, 224, device="meta")
    # (meta tensors are not CUDA tensors: the support checks told yes)
    with kernels.supported_anywhere(), attnzoo.use_backend("cuda"), \
            kernels.capture_launches(arguments=False) as launched:
        for _ in range(2):  # the second: warm call keys
            launched.clear()
            model.zero_grad(set_to_none=True)
            with _HostTensors() as host:
                model(x).logsumexp(-1).mean().backward()
            assert not host.ops, host.ops
            assert len(launched) == launches
