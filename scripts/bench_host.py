#!/usr/bin/env python
"""Host time of attnzoo's kernel calls and of whole training steps, measured on the CPU with
the kernels' launches captured, not run (``attnzoo.kernels.capture_launches``): what a GPU's
host would spend in Python before and around each launch (issue 46). Not a test.

Per op call (the ``cuda`` backend's public op: argument checks, backend dispatch, the eager
autograd path, allocations, the launch plan; Triton's own launch excluded), forward without
autograd and forward + backward, microseconds per call, warm (the call key seen before):

* ``meta``: on meta tensors, as scripts/compile_kernels.py captures launches; torch's meta
  functions of allocations and reductions are Python, so this overstates what a GPU's C++
  allocator costs;
* ``cpu``: on CPU tensors of the same call at batch 1 (C++ allocations, as on a GPU, glibc's
  malloc told to keep freed memory as torch's CUDA caching allocator does: ``caching_malloc``;
  the small torch work of the call, such as the rpb gradient's sum, is computed);

* ``cuda, cpu, Triton's launch`` and ``cuda, cpu, direct launch``: the CPU call with Triton's own
  launch too, on a simulated GPU (scripts/simulated_gpu.py: the kernels compiled for sm90, the
  launcher a counter): through Triton's ``JITFunction.run`` at every launch, and with
  attnzoo's direct launches (``attnzoo.kernels.direct_launches``), as a GPU's host runs them
  but for the launcher's C call (a few us). Left out under TRITON_INTERPRET or with
  ``--no-simulated-gpu``;

beside the torch reference of the same call on meta tensors (its ops' meta functions; QnA's
reference is one custom op, its fake on meta), and one ``F.scaled_dot_product_attention`` call
on CPU tensors of ``[1, 1, 1, 8]`` (a fused op's host cost: one dispatch and one kernel), and
a floor per NA call: the call reduced to its allocations in an ``autograd.Function``, on the
same packed qkv (what that design costs before any of attnzoo's Python; larger allocations cost
the CPU's allocator more). NA is called as NAT's and DiNAT's layers call it, ``na2d_qkv`` on
their qkv projection. A backward runs through 20 calls at once, as in a training step (the
autograd engine's start is paid once per step). Targets (issue 46, warm key): forward <= 25
us, forward + backward <= 60 us.

``--steps``: per training step (as timm's train.py: gradients set to None, forward,
``logsumexp`` loss, backward; 224 px, launches captured) of each family's tiny model and of
timm's swin_tiny, on meta tensors at batch 32: the ATen ops dispatched, the copies among them
(``copy_``, ``_to_copy``, ``clone``, ``select_backward``, ``stack``: what a GPU runs as copy
kernels), the kernel launches captured and the host milliseconds of the step, where torch's
Python meta functions dominate (a LayerNorm's forward and backward take some 3 ms there); the
same step with meta functions at a GPU host's cost, a shape computation ("shape meta": torch's
C++ meta function or composite where an op has one, shape-only ones for LayerNorm and ``roll``;
``shape_meta_functions``, in a process of its own), there also for NAT and DiNAT with each
NA call reduced to its allocations in an ``autograd.Function`` ("NA at its floor", the per-call
table's floor row: the step were NA's host code no more than that, the rest of the model as it
is); and the copies and host milliseconds on CPU tensors at batch 1 of the model narrowed to
head dim 1 (QnA-ViT 2; ``NARROW``: the same depths, heads, windows and ops, run by torch's C++
as on a GPU's host, their CPU work included: small, but for Swin's window attention, which does
not narrow; real tensors' strides, where meta's LayerNorm backward gives others, which cost
clones). The meta steps are timed in rounds over the models, the garbage collector paused.
Without CUDA, autocast is off: the bf16 casts a GPU step adds are not counted.

    python scripts/bench_host.py                       # the per-call table
    python scripts/bench_host.py --steps               # and the step table
    python scripts/bench_host.py --steps --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import attnzoo  # noqa: E402
from attnzoo import kernels  # noqa: E402
from attnzoo.ops import na2d_qkv, qna2d, san_aggregation, san_subtraction2  # noqa: E402

TARGET = {"fwd": 25.0, "fwd+bwd": 60.0}
GPU_TARGET = {"fwd": 50.0, "fwd+bwd": 300.0}  # NA at 7x7 on a GPU, whole (issue 46)
STEP_MODELS = ("nat_tiny", "dinat_tiny", "qna_vit_tiny", "san10_patchwise",
               "swin_tiny_patch4_window7_224")
COPIES = ("copy_", "_to_copy", "clone", "select_backward", "stack")
CHAIN = 20  # forward + backward: calls per backward


def _calls(device: str, batch: int) -> Dict[str, Callable[[bool], Callable[[str], torch.Tensor]]]:
    """Label -> ``make(grad)``: the inputs of one call built once (``grad``: leaves that
    require grad, listed in ``run.leaves``), and ``run(backend)`` running it, in bf16 with
    fp32 biases (parameters under autocast). NAT-tiny's last
    stage (7x7, 16 heads, K 7, rpb), DiNAT's dilated stage 2, QnA-ViT-tiny's last QnA stage,
    SAN10's stage 3."""
    dtype = torch.bfloat16
    leaves = []

    def new(*shape, grad, param=False):  # a parameter in fp32, as under autocast
        t = torch.empty(shape, device=device, dtype=torch.float32 if param else dtype)
        leaves.append(t.requires_grad_(grad))
        return t

    def with_leaves(make):
        def made(grad):
            leaves.clear()
            run = make(grad)
            run.leaves = [t for t in leaves if t.requires_grad]
            return run
        return made

    def na(H, heads, dilation):
        def make(grad):
            qkv = new(batch, H, H, 3, heads, 32, grad=grad)  # NAT's qkv projection, packed
            rpb = new(heads, 13, 13, grad=grad, param=True)
            return lambda b: na2d_qkv(qkv, kernel_size=7, dilation=dilation, rpb=rpb, backend=b)
        return make

    def qna(grad):
        logits, v = new(batch, 14, 14, 2, 32, grad=grad), new(batch, 14, 14, 32, 8, grad=grad)
        rpb, ws = new(2, 32, 3, 3, grad=grad, param=True), new(2, 32, 3, 3, grad=grad,
                                                                   param=True)
        return lambda b: qna2d(logits, v, kernel_size=3, rpb=rpb, window_weights=ws, backend=b)

    def aggregation(grad):
        x, w = new(batch, 256, 14, 14, grad=grad), new(batch, 32, 49, 196, grad=grad)
        return lambda b: san_aggregation(x, w, kernel_size=7, backend=b)

    def subtraction(grad):
        x1, x2 = new(batch, 64, 14, 14, grad=grad), new(batch, 64, 14, 14, grad=grad)
        return lambda b: san_subtraction2(x1, x2, kernel_size=7, backend=b)

    return {label: with_leaves(make) for label, make in (
        ("na2d_qkv nat_tiny s3 7x7 h16 k7 rpb", na(7, 16, 1)),
        ("na2d_qkv dinat_tiny s2 14x14 h8 k7 d2 rpb", na(14, 8, 2)),
        ("qna2d qna_vit_tiny s2 14x14 h32 k3", qna),
        ("san_aggregation san10 s3 14x14 k7", aggregation),
        ("san_subtraction2 san10 s3 14x14 k7", subtraction))}


