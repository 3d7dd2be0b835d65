"""Run by tests/test_kernels_inductor.py in a process of its own, without TRITON_INTERPRET
(``wrap_triton`` takes compiled kernels, not interpreted ones), on torch >= 2.6: each family's
passes as torch.compile (Dynamo, then AOT autograd) traces them, through the kernels'
``triton_op`` (:class:`attnzoo.kernels.KernelOp`), and those graphs compiled by Inductor for a
simulated sm90 GPU (scripts/simulated_gpu.py, with torch's CUDA queries answered as an H100's).
Nothing runs on a device. Prints one JSON object of findings:

* ``joint``: per family, the forward and backward graphs of a compiled training call: their
  kernel calls (``triton_kernel_wrapper_functional`` nodes: kernel, grid, num_warps,
  num_stages, the other arguments, tensors as ``"tensor"``) and the attnzoo ops left in them;
  and the launches the eager path captures for the same call (``capture_launches``);
* ``dynamic``: the attnzoo ops of a call compiled with a symbolic batch size;
* ``inductor``: per family and pass, Inductor's compile of the pass's graph on fake CUDA
  tensors: ``ok`` or its error's last line, and the graph's kernels;
* ``cudagraphs``: per tiny model of each family (and a control that copies a host tensor in),
  its compiled training step's forward and backward graphs as Inductor compiles them for
  ``mode="reduce-overhead"``: the attnzoo ops and kernel calls left in them, why CUDA graphs
  would be skipped (none, or Inductor's reasons) and the graph's partitions (nodes,
  whether each is captured into a CUDA graph, and why not).
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from functorch.compile import aot_function  # noqa: E402
from simulated_gpu import simulated_gpu  # noqa: E402
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

from attnzoo import kernels  # noqa: E402
from attnzoo.kernels import neighborhood, qna, san  # noqa: E402
from attnzoo.ops import na2d_qkv, qna2d, san_aggregation, san_subtraction2  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
import tiny_models  # noqa: E402

H100 = kernels.DeviceInfo("NVIDIA H100", (9, 0), 232448)


def calls(device: str):
    """Per family, ``make()``: its leaves (a training call's inputs) and ``call(*leaves)``."""
    def new(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=device)
    return {
        "na2d_qkv": (lambda: (new(2, 9, 9, 3, 2, 16), new(2, 5, 5)),
                     lambda qkv, rpb: na2d_qkv(qkv, kernel_size=3, rpb=rpb, backend="cuda")),
        "dinat": (lambda: (new(1, 12, 12, 3, 2, 16, dtype=torch.bfloat16), new(2, 5, 5)),
                  lambda qkv, rpb: na2d_qkv(qkv, kernel_size=3, dilation=2, rpb=rpb,
                                            backend="cuda")),
        "qna2d": (lambda: (new(1, 6, 6, 2, 2), new(1, 6, 6, 2, 8), new(2, 2, 3, 3),
                           new(2, 2, 3, 3)),
                  lambda logits, v, rpb, ws: qna2d(logits, v, kernel_size=3, rpb=rpb,
                                                   window_weights=ws, backend="cuda")),
        "san_aggregation": (lambda: (new(1, 8, 6, 6), new(1, 4, 9, 36)),
                            lambda x, w: san_aggregation(x, w, kernel_size=3, backend="cuda")),
        "san_subtraction2": (lambda: (new(1, 4, 6, 6), new(1, 4, 6, 6)),
                             lambda x1, x2: san_subtraction2(x1, x2, kernel_size=3,
                                                             backend="cuda")),
    }


def kernel_name(kernel) -> str:
    while isinstance(kernel, Autotuner):
        kernel = kernel.fn
    return kernel.fn.__name__


def graph_kernels(gm) -> dict:
    """The kernel calls of a traced graph, and the attnzoo ops left in it."""
    found, ops = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if "triton_kernel_wrapper" in str(node.target):
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            options = {}
            if isinstance(kernel, Autotuner):  # (wrap_triton's home for num_warps, num_stages)
                config = kernel.configs[0]
                options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
            args = {**node.kwargs["kwargs"],
                    **kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])}
            found.append(dict(kernel=kernel_name(kernel), grid=list(node.kwargs["grid"][0]),
                              options=options, args=described(args)))
        elif str(node.target).startswith("attnzoo."):
            ops.append(str(node.target))
    return dict(kernels=found, ops=ops)


def described(args: dict) -> dict:
    return {name: "tensor" if isinstance(a, (torch.Tensor, torch.fx.Node)) else a
            for name, a in args.items()}


def captured(make, call) -> list:
    """The launches of the eager path on meta tensors, forward and backward."""
    leaves = [t.requires_grad_() for t in make()]
    with kernels.capture_launches() as launches:
        out = call(*leaves)
        out.backward(torch.empty_like(out))  # (contiguous, as a trace's tangent)
    found = []
    for kernel, grid, args, kwargs in launches:
        named = kernels.launch_arguments(kernel, args, kwargs)
        options = {k: named.pop(k) for k in ("num_warps", "num_stages") if k in named}
        options.setdefault("num_stages", 3)  # (Triton's default, which wrap_triton writes)
        found.append(dict(kernel=kernel.fn.__name__, grid=list(grid) + [1] * (3 - len(grid)),
                          options=options, args=described(named)))
    return found


def check_joint() -> dict:
    """Compiled (Dynamo, then AOT autograd) on meta tensors (the autograd engine wants a real
    device for CUDA ones), traced as CUDA ones are."""
    found = {}
    for name, (make, call) in calls("meta").items():
        graphs = compiled_call(make, call)
        found[name] = dict(graphs=graphs, eager=captured(make, call))
    return found


def compiled_call(make, call, dynamic_batch: bool = False) -> list:
    """The graphs of a compiled training call on meta tensors (made by ``make``), traced as
    CUDA ones are; ``dynamic_batch``: with a symbolic batch size."""
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def keep(gm, inputs):
        graphs.append(graph_kernels(gm))
        return gm
    torch._dynamo.reset()
    leaves = [t.requires_grad_() for t in make()]
    if dynamic_batch:
        torch._dynamo.mark_dynamic(leaves[0], 0)
    train_as_cuda(call, leaves, aot_autograd(fw_compiler=keep, bw_compiler=keep))
    return graphs


def train_as_cuda(fn, inputs, backend) -> None:
    """``fn(*inputs)`` compiled with ``backend`` (fullgraph) and its backward run, on meta
    tensors traced as CUDA ones are."""
    kernels._INDUCTOR_DEVICES = ("cuda", "meta")
    try:
        out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
        out.backward(torch.empty_like(out))
    finally:
        kernels._INDUCTOR_DEVICES = ("cuda",)


def check_dynamic() -> dict:
    """A call compiled with a symbolic batch size (as torch.compile recompiles for another
    one), traced as a CUDA one: it keeps to the opaque ops (the host code keys its plans by
    static sizes)."""
    make, call = calls("meta")["na2d_qkv"]
    graphs = compiled_call(make, call, dynamic_batch=True)
    return dict(ops=sorted({op for graph in graphs for op in graph["ops"]}),
                kernels=[k["kernel"] for graph in graphs for k in graph["kernels"]])


def simulated_cuda():
    """torch's CUDA queries that Inductor's compile makes, answered as an H100's (only the
    compile runs: nothing is launched)."""
    from torch._dynamo import device_interface
    from torch._inductor.runtime import triton_heuristics, triton_helpers
    props = types.SimpleNamespace(
        name=H100.name, major=9, minor=0, multi_processor_count=132, total_memory=80 << 30,
        shared_memory_per_block_optin=H100.shared_memory, warp_size=32,
        max_threads_per_multi_processor=2048, regs_per_multiprocessor=65536, gcnArchName="",
        L2_cache_size=50 << 20)
    cuda = device_interface.CudaInterface
    for owner in (cuda, cuda.Worker):
        owner.get_device_properties = staticmethod(lambda *args: props)
        owner.current_device = staticmethod(lambda: 0)
    answers = dict(get_compute_capability=lambda *args: 90, is_available=lambda: True,
                   device_count=lambda: 1, exchange_device=lambda index: 0,
                   maybe_exchange_device=lambda index: 0, set_device=lambda *args: None,
                   get_raw_stream=lambda *args: 0)
    for name, answer in answers.items():
        setattr(cuda, name, staticmethod(answer))
    for name, answer in dict(get_device_properties=lambda *args, **kwargs: props,
                             get_device_capability=lambda *args, **kwargs: (9, 0),
                             current_device=lambda: 0, device_count=lambda: 1,
                             is_available=lambda: True, set_device=lambda *args: None,
                             _exchange_device=lambda index: 0,
                             _maybe_exchange_device=lambda index: 0,
                             get_rng_state=lambda *args: torch.empty(0, dtype=torch.uint8),
                             set_rng_state=lambda *args: None).items():
        setattr(torch.cuda, name, answer)
    # Inductor loads the compiled kernels with the active driver: the simulated one stays
    triton_helpers.set_driver_to_gpu = triton_heuristics.set_driver_to_gpu = lambda: None
    torch.utils._triton.has_triton.cache_clear()  # (asked before, without a CUDA device)
    from torch._subclasses import fake_tensor  # (torch 2.8's fake CUDA tensor inits CUDA)
    fake_tensor.init_gpu_context = lambda *args: None