def _timing(fn: Callable[[], object], number: int, divisor: int = 1) -> Callable[[], float]:
    """A timing of ``number`` calls of ``fn``, in microseconds per op call (``divisor`` of them
    per ``fn``), after a warm-up (the call key is then warm); on a GPU up to the end of the
    last call's kernels (at batch 1 the host's time: the GPU waits for it)."""
    for _ in range(max(3, number // 10)):
        fn()

    def timing() -> float:
        _sync()
        start = time.perf_counter()
        for _ in range(number):
            fn()
        _sync()
        return (time.perf_counter() - start) / number / divisor * 1e6
    return timing


def _best_rows(timings: Dict[tuple, Callable[[], float]], repeat: int) -> List[dict]:
    """The table's rows (``call``, ``passes`` and a value per column) of the best of
    ``repeat`` timings of each cell ``(call, passes, column)``, taken in rounds over every cell,
    so that each cell's timings spread over the whole run: a noisy minute of a shared machine
    then slows one timing of each cell, not every timing of a few."""
    best = dict.fromkeys(timings, float("inf"))
    for r in range(repeat):
        print(f"round {r + 1}/{repeat}", file=sys.stderr, flush=True)
        for cell, timing in timings.items():
            best[cell] = min(best[cell], timing())
    rows: Dict[tuple, dict] = {}
    for (call, passes, column), us in best.items():
        rows.setdefault((call, passes), dict(call=call, passes=passes))[column] = us
    return list(rows.values())


def caching_malloc() -> bool:
    """Tell glibc's malloc to keep freed memory, as torch's CUDA caching allocator does: by
    default it returns the top of its heap to the OS (``brk``) and maps larger blocks afresh,
    so that a call's allocations cost a few microseconds more or less with the heap's state
    (some 6 us of an NA call's 60, varying run to run) where a GPU's host pays a cache lookup.
    Both thresholds set (the mmap one to glibc's 32 MiB maximum) also stop glibc adapting them.
    False where the C library is not glibc."""
    import ctypes
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's C library
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sdpa(device: str):
    def make(grad):
        x = torch.empty(1, 1, 1, 8, device=device).requires_grad_(grad)
        run = lambda _: F.scaled_dot_product_attention(x, x, x)  # noqa: E731
        run.leaves = [x]
        return run
    return make


SDPA = "F.scaled_dot_product_attention [1, 1, 1, 8]"
FLOOR = "floor: na2d_qkv's allocations in an autograd.Function"


class _Allocations(torch.autograd.Function):
    """NA's packed call with nothing but its allocations: o and lse, then the qkv gradient,
    the rpb's and the scratch (the floor of an eager ``autograd.Function`` design)."""

    @staticmethod
    def forward(ctx, qkv, rpb):
        B, H, W, _, heads, d = qkv.shape
        lse = qkv.new_empty((B, heads, H, W), dtype=torch.float32)
        ctx.save_for_backward(qkv, rpb, lse)
        return qkv.new_empty((B, H, W, heads, d))

    @staticmethod
    def backward(ctx, do):
        qkv, rpb, lse = ctx.saved_tensors
        lse.new_empty(lse.numel() * 2)
        return qkv.new_empty(qkv.shape), None if rpb is None else rpb.new_empty(rpb.shape)


def _floor(make):
    """``make``'s NA call (one qkv leaf and an rpb; with gradients) through
    :class:`_Allocations`."""
    def made(grad):
        qkv, rpb = make(grad).leaves
        run = lambda _: _Allocations.apply(qkv, rpb)  # noqa: E731
        run.leaves = [qkv, rpb]
        return run
    return made


TRITON = "cuda, cpu, Triton's launch"
GPU_TRITON = "cuda, gpu, Triton's launch"
DIRECT = "cuda, cpu, direct launch"


def measure_calls(number: int, repeat: int, simulated: bool) -> List[dict]:
    """The CPU's columns: launches captured (Triton's own launch excluded); with
    ``simulated``, the call on CPU tensors with Triton's launch too, on a simulated GPU
    (scripts/simulated_gpu.py: compiled for sm90, the launcher a counter), through
    ``JITFunction.run`` at every launch and with attnzoo's direct launches."""
    timings = {}
    meta, cpu = _calls("meta", 32), _calls("cpu", 1)
    captured = functools.partial(kernels.capture_launches, arguments=False)
    columns = [("cuda, meta", meta, "cuda", captured), ("cuda, cpu", cpu, "cuda", captured)]
    if simulated:
        columns += [(TRITON, cpu, "cuda", functools.partial(_direct_launches, False)),
                    (DIRECT, cpu, "cuda", functools.partial(_direct_launches, True))]
    columns.append(("torch, meta", meta, "torch", captured))

    def add(cell, make, backend, enter):
        timings[cell] = _timing_within(enter, make, backend, cell[1], number)

    gpu = contextlib.nullcontext()
    if simulated:
        from simulated_gpu import simulated_gpu
        gpu = simulated_gpu(record=False)
    with gpu:
        for i, label in enumerate(meta):
            print(f"[{i + 1}/{len(meta)}] {label}", file=sys.stderr, flush=True)
            for passes in ("fwd", "fwd+bwd"):
                for column, calls, backend, enter in columns:
                    add((label, passes, column), calls[label], backend, enter)
        for passes in ("fwd", "fwd+bwd"):
            add((SDPA + ", cpu", passes, "cuda, cpu"), _sdpa("cpu"), None, captured)
        for label in [label for label in cpu if label.startswith("na2d_qkv")]:
            add((f"{FLOOR} ({label.split()[1]}'s), cpu", "fwd+bwd", "cuda, cpu"),
                _floor(cpu[label]), None, captured)
        return _best_rows(timings, repeat)


@contextlib.contextmanager
def _direct_launches(enabled: bool):
    previous = kernels.direct_launches(enabled)
    try:
        yield
    finally:
        kernels.direct_launches(previous)


def _timing_within(enter, make, backend, passes: str, number: int) -> Callable[[], float]:
    """:func:`_call_timing`, made and taken inside the context ``enter()`` (its column's)."""
    with enter():
        timing = _call_timing(make, backend, passes, number)

    def timed() -> float:
        with enter():
            return timing()
    return timed


def measure_gpu_calls(number: int, repeat: int) -> List[dict]:
    """On a GPU, the whole call at batch 1 (Triton's launch included; the GPU's work is
    microseconds): the kernels, with attnzoo's direct launches and through Triton's
    ``JITFunction.run`` at every launch, the torch reference, one SDPA call."""
    timings = {}
    calls = _calls("cuda", 1)
    for i, (label, make) in enumerate(calls.items()):
        print(f"[{i + 1}/{len(calls)}] {label}", file=sys.stderr, flush=True)
        for passes in ("fwd", "fwd+bwd"):
            for backend in ("cuda", "torch"):
                timings[label, passes, f"{backend}, gpu"] = _call_timing(make, backend, passes,
                                                                         number)
            timings[label, passes, GPU_TRITON] = _timing_within(
                functools.partial(_direct_launches, False), make, "cuda", passes, number)
    for passes in ("fwd", "fwd+bwd"):
        timings[SDPA, passes, "cuda, gpu"] = _call_timing(_sdpa("cuda"), None, passes, number)
    return _best_rows(timings, repeat)


def _call_timing(make, backend, passes: str, number: int) -> Callable[[], float]:
    """A timing (:func:`_timing`) of ``make(grad)(backend)``: forward under no_grad; forward +
    backward as a training step runs them, CHAIN calls on inputs of their own and one backward
    through them all (the autograd engine's start, some 50 us on the CPU, and its Python
    checks of each output's gradient, ~4 us, are paid once per step, not per op: the engine is
    run directly; no gradient is accumulated). Captured launches (their kernels and grids
    only) are dropped after each call, so that the list does not grow."""
    launches = kernels._captured if kernels._captured is not None else []
    if passes == "fwd":
        run = make(False)

        def call():
            run(backend)
            launches.clear()

        with torch.no_grad():  # as around a model's whole forward, not each call
            timing = _timing(call, number)

        def forward_timing():
            with torch.no_grad():
                return timing()
        return forward_timing
    runs = [make(True) for _ in range(CHAIN)]
    leaves = tuple(t for run in runs for t in run.leaves)
    grads = tuple(torch.empty_like(run(backend)) for run in runs)
    engine = torch.autograd.Variable._execution_engine

    def chained():
        engine.run_backward(tuple(run(backend) for run in runs), grads, False, False, leaves,
                            False)
        launches.clear()
    return _timing(chained, max(number // CHAIN, 2), CHAIN)


class _Count(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


# The step on CPU tensors (C++ meta-free dispatch and allocation, as a GPU's host runs them):
# each model at head dim 1 (2 for QnA-ViT: with an 8-channel stem, torch 2.14's CPU step
# aborted in oneDNN's convolution weight gradient, heap corrupted), its depths, heads, windows
# and 224 px kept, so that its ops are the same and their CPU work small. SAN has no heads to
# keep: its widths are tied to its share_planes and ratios (its ops are 0.44x swin_tiny's).
NARROW = {"nat_mini": dict(embed_dim=2), "nat_tiny": dict(embed_dim=2),
          "dinat_mini": dict(embed_dim=2), "dinat_tiny": dict(embed_dim=2),
          "qna_vit_tiny": dict(embed_dim=16), "swin_tiny_patch4_window7_224": dict(embed_dim=3)}


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off, as timeit has it: a collection, started by the
    objects a step allocates, would land in some timings and not others."""
    import gc
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _na_at_floor() -> Iterator[None]:
    """NAT's and DiNAT's attention call reduced to its floor, its allocations in an
    ``autograd.Function`` (:class:`_Allocations`, the per-call table's floor row): what their
    step would cost with no host code in NA beyond that, the rest of the model as it is."""
    from attnzoo.layers import neighborhood as layer
    call = layer.na2d_qkv_dispatch
    layer.na2d_qkv_dispatch = lambda qkv, kernel_size, dilation, rpb, *args: \
        _Allocations.apply(qkv, rpb)
    try:
        yield
    finally:
        layer.na2d_qkv_dispatch = call


def measure_steps(models, batch: int, repeat: int, narrow: bool = True,
                  na_floor: bool = False) -> List[dict]:
    """Per model: ATen ops, copies and launches of a training step on meta tensors at
    ``batch``, its host ms there, and (``narrow``, models in NARROW) on CPU tensors, narrowed,
    batch 1. A step is a training step of timm's train.py: gradients set to None, forward,
    loss, backward. ``na_floor``: also the host ms of a model with NA layers with its NA calls
    at their floor (:func:`_na_at_floor`), ``na_floor_ms``. The meta steps are timed in rounds,
    each step once a round, the best of ``repeat`` kept: a drift of the machine's speed weighs
    on every model alike, and their ratios hold."""
    from attnzoo.layers import NeighborhoodAttention2d
    import timm
    rows, timed = [], {}  # timed: (model, column) -> (step, the context it runs in)
    with attnzoo.use_backend("cuda"), kernels.capture_launches(arguments=False) as launches:
        for i, name in enumerate(models):
            print(f"[{i + 1}/{len(models)}] step of {name}", file=sys.stderr, flush=True)
            with torch.device("meta"):
                model = timm.create_model(name).train()
            step = _step(model, torch.empty(batch, 3, 224, 224, device="meta"))
            step()
            launches.clear()
            with _Count() as counted:
                step()
            launched = len(launches)
            launches.clear()
            # (a narrow step takes some 30 ms: ten of them, the best kept)
            narrow_ms, narrow_copies = _narrow(name, launches, 10) if (
                narrow and name in NARROW) else (None, None)
            timed[name, "ms"] = step, contextlib.nullcontext
            if na_floor and any(isinstance(m, NeighborhoodAttention2d)
                                for m in model.modules()):
                timed[name, "na_floor_ms"] = step, _na_at_floor
            ops = counted.ops
            rows.append(dict(model=name, ops=sum(ops.values()),
                             copies=sum(ops[c] for c in COPIES), narrow_copies=narrow_copies,
                             launches=launched, narrow_ms=narrow_ms, na_floor_ms=None))
        print(f"timing the steps, {repeat} rounds", file=sys.stderr, flush=True)
        with _gc_paused():
            best = _best_ms_in_rounds(timed, launches, repeat)
    for row in rows:
        row.update({column: ms for (model, column), ms in best.items() if model == row["model"]})
    return rows


def shape_meta_functions() -> None:
    """Meta tensors dispatched, in this process, to meta functions at a GPU host's cost, a shape
    computation, not to the Python ones torch registers for tracing
    (``torch._meta_registrations``, FakeTensor's: a LayerNorm's ~3 ms each way, an elementwise
    ``mul``'s ~0.4 ms). Torch's C++ meta function or C++ composite where an op has one (a
    structured kernel's meta function is the shape computation its CUDA kernel runs); a
    shape-only one for LayerNorm's forward and backward and ``roll``, whose meta functions
    compute on the meta tensors (LayerNorm's composite through ``var_mean``'s Python), with the
    contiguous outputs their CUDA kernels allocate; torch's Python one for the rest, convolution
    among them (its C++ composite does not run on meta). Not undone: for a process of its own
    (``--shape-meta``)."""
    import torch._meta_registrations as registrations
    python = registrations._meta_lib_dont_use_me_use_register_meta
    names = [key.split("/")[1] for key in python._op_impls]  # "aten/add.Tensor/Meta"
    python._destroy()
    global _REGISTERED  # kept alive: a Library's registrations end with it
    _REGISTERED = torch.library.Library("aten", "IMPL")
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for name in names:
        if name.startswith("convolution") or not any(has(f"aten::{name}", key) for key in (
                "Meta", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")):
            op, _, overload = name.partition(".")
            overload = getattr(getattr(torch.ops.aten, op), overload or "default")
            _REGISTERED.impl(name, overload.py_kernels[torch._C.DispatchKey.Meta], "Meta")
    like = functools.partial(torch.empty_like, memory_format=torch.contiguous_format)

    def layer_norm(x, shape, weight, bias, eps):
        stats = x.shape[:x.dim() - len(shape)] + (1,) * len(shape)
        return like(x), x.new_empty(stats), x.new_empty(stats)

    def layer_norm_backward(grad, x, shape, mean, rstd, weight, bias, mask):
        return tuple(like(t) if wanted and t is not None else None
                     for t, wanted in zip((x, weight, bias), mask))

    _REGISTERED.impl("native_layer_norm", layer_norm, "Meta")
    _REGISTERED.impl("native_layer_norm_backward", layer_norm_backward, "Meta")
    _REGISTERED.impl("roll", lambda x, shifts, dims=(): like(x), "Meta")


def shape_meta_steps(models, batch: int, repeat: int) -> Dict[str, dict]:
    """The meta step of :func:`measure_steps` with meta functions at a GPU host's cost
    (:func:`shape_meta_functions`), in a process of its own: per model, its ops and host ms,
    and NAT's and DiNAT's with NA at its floor (``na_floor_ms``); nothing where that process
    failed (torch's private registrations it reads moved, say)."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.json"
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--shape-meta",
                               "--models", *models, "--batch", str(batch), "--repeat",
                               str(repeat), "--json", str(out)], stdout=subprocess.DEVNULL)
        if proc.returncode:
            print(f"no shape-meta column: its process failed (exit {proc.returncode})",
                  file=sys.stderr)
            return {}
        return {r["model"]: r for r in json.loads(out.read_text())["steps"]}


def _narrow(name: str, launches: list, repeat: int) -> Tuple[float, int]:
    """Host ms of ``name``'s step narrowed (NARROW), batch 1, on CPU tensors and one thread,
    as a GPU's host dispatches, and its copies (the strides of real tensors: meta's LayerNorm
    backward, for one, gives others); denormals flushed (the captured kernels' outputs are
    left uninitialised, and a denormal would slow the CPU's work on them)."""
    import timm
    model = timm.create_model(name, **NARROW[name]).train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        step = _step(model, torch.randn(1, 3, 224, 224))
        ms = _best_ms_in_rounds({name: (step, contextlib.nullcontext)}, launches, repeat)[name]
        with _Count() as counted:
            step()
        launches.clear()
        return ms, sum(counted.ops[c] for c in COPIES)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)


def _step(model, x):
    # gradients set to None as train.py does, by its optimizer: the model's zero_grad walks
    # every module (nat_tiny's 572, swin_tiny's 247), ~2.4 and ~1.1 ms on a slow day
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(x).float().logsumexp(-1).mean().backward()
    return step


def _best_ms_in_rounds(cells: dict, launches: list, repeat: int) -> dict:
    """Per cell ``(step, context)``: the best ms of ``step`` run in ``context()``, the cells
    timed in ``repeat + 1`` rounds, each once a round (the first round warms the call keys)."""
    best = dict.fromkeys(cells, float("inf"))
    for _ in range(repeat + 1):
        for cell, (step, context) in cells.items():
            with context():
                start = time.perf_counter()
                step()
                best[cell] = min(best[cell], time.perf_counter() - start)
            launches.clear()
    return {cell: seconds * 1e3 for cell, seconds in best.items()}


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def calls_table(rows: List[dict], argv: List[str], caching: bool = False) -> str:
    """``caching``: glibc's malloc kept freed memory (:func:`caching_malloc`)."""
    gpu = any("cuda, gpu" in r for r in rows)
    simulated = any(DIRECT in r for r in rows)
    columns = (["cuda, gpu", GPU_TRITON, "torch, gpu"] if gpu else
               ["cuda, meta", "cuda, cpu"] + [TRITON, DIRECT] * simulated + ["torch, meta"])
    what = ("on the GPU (" + torch.cuda.get_device_name() + "), CUDA tensors at batch 1, each "
            "call whole (Triton's launch included: attnzoo's direct launches, and through "
            "Triton's JITFunction.run at every launch) up to its kernels' end" if gpu else
            "launches captured (Triton's own launch excluded); cuda on meta tensors (batch 32) "
            "and on CPU tensors (batch 1" + ("; glibc's malloc keeping freed memory, as a "
                                             "caching allocator" if caching else "") +
            ")" + ("; and on those CPU tensors with Triton's launch, on a simulated GPU (sm90, "
                   "the launcher a counter), through Triton's JITFunction.run at every launch "
                   "and with attnzoo's direct launches" if simulated else "") +
            "; the torch reference on meta tensors")
    lines = [f"`python scripts/bench_host.py {' '.join(argv)}`".replace(" `", "`"),
             "", f"Host microseconds per call, warm key, {what}; a backward through {CHAIN} "
             "calls, as in a training step; the best of --repeat timings per cell, taken in "
             "rounds over every cell. Targets (issue 46): forward <= 25 us, forward + "
             "backward <= 60 us" + (" (CPU); NA at 7x7: <= 50 us, <= 300 us (GPU)." if gpu
                                    else "."), "",
             "| call | pass | " + " | ".join(columns) + " | target |",
             "|---" * (len(columns) + 3) + "|"]
    for r in rows:
        if r["call"].startswith((SDPA, FLOOR)):
            target = None
        elif gpu:  # on a GPU, only NA at 7x7 has one
            target = GPU_TARGET[r["passes"]] if r["call"].startswith("na2d_qkv nat") else None
        else:
            target = TARGET[r["passes"]]
        lines.append(f"| {r['call']} | {r['passes']} | " +
                     " | ".join(_f(r.get(c)) for c in columns) + f" | {_f(target)} |")
    return "\n".join(lines)


def steps_table(rows: List[dict], batch: int) -> str:
    anchor = next((r for r in rows if r["model"].startswith("swin")), None)
    lines = ["", f"Training step (gradients set to None, forward, logsumexp loss, backward), "
                 "224 px, launches captured, fp32 (no autocast without CUDA). On meta tensors, "
                 f"batch {batch}: ATen ops, copies ({', '.join(COPIES)}), kernel launches, host "
                 "ms with torch's Python meta functions (as torch registers them, for tracing) "
                 "and with meta functions at a GPU host's cost (shape meta: torch's C++ ones "
                 "where it has them, shape-only ones for LayerNorm and roll), and there with "
                 "each NA call reduced to its allocations in an autograd.Function (NA at its "
                 "floor: the step were NA's host code no more than that); narrow: copies and "
                 "host ms on CPU tensors, batch 1, the model at head dim 1 (QnA-ViT 2) with its "
                 "depths, heads and windows (the same ops in C++, their CPU work included: "
                 "Swin's window attention among it, attnzoo's kernels not); x: over "
                 "swin_tiny's.", "",
             "| model | ATen ops | copies, meta | copies, narrow | launches | host ms, meta | "
             "host ms, shape meta | host ms, shape meta, NA at its floor | host ms, narrow | "
             "ops x | meta x | shape meta x | NA at its floor x | narrow x |",
             "|---" * 14 + "|"]
    for r in rows:
        def ratio(key, over=None):
            base = anchor and anchor[over or key]
            if not base or r[key] is None:
                return "-"
            return f"{r[key] / base:.2f}"
        copies = "-" if r["narrow_copies"] is None else r["narrow_copies"]
        lines.append(f"| {r['model']} | {r['ops']} | {r['copies']} | {copies} | "
                     f"{r['launches']} | {r['ms']:.0f} | {_f(r['shape_ms'], 0)} | "
                     f"{_f(r['na_floor_ms'], 0)} | {_f(r['narrow_ms'])} | {ratio('ops')} | "
                     f"{ratio('ms')} | {ratio('shape_ms')} | "
                     f"{ratio('na_floor_ms', 'shape_ms')} | {ratio('narrow_ms')} |")
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--number", type=int, default=200, help="calls per timing (default 200)")
    p.add_argument("--repeat", type=int, default=5, help="timings, the best kept (default 5)")
    p.add_argument("--steps", action="store_true", help="also the training-step table")
    p.add_argument("--models", nargs="+", default=list(STEP_MODELS),
                   help="the step table's models (default: each family's tiny and swin_tiny)")
    p.add_argument("--batch", type=int, default=32, help="the step table's batch (default 32)")
    p.add_argument("--write", default=None, metavar="BENCHMARKS.md",
                   help="replace the script's table in this file (default: print only)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: each call whole on the GPU, Triton's launch included (no "
                        "step table)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--no-simulated-gpu", action="store_true",
                   help="leave out the columns of Triton's launch on a simulated GPU (they "
                        "compile the kernels for sm90 first, seconds each)")
    p.add_argument("--glibc-trimming", action="store_true",
                   help="leave glibc's malloc returning freed memory to the OS (default on "
                        "CPU: it keeps it, as a GPU's caching allocator does)")
    p.add_argument("--shape-meta", action="store_true", help=argparse.SUPPRESS)  # (steps_table)
    args = p.parse_args(argv)
    if args.shape_meta:  # shape_meta_steps' process: the meta steps alone, --repeat as given
        if not args.json:
            p.error("--shape-meta writes its rows to --json FILE only")
        shape_meta_functions()
        caching_malloc()  # as the parent's meta column
        with kernels.supported_anywhere():
            steps = measure_steps(args.models, args.batch, args.repeat, narrow=False,
                                  na_floor=True)
        Path(args.json).write_text(json.dumps(dict(steps=steps)))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    shown = [a for a in argv if a not in ("--write", args.write, "--json", args.json)]
    caching, steps = False, []
    if args.device == "cuda":
        rows = measure_gpu_calls(args.number, args.repeat)
    else:
        caching = not args.glibc_trimming and caching_malloc()
        print("glibc's malloc keeps freed memory (a caching allocator)" if caching else
              "the C library's malloc as it is", file=sys.stderr)
        simulated = not args.no_simulated_gpu and not kernels._interpreted()
        if not simulated:
            print("no simulated GPU columns: " + ("--no-simulated-gpu" if args.no_simulated_gpu
                  else "the kernels are interpreted (TRITON_INTERPRET)"), file=sys.stderr)
        # meta and CPU tensors are not CUDA tensors: the launches are captured, never run
        with kernels.supported_anywhere():
            rows = measure_calls(args.number, args.repeat, simulated)
            if args.steps:
                repeat = max(args.repeat // 2, 1)
                steps = measure_steps(args.models, args.batch, repeat)
                shaped = shape_meta_steps(args.models, args.batch, repeat)
                for r in steps:
                    found = shaped.get(r["model"], {})
                    r["shape_ms"], r["shape_ops"] = found.get("ms"), found.get("ops")
                    r["na_floor_ms"] = found.get("na_floor_ms")
    text = calls_table(rows, shown, caching)
    if steps:
        text += "\n" + steps_table(steps, args.batch)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(calls=rows, steps=steps), indent=1))
    if args.write:
        from attnzoo.profiling import write_table
        write_table(args.write, "bench_host.py", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