def backward_calls(fake):
    """Per family, its backward op's call on fake CUDA tensors (as the forward saved them)."""
    def new(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="cuda")
    with fake:
        q, o = new(2, 9, 9, 2, 16), new(2, 9, 9, 2, 16)
        lse, rpb = new(2, 2, 9, 9), new(2, 5, 5)
        logits, v, qrpb, ws = new(1, 6, 6, 2, 2), new(1, 6, 6, 2, 8), new(2, 2, 3, 3), \
            new(2, 2, 3, 3)
        qlse, g = new(1, 2, 3, 3, 2), new(1, 3, 3, 2, 8)
        x, w, go = new(1, 8, 6, 6), new(1, 4, 9, 36), new(1, 8, 6, 6)
        sg = new(1, 4, 9, 36)
    fp = san._footprint((3, 3), (1, 1), (1, 1), "reflect", (1, 1))
    return {
        "na2d_qkv": (lambda *a: neighborhood._na_backward_op(
            *a, [3, 3], [1, 1], 0.25, True, True, []), (o, q, q, q, rpb, o, lse)),
        "qna2d": (lambda *a: qna._qna_backward_op(*a, 3, 2, True),
                  (g, logits, v, qrpb, ws, qlse)),
        "san_aggregation": (lambda *a: san._aggregation_backward_op(
            *a, True, True, *san._fields(fp)), (go, x, w)),
        "san_subtraction2": (lambda g: san._subtraction_backward_op(
            g, [1, 4, 6, 6], False, *san._fields(fp)), (sg,)),
    }


def last_line(e: Exception) -> str:
    return str(e).strip().splitlines()[-1][:400]


def check_inductor() -> dict:
    from torch._inductor.compile_fx import compile_fx_inner
    simulated_cuda()
    found = {}
    fake = FakeTensorMode()
    forward = calls("cuda")
    passes = {f"{name} forward": (call, None) for name, (_, call) in forward.items()}
    passes.update({f"{name} backward": (call, args)
                   for name, (call, args) in backward_calls(fake).items()})
    for label, (call, args) in passes.items():
        if args is None:
            with fake:
                args = forward[label.split()[0]][0]()
        graphs = []

        def compiled(gm, inputs):
            graphs.append(graph_kernels(gm))
            compile_fx_inner(gm, inputs)
            graphs[-1]["compiled"] = True
            return gm  # (the compiled module would launch on a device: the graph runs)
        try:
            with fake:
                aot_function(call, fw_compiler=compiled)(*args)
            result = "ok"
        except Exception as e:  # noqa: BLE001 (reported, with its last line)
            result = f"{type(e).__name__}: {last_line(e)}"
        found[label] = dict(result=result, graphs=graphs)
    return found


class HostCopy(torch.nn.Module):
    """The CUDA-graph check's control: a training step that copies a host tensor (a buffer
    kept on the CPU) to the device, which a CUDA graph cannot capture."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)
        self.register_buffer("shift", torch.ones(3, device="cpu"))

    def forward(self, x):
        return self.proj(x.mean((2, 3)) + self.shift.to(x.device))


STEPS = {  # the training steps the CUDA-graph check compiles, 2 x 3 x 32 x 32 images
    "nat": lambda: tiny_models.nat(tiny_models.NAT_ONE_STAGE, backend="cuda"),  # (dilated)
    "qna_vit": lambda: tiny_models.qna_vit(**tiny_models.QNA_VIT_TWO_STAGES, backend="cuda"),
    "san_pairwise": lambda: tiny_models.san(**tiny_models.SAN_TWO_STAGES, backend="cuda"),
    "san_patchwise": lambda: tiny_models.san("patchwise", **tiny_models.SAN_TWO_STAGES,
                                             backend="cuda"),
    "control": HostCopy,
}


def trace_training_steps() -> dict:
    """Per model of :data:`STEPS` on the ``cuda`` backend: the forward and backward graphs of
    its compiled training step (Dynamo, fullgraph, then AOT autograd with Inductor's
    decompositions), traced on meta tensors as CUDA ones are, each with what Inductor's
    compile would be given beside it (its inputs' layouts, meta as CUDA, and which inputs
    are static: the parameters and buffers, and the backward's saved tensors)."""
    import torch._inductor.compile_fx  # noqa: F401 (the decompositions use its lowerings)
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.utils import count_tangents
    found = {}
    for name, build in STEPS.items():
        graphs = []

        def keep(is_backward):
            def compiler(gm, inputs):
                static = (range(count_tangents(gm)) if is_backward else torch._guards.
                          TracingContext.try_get().fw_metadata.static_input_indices)
                graphs.append((copy.deepcopy(gm), [
                    (t.shape, t.stride(), t.dtype, on_cuda(t.device))
                    if isinstance(t, torch.Tensor) else t for t in inputs],
                    list(static), is_backward))
                return gm
            return compiler
        with torch.device("meta"):
            model = build()
            x = torch.empty(2, 3, 32, 32)
        # (no torch._dynamo.reset(): it empties the table of the graphs' kernels)
        train_as_cuda(model.train(), [x], aot_autograd(
            fw_compiler=keep(False), bw_compiler=keep(True),
            decompositions=select_decomp_table()))
        found[name] = graphs
    return found


def on_cuda(a):
    """``a`` (a device, a node's arguments) with the meta device made CUDA."""
    if isinstance(a, torch.device) and a.type == "meta":
        return torch.device("cuda")
    if isinstance(a, (list, tuple)):
        return type(a)(on_cuda(b) for b in a)
    if isinstance(a, dict):
        return {k: on_cuda(b) for k, b in a.items()}
    return a


@contextlib.contextmanager
def recording_partitions(partitions: list):
    """Inductor's graph partitions (the CUDA graphs a compiled graph is cut into) appended
    to ``partitions`` as the scheduler makes them; Inductor's own kernels left uncompiled
    (the check is the partitions: the passes' compile is check_inductor's)."""
    from torch._inductor import async_compile
    from torch._inductor.scheduler import Scheduler
    make, triton = Scheduler.graph_partition, async_compile.AsyncCompile.triton

    def graph_partition(self):
        parts, signatures = make(self)
        partitions.append([dict(nodes=len(part), cudagraph=not signature.skip_cudagraph,
                                reasons=sorted({self.should_partition(n) or "" for n in part}
                                               - {""}))
                           for part, signature in zip(parts, signatures)])
        return parts, signatures
    Scheduler.graph_partition = graph_partition
    async_compile.AsyncCompile.triton = lambda self, kernel_name, *args, **kwargs: kernel_name
    try:
        yield
    finally:
        Scheduler.graph_partition, async_compile.AsyncCompile.triton = make, triton


def check_cudagraphs(traced: dict) -> dict:
    """Each graph of :func:`trace_training_steps` compiled by Inductor on fake CUDA tensors
    for CUDA graphs, as ``mode="reduce-overhead"`` compiles it (``triton.cudagraphs``; the
    tree of CUDA graphs off: it needs the forward run on a device before the backward's
    compile)."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.cudagraph_utils import BoxedDeviceIndex
    from torch._inductor.utils import BoxedBool
    found = {}
    with config.patch({"triton.cudagraphs": True, "triton.cudagraph_trees": False,
                       "use_static_cuda_launcher": False, "compile_threads": 1}):
        for name, graphs in traced.items():
            device_index = BoxedDeviceIndex(None)
            found[name] = []
            for gm, layouts, static, is_backward in graphs:
                for node in gm.graph.nodes:
                    node.args, node.kwargs = on_cuda(node.args), on_cuda(node.kwargs)
                gm.recompile()
                fake = FakeTensorMode()
                with fake:
                    inputs = [torch.empty_strided(*t[:2], dtype=t[2], device=t[3])
                              if isinstance(t, tuple) else t for t in layouts]
                cudagraphs, partitions = BoxedBool(True), []
                result = dict(graph_kernels(gm), partitions=partitions)
                try:
                    with fake, recording_partitions(partitions):
                        compiled = compile_fx_inner(
                            gm, inputs, cudagraphs=cudagraphs, static_input_idxs=static,
                            is_backward=is_backward, boxed_forward_device_index=device_index)
                except Exception as e:  # noqa: BLE001 (reported, with its last line)
                    result["error"] = f"{type(e).__name__}: {last_line(e)}"
                else:
                    info = compiled.cudagraph_info
                    result.update(cudagraphs=bool(cudagraphs),
                                  disabled=compiled.disabled_cudagraphs_reason,
                                  fail_reasons=info.cudagraph_fail_reasons if info else None)
                found[name].append(result)
    return found


def main() -> None:
    os.environ["ATTNZOO_AUTOTUNE"] = "0"  # (no real CUDA tensors to tune a trace's calls on)
    neighborhood.device_info = lambda device: H100  # NA's device query, answered as an H100's
    # (Triton's driver gives the target whose compile tells torch which tensors a kernel writes;
    # simulated_gpu tells the families' support checks yes, for meta and fake CUDA tensors too)
    with simulated_gpu(90):
        joint, dynamic, steps = check_joint(), check_dynamic(), trace_training_steps()
        inductor = check_inductor()  # (the simulated CUDA from here on: no more Dynamo)
        print(json.dumps(dict(joint=joint, dynamic=dynamic, inductor=inductor,
                              cudagraphs=check_cudagraphs(steps))))


if __name__ == "__main__":
    main()
