"""attnzoo's fused GPU kernels, written in Triton (the ``cuda`` backend of the ops).

One module per op family (``neighborhood.py``, ``qna.py``, ``san.py``), each running its
kernels as ``torch.library`` custom ops, forward and backward (autograd registered on them), so
that torch.fx sees one opaque call each way and never the host code, and torch.compile (torch
>= 2.6, :class:`KernelOp`) the kernel launches themselves, which Inductor makes;
``tiling.py`` holds what the families' kernels share (window arithmetic, query tiles and the key
regions they stream, strided loads, the online-softmax step, the precision rule, the work
count). This module holds what their host code shares:

**Support.** A family declares what it supports as data, a :class:`KernelLimits` (dtypes,
largest head dim, smallest compute capability), and answers "can you run this call?" with
``LIMITS.reasons(device, dtype, head_dims, shared_memory)`` plus its own reasons (kernel sizes,
...): every reason it refuses, empty if none (xformers' ``not_supported_reasons()``); its
``call_reasons`` are those the call alone decides on any machine (``LIMITS.call_reasons``:
dtype, head dims; plus its own), which model cards state. The
reasons common to every kernel are written once, in :meth:`KernelLimits.reasons`: Triton
missing or too old, the device type (CUDA; CPU only under Triton's interpreter), the device's
compute capability, and the shared memory per block of the family's smallest configuration
against the device's limit. A device is named as torch names it, with its index (``"cuda:1"``;
``"cuda"`` is the current device): :func:`device_info` reads that device's own properties,
cached per index, never the current device's.

**Launching.** :func:`launch_on_device`, every family's launch point, which
:func:`capture_launches` turns into a record of the launches (scripts/compile_kernels.py compiles
them without a GPU). A warm launch goes to the compiled kernel's launcher directly, without
Triton's argument binding (:func:`direct_launches`).

**Tuning.** :class:`Autotuner`: the fastest of a few launch configurations per key (shape,
kernel size, dilation, head dim, dtype, device), timed on the call's device (one whose compile
fails is left out, with its reason logged) and kept on disk (:class:`TuningStore`, per GPU,
Triton and attnzoo version), so that it is timed once per machine, not once per process; the
first configuration without a GPU to time on, with ``ATTNZOO_AUTOTUNE=0``, or under
``torch.use_deterministic_algorithms``.

**Determinism.** Every kernel is deterministic: no atomics; what several programs contribute to
one value (the rpb and window-weight gradients) is written per program and summed afterwards
in a fixed order (by more programs of a later launch of the same backward). Two runs of a call
with the same launch configuration are bitwise equal; under
``torch.use_deterministic_algorithms(True)`` the configuration is fixed too.

**Verification.** The records of where each family's kernels passed their verification on a
real GPU are data: ``verified.jsonl`` beside this module, one :class:`Verification` per line
(family, GPU architecture, dtypes, GPU name, date, torch and Triton versions, the kernels'
digest, the command), and the files ``ATTNZOO_VERIFIED_KERNELS`` names. ``auto`` sends a call
to a family's kernels only where a record covers its architecture and dtype, the installed
Triton has the record's major.minor and the installed kernels the record's digest
(:func:`verified`, :func:`kernels_digest`); ``backend="cuda"`` runs them anywhere.

Triton is optional: importing :mod:`attnzoo.kernels` does not import it. The kernels run on CUDA
tensors; on CPU tensors only under Triton's interpreter, which is how CI proves them correct:
``TRITON_INTERPRET=1`` must be set when a kernel module is first imported (Triton then builds
interpreted functions) and while the kernels run on CPU (:func:`interpreter_enabled`).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import inspect
import io
import json
import logging
import math
import os
import re
import threading
import tokenize
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, Iterator, List, NamedTuple, Optional, Sequence
from typing import Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor

__all__ = ["triton_missing", "interpreter_enabled", "DeviceInfo", "device_info", "KernelLimits",
           "Autotuner", "Verification", "records", "record_files", "verified", "unverified",
           "launch_on_device", "capture_launches", "capturing", "supported_anywhere", "kernel_op",
           "KernelOp", "inductor_launches", "traced", "eager", "can_tune",
           "will_tune", "TuningStore", "tuning_cache_path", "tuning_scope", "allocation",
           "kernels_digest", "source_digest", "INT32_MAX", "wide_offsets", "narrow_offsets",
           "joined"]

_logger = logging.getLogger(__name__)


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET is set now (parsed the way Triton parses it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# tl.gather (NA's bias and its gradient) is in Triton >= 3.3, whose compiler fails on NA's kernels
# with a bias (an assertion of its thread-locality pass, for sm80 and sm90 alike: compiled on
# scripts/simulated_gpu.py's device); Triton 3.4 compiles them.
MIN_TRITON = (3, 4)


@functools.lru_cache(maxsize=1)
def triton_missing() -> Optional[str]:
    """``None`` when a usable Triton is importable, else why not (with what to install)."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        return (f"Triton is not installed ({e}); install it with `pip install triton` "
                "(it ships with PyTorch's CUDA wheels on Linux)")
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRITON or not hasattr(tl, "gather"):
        return (f"Triton {triton.__version__} is too old: attnzoo's kernels need Triton >= "
                f"{'.'.join(map(str, MIN_TRITON))} (`pip install -U triton`)")
    return None


# ---------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------

class DeviceInfo(NamedTuple):
    """What the kernels need to know about one CUDA device."""
    name: str                     # torch.cuda.get_device_name
    capability: Tuple[int, int]
    shared_memory: int            # bytes of shared memory one block may use (opt-in maximum)

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


def _cuda_index(device: str) -> int:
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


@functools.lru_cache(maxsize=None)
def _cuda_device_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    # What one block may opt in to (A100: 163 KiB; RTX 30xx / 40xx: 99; H100: 227). torch
    # reports it from 2.6, the first with a Triton the kernels accept; 0 before (nothing fits).
    return DeviceInfo(props.name, (props.major, props.minor),
                      getattr(props, "shared_memory_per_block_optin", 0))


def device_info(device: str) -> DeviceInfo:
    """The properties of CUDA device ``device`` ("cuda:1"; "cuda": the current one), read
    from that device and cached per index."""
    return _cuda_device_info(_cuda_index(device))


def _kib(n: int) -> str:
    return f"{math.ceil(n / 1024)} KiB"


# ---------------------------------------------------------------------------------------------
# support
# ---------------------------------------------------------------------------------------------

class KernelLimits(NamedTuple):
    """What a kernel family supports, as data (xformers' ``SUPPORTED_*`` attributes)."""
    name: str                                  # as reasons name it: "attnzoo's Triton NA kernels"
    dtypes: Tuple[torch.dtype, ...]
    max_head_dim: int
    min_capability: Tuple[int, int] = (8, 0)   # tl.dot on bf16, cp.async: Ampere

    def reasons(self, device: str, dtype: torch.dtype, head_dims: Sequence[int],
                shared_memory: Optional[int] = None) -> List[str]:
        """Every reason these kernels cannot run a call on ``device`` (a torch device string
        with its index) in ``dtype`` with these head dims (q's, v's; none for an op without
        heads); ``shared_memory``: bytes per block the family's smallest configuration needs
        for the call, checked against a CUDA device's limit (not under the interpreter, which
        has none). Empty if none."""
        missing = triton_missing()
        if missing is not None:
            return [missing]
        reasons = []
        kind = torch.device(device).type
        if kind == "cpu":
            if not (_interpreted() and interpreter_enabled()):
                reasons.append(
                    "attnzoo's Triton kernels run on CUDA tensors; CPU tensors only under "
                    "Triton's interpreter (TRITON_INTERPRET=1 set before attnzoo's kernels are "
                    "first imported and while they run; for tests, it is slow)")
        elif kind != "cuda":
            reasons.append(f"attnzoo's Triton kernels run on CUDA tensors, not {kind}")
        elif not _interpreted() and torch.cuda.is_available():
            info = device_info(device)
            if info.capability < self.min_capability:
                need = ".".join(map(str, self.min_capability))
                have = ".".join(map(str, info.capability))
                reasons.append(f"{self.name} need a GPU of compute capability >= {need} "
                               f"(Ampere or newer); {device} ({info.name}) is {have}")
            elif shared_memory is not None and shared_memory > info.shared_memory:
                reasons.append(f"{self.name} need {_kib(shared_memory)} of shared memory per "
                               f"block for this call; {device} ({info.name}) has "
                               f"{_kib(info.shared_memory)}")
        return reasons + self.call_reasons(dtype, head_dims)

    def offsets_reason(self) -> str:
        """Why a call that :func:`wide_offsets` finds is refused."""
        return (f"{self.name} address the elements of one sample (a batch entry) with 32-bit "
                f"offsets; this call's tensors reach more than {INT32_MAX} elements within "
                "one")

    def call_reasons(self, dtype: torch.dtype, head_dims: Sequence[int]) -> List[str]:
        """The reasons of :meth:`reasons` that the call alone decides, on any machine (its dtype,
        its head dims): what a model card can say. Empty if none."""
        reasons = []
        if dtype not in self.dtypes:
            reasons.append(f"{self.name} support {', '.join(map(str, self.dtypes))}, not {dtype}")
        if head_dims and max(head_dims) > self.max_head_dim:
            reasons.append(f"{self.name} support head_dim up to {self.max_head_dim}, got "
                           f"{max(head_dims)}")
        return reasons


# The kernels address a sample's elements (a batch entry's: every dimension but the first) with
# 32-bit offsets, the batch's own offset 64-bit: compiled, a wider offset would wrap around, and
# the access would fault or read elsewhere.
INT32_MAX = 2 ** 31 - 1


def wide_offsets(*tensors: Optional[torch.Tensor], elements: int = 0) -> bool:
    """Whether one sample of a tensor (its dimensions after the first) holds more than
    :data:`INT32_MAX` elements, or reaches through its strides further than that from the
    sample's first element; or ``elements`` (the most elements of one sample of an output
    the host code allocates, contiguous) is more than that. Such a call is beyond the kernels'
    offsets. A contiguous tensor of at most that many elements is decided at once."""
    if elements > INT32_MAX:
        return True
    for t in tensors:
        if t is None or (t.numel() <= INT32_MAX and t.is_contiguous()) or t.numel() == 0:
            continue
        sizes, strides = t.shape[1:], t.stride()[1:]
        if math.prod(sizes) > INT32_MAX or sum(
                (n - 1) * s for n, s in zip(sizes, strides)) > INT32_MAX:
            return True
    return False


def narrow_offsets(grad: torch.Tensor) -> torch.Tensor:
    """A gradient (which autograd may hand over as a view into a larger tensor) that the
    kernels can address: itself, or a contiguous copy where its strides reach beyond
    32-bit offsets (its elements are the checked output's, so a copy fits)."""
    return grad.contiguous() if wide_offsets(grad) else grad


def joined(*reasons: Optional[str]) -> Optional[str]:
    """Reasons a backend cannot run a call, as one; ``None`` if there are none."""
    return "; ".join(r for r in reasons if r) or None


def _interpreted() -> bool:
    """The kernel modules were built for Triton's interpreter (TRITON_INTERPRET was set when
    the first of them was imported)."""
    from .tiling import INTERPRETED
    return INTERPRETED


# the list capture_launches yields, while it is active, and whether it keeps the arguments
_captured: Optional[List[tuple]] = None
_captured_args = True


@contextlib.contextmanager
def capture_launches(arguments: bool = True) -> Iterator[List[tuple]]:
    """Record the kernels' launches (every family's) instead of running them: within it, each
    one is appended as ``(kernel, grid, args, kwargs)`` to the list it yields, and the families'
    custom ops run their host code on plain meta tensors (:func:`capturing`).
    scripts/compile_kernels.py runs models and ops on meta tensors under it and compiles every
    launch for sm80-sm90 without a GPU. ``arguments=False`` records ``(kernel, grid, (), {})``
    and keeps no tensor alive, as a launch on a GPU keeps none (scripts/bench_host.py: a kept
    gradient would also be copied by autograd into its parameter's ``.grad``, not stolen)."""
    global _captured, _captured_args
    previous = _captured, _captured_args
    _captured, _captured_args = [], arguments
    try:
        yield _captured
    finally:
        _captured, _captured_args = previous


@contextlib.contextmanager
def supported_anywhere(*families: str) -> Iterator[None]:
    """Within it, the support check of each family in ``families`` (default: every family)
    says yes on any device: for tensors that stand for CUDA ones on a machine without a GPU
    (meta tensors whose launches :func:`capture_launches` records, CPU tensors on
    scripts/simulated_gpu.py's GPU). The backends' choices, made by those checks, are reset on
    entry and exit."""
    import importlib
    from .. import backends
    modules = [importlib.import_module(f"{__name__}.{f}") for f in families or FAMILIES]
    checks = [m.support for m in modules]
    for module in modules:
        module.support = lambda *args, **kwargs: None
    backends.reset()
    try:
        yield
    finally:
        for module, check in zip(modules, checks):
            module.support = check
        backends.reset()


def launch_arguments(kernel: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """A launch's arguments (as captured, or as a wrapped launch function receives them) by
    the kernel's parameter names, its options (``num_warps``...) too: launches pass most
    arguments positionally."""
    return dict(zip(kernel.arg_names, args), **kwargs)


def capturing(*tensors: torch.Tensor) -> bool:
    """Whether :func:`capture_launches` is active and ``tensors`` are plain meta tensors (not
    the fake tensors of a torch.compile trace): a custom op's fake implementation then runs the
    host code, whose launches are captured."""
    return _captured is not None and not any(isinstance(t, _FakeTensor) for t in tensors)


def kernel_op(name: str, impl: Callable[..., Any], schema: str,
              fake: Callable[..., Any], tuned: bool = False) -> Any:
    """``impl`` (host code that launches kernels) as the custom op ``attnzoo::name`` of
    ``schema``, mutating nothing: torch.fx sees one opaque call, never the host code. ``fake``
    gives its outputs' shapes to a trace; while launches are captured on plain meta tensors
    (:func:`capturing`), ``impl`` itself runs there. On torch >= 2.6 (unless
    ``ATTNZOO_INDUCTOR_LAUNCHES=0`` at import), a :class:`KernelOp` around it instead, which
    torch.compile traces into. ``tuned``: ``impl`` autotunes its launches (:class:`Autotuner`),
    which a trace does on real tensors of the call's sizes (:func:`tune_for_trace`)."""
    op = torch.library.custom_op(f"attnzoo::{name}", impl, mutates_args=(), schema=schema)

    @op.register_fake
    def _(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        return (impl if capturing(*tensors) else fake)(*args, **kwargs)
    if not inductor_launches():
        return op

    def traceable(*args):
        # Inductor launches kernels on CUDA tensors only (CPU: the interpreter's), and the host
        # code keys its plans by static sizes: with symbolic ones (torch.compile's
        # recompilation for another batch size), the opaque op
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors[0].device.type in _INDUCTOR_DEVICES and _static(tensors):
            if tuned and traced(tensors[0]):
                tune_for_trace(impl, args)
            return impl(*args)
        return op(*args)
    traceable.__signature__ = _annotated_signature(schema)
    inductor = torch.library.triton_op(f"attnzoo::{name}_inductor", traceable, mutates_args=(),
                                       schema=schema)
    return KernelOp(op, inductor)


_SCHEMA_TYPES = {"Tensor": torch.Tensor, "Tensor?": Optional[torch.Tensor], "int": int,
                 "int[]": List[int], "float": float, "bool": bool, "str": str}


def _annotated_signature(schema: str) -> inspect.Signature:
    """``schema``'s arguments and returns as Python annotations: torch 2.6-2.8's ``triton_op``
    infers the schema from them, whatever ``schema`` it is given."""
    arguments, returns = re.fullmatch(r"\((.*)\) -> (.*)", schema).groups()
    parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    annotation=_SCHEMA_TYPES[kind])
                  for kind, name in (a.split() for a in arguments.split(", "))]
    outputs = [_SCHEMA_TYPES[r] for r in returns.strip("()").split(", ")]
    return inspect.Signature(parameters, return_annotation=Tuple[tuple(outputs)]
                             if returns.startswith("(") else outputs[0])


class KernelOp:
    """A family's pass as torch.compile sees it on torch >= 2.6: the ``torch.library.triton_op``
    ``attnzoo::name_inductor``, whose host code AOTAutograd runs on the trace's fake
    tensors, so that each launch (:func:`launch_on_device`, through ``wrap_triton``) reaches
    Inductor as a kernel call of its own, which the compiled model launches from Inductor's
    wrapper without attnzoo's Python. ``opaque``: the custom op of :func:`kernel_op`, which a
    call with symbolic sizes takes."""
    __slots__ = ("opaque", "traceable")

    def __init__(self, opaque, traceable):
        self.opaque, self.traceable = opaque, traceable

    def __call__(self, *args):
        return self.traceable(*args)

    def register_autograd(self, backward, *, setup_context) -> None:
        for op in (self.opaque, self.traceable):
            op.register_autograd(backward, setup_context=setup_context)


def tune_for_trace(impl: Callable[..., Any], args: Sequence[Any]) -> None:
    """Where a trace's call would be tuned at run time (:func:`will_tune`), tune it now: run
    ``impl`` once on real tensors of the traced ones' sizes, strides and dtypes (random
    values; outside every trace mode), so that the trace's plans take the tuned choice (and
    the store keeps it), as Inductor times its own kernels' configurations while it compiles.
    A key tuned before (this process, or the store) times nothing, but the call still runs
    once on real tensors (a compile's cost: its inputs' memory, one launch per kernel)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    device = torch.device(_TUNING_DEVICE or tensors[0].device)
    if not will_tune(tensors[0].device) or torch.cuda.is_current_stream_capturing():
        return
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes(), torch.no_grad():
        real = [_random_like(a, device) if isinstance(a, torch.Tensor) else a for a in args]
        previous, _trace_tuning.on = _tuning_for_trace(), True
        try:
            impl(*real)
        finally:
            _trace_tuning.on = previous


_INDUCTOR_DEVICES = ("cuda",)  # (tests/inductor_launches.py adds meta: autograd on no GPU)
_TUNING_DEVICE: Optional[str] = None  # tests: the device of those real tensors (no GPU there)
_trace_tuning = threading.local()  # .on: this thread tunes for a trace (tune_for_trace)


def _tuning_for_trace() -> bool:
    return getattr(_trace_tuning, "on", False)


def _random_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A real tensor of ``t``'s sizes, strides (overlapping ones too: a view of one filled
    buffer) and dtype on ``device``."""
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    base = torch.empty(extent, dtype=t.dtype, device=device)
    base = base.normal_() if base.is_floating_point() else base.zero_()
    return base.as_strided(t.shape, t.stride())


def _static(tensors) -> bool:
    return not any(isinstance(n, torch.SymInt) for t in tensors for n in (*t.shape, *t.stride()))


_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")
_INDUCTOR_LAUNCHES = os.environ.get("ATTNZOO_INDUCTOR_LAUNCHES", "1") != "0"


def inductor_launches() -> bool:
    """Whether torch.compile traces into the kernels' host code, so that Inductor launches
    them (:class:`KernelOp`): torch >= 2.6 (``torch.library.triton_op``), unless
    ``ATTNZOO_INDUCTOR_LAUNCHES=0`` was set when attnzoo was imported. Otherwise each pass is
    one opaque custom op, whose host code runs at every call."""
    return _INDUCTOR_LAUNCHES and _TRITON_OP


def traced(tensor: torch.Tensor) -> bool:
    """``tensor`` is a trace's (a fake or functional tensor): a launch on it is a kernel call
    in the trace's graph (:func:`launch_on_device`), and nothing is timed on it. (A plain meta
    tensor reaches the host code only while launches are captured: elsewhere a call on one
    takes the opaque op, whose fake runs no host code.)"""
    return type(tensor) not in _PLAIN


def eager(tensor: torch.Tensor) -> bool:
    """Whether a family's call on ``tensor`` takes its eager path, an ``autograd.Function``
    calling the host code directly (the custom op's dispatch costs some 20 us a call each way):
    not while torch.compile traces, which must see the custom op, and a plain tensor (not the
    fake or functional tensors of a trace), on a real device or on meta while launches are
    captured (elsewhere a meta tensor goes to the op's fake implementation)."""
    if torch.compiler.is_compiling() or type(tensor) not in _PLAIN:
        return False
    return tensor.device.type != "meta" or _captured is not None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


Allocation = Callable[[], torch.Tensor]  # a new uninitialised tensor per call


@functools.lru_cache(maxsize=4096)
def allocation(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Allocation:
    """A contiguous tensor's allocation with its arguments bound, looked up once per call key
    (and cached per shape, dtype and device): ``allocation(...)()`` is a new uninitialised
    tensor. ``torch.empty_strided`` called from C (a partial of a builtin): ~1 us a tensor on
    CPU and on meta tensors alike, where ``new_empty`` and ``empty_like`` take 1.1-1.4 us on
    CPU and 5-6 on meta (their meta functions are Python). The custom ops' fake
    implementations allocate the same shapes, dtypes and (contiguous) strides with
    ``new_empty``, on symbolic sizes (opcheck compares them)."""
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= max(size, 1)  # torch's contiguous strides: a 0-size dim counts as 1
    return functools.partial(torch.empty_strided, tuple(shape), tuple(reversed(strides)),
                             dtype=dtype, device=device)


def once_differentiable(backward: Callable[..., Any]) -> Callable[..., Any]:
    """torch's ``once_differentiable`` for the families' ``autograd.Function`` backwards (the
    kernels' gradients have no graph: a double backward raises), calling ``backward`` directly
    where grad mode is off, as ``loss.backward()`` runs it: torch's wrapper would enter
    ``no_grad`` again there, some 1.5 us a call, and do nothing else."""
    guarded = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *args):
        return guarded(ctx, *args) if torch.is_grad_enabled() else backward(ctx, *args)
    return wrapper


def launch_on_device(kernel, grid, *args, warmup: bool = False, **kwargs):
    """Launch Triton ``kernel`` on the device of its first argument (Triton launches on the
    current CUDA device, so a launch on another one is guarded), or record it
    (:func:`capture_launches`).
    ``warmup``: compile only, and return the compiled kernel (the autotuner reads its spills)."""
    if traced(args[0]):  # a trace's tensors (KernelOp): a launch for Inductor
        if not warmup:
            torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
        return None
    if _captured is not None:
        _captured.append((kernel, grid, args, kwargs) if _captured_args else
                         (kernel, grid, (), {}))
        return None
    device = args[0].device
    guard = device.type == "cuda" and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if guard else contextlib.nullcontext():
        if warmup:
            return kernel.warmup(*args, grid=grid, **kwargs)
        if _direct and grid.__class__ is tuple and _direct_kernel(kernel):
            _launch_direct(kernel, grid, args, kwargs)
        else:
            kernel[grid](*args, **kwargs)
    return None


# Direct launches. Triton's JITFunction.run binds every argument, specializes it and builds its
# cache key from the result at each launch: 14-29 us of Python for these kernels' 29-66
# parameters, as much as the rest of an NA call's host path (scripts/bench_host.py, a simulated
# GPU). A launch whose arguments specialize as an earlier launch's did goes to the compiled
# kernel's launcher directly, as JITFunction.run would: the same compiled kernel, grid, stream
# and arguments. Its key holds what Triton's specialization reads, or more: each argument's
# type; an int's, bool's or string's value (1 and multiples of 16 compile apart, so do i32 and
# i64, and a bool apart from 1); a tensor's dtype and its address modulo 16 (Triton's
# alignment); the grid, the options, the current device, the kernel's and Triton's debug flags
# and Triton's instrumentation knob. It keeps no tensor; its entry keeps the compiled kernel
# (loaded while the launcher may call it), and holds while Triton keeps the kernel's compiled
# kernels for the device (a cleared cache or updated source: through run again). Launches with
# a launch hook (a profiler's), a pre-run hook or a pipeline-inspection hook set go through
# JITFunction.run, and so does a call that leaves a parameter to its default, passes an
# argument of another type or a tensor by name. Triton's check that a kernel's globals did not
# change since it was compiled is left out: these kernels' globals are constants (their digest
# covers them). Only for the Triton versions whose JITFunction.run was read for this (its
# launcher's call): others launch through it.
_DIRECT_TRITON = ((3, 4), (3, 8))
_TENSORS = frozenset(_PLAIN)
_DIRECT_TYPES = _TENSORS | {int, float, bool, str, type(None)}
# launch key -> (kernel, its compiled kernels for the device (Triton's cache, cleared: a miss),
# the compiled kernel, its launcher, function and metadata, grid, the parameters given by name)
_launchers: Dict[tuple, tuple] = {}
_LAUNCHERS_KEPT = 4096


_direct = os.environ.get("ATTNZOO_DIRECT_LAUNCH", "1") != "0"


def direct_launches(enabled: bool) -> bool:
    """Launch through Triton's ``JITFunction.run`` at every call (``False``) or go to the
    compiled kernel's launcher where an earlier launch compiled the same specialization
    (``True``, the default; ``ATTNZOO_DIRECT_LAUNCH=0`` at import turns it off). Returns the
    previous setting. A Triton version this was not checked against always goes through
    ``JITFunction.run``."""
    global _direct
    previous, _direct = _direct, enabled
    return previous


def _launch_direct(kernel, grid, args, kwargs) -> None:
    compilation, runtime, driver = _triton
    if (kernel.pre_run_hooks or getattr(runtime, "add_stages_inspection_hook", None) is not None
            or _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook)):
        kernel[grid](*args, **kwargs)
        return
    active = driver.active
    device = active.get_current_device()
    # the kernel by its id (a JITFunction's hash is Python, some 1 us), checked on a hit
    key = (id(kernel), grid, device, runtime.debug, kernel.debug,
           getattr(compilation, "instrumentation_mode", ""), tuple(map(type, args)),
           *kwargs.items(), tuple(map(type, kwargs.values())),
           *[(a.dtype, a.data_ptr() & 15) if a.__class__ in _TENSORS else a for a in args])
    try:
        entry = _launchers.get(key)
    except TypeError:  # an unhashable argument: Triton's binder decides
        entry = key = None
    # a hit: the same kernel, and Triton has kept its compiled kernels for the device since
    caches = kernel.device_caches.get(device)
    if entry is None or entry[0] is not kernel or entry[1] is not caches:
        compiled = kernel[grid](*args, **kwargs)
        named = tuple(p.name for p in kernel.params[len(args):])  # given by name, if at all
        if key is not None and _can_launch_directly(kernel, grid, args, kwargs, named,
                                                    compiled):
            if len(_launchers) >= _LAUNCHERS_KEPT:
                _launchers.clear()
            _launchers[key] = (kernel, kernel.device_caches.get(device), compiled, compiled.run,
                               compiled.function, compiled.packed_metadata,
                               grid + (1,) * (3 - len(grid)), named)
        return
    _, _, _, launcher, function, metadata, (x, y, z), named = entry
    if named:
        args += tuple([kwargs[name] for name in named])
    launcher(x, y, z, active.get_current_stream(device), function, metadata, None, None, None,
             *args)


def _hooked(hook) -> bool:
    """A launch hook is set: Triton >= 3.5 keeps a chain of them (empty: none)."""
    return hook is not None and bool(getattr(hook, "calls", True))


_triton: tuple = ()  # triton.knobs.compilation, triton.knobs.runtime, triton.runtime.driver.driver
_direct_kernels: Dict[int, tuple] = {}  # id(kernel) -> (kernel, launched directly)


def _direct_kernel(kernel) -> bool:
    """``kernel`` is a compiled ``JITFunction`` of a Triton whose launch is known here (not
    under the interpreter)."""
    known = _direct_kernels.get(id(kernel))
    if known is not None and known[0] is kernel:
        return known[1]
    global _triton
    direct = False
    version = None if triton_missing() else _major_minor(triton_version())
    if (version is not None and _DIRECT_TRITON[0] <= version <= _DIRECT_TRITON[1]
            and not _interpreted()):
        from triton import knobs  # (Triton >= 3.4)
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
        _triton = knobs.compilation, knobs.runtime, driver
        direct = isinstance(kernel, JITFunction)
    _direct_kernels[id(kernel)] = kernel, direct
    return direct


def _can_launch_directly(kernel, grid, args, kwargs, named, compiled) -> bool:
    """A launch's compiled kernel may be launched directly for its key: every argument given
    (Triton's launcher takes them all, constexprs too, in the kernel's order: ``named``, the
    parameters after the positional ones, by name), each of a known type, no tensor given by
    name (the key holds a tensor's dtype and alignment for positional ones only), the grid a
    tuple of ints."""
    values = (*args, *[kwargs[name] for name in named if name in kwargs])
    return (compiled is not None and hasattr(compiled, "packed_metadata")
            and len(values) == len(kernel.params) and _DIRECT_TYPES.issuperset(map(type, values))
            and _TENSORS.isdisjoint(map(type, kwargs.values()))
            and 1 <= len(grid) <= 3 and all(type(g) is int for g in grid))


# ---------------------------------------------------------------------------------------------
# tuning
# ---------------------------------------------------------------------------------------------

def _bench_ms(fn: Callable[[], Any]) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


class Autotuner:
    """The fastest of a few launch configurations per key, cached for the process.

    ``choose(key, configs, launch, tune)``: with ``tune`` (compiled kernels on a CUDA device,
    outside torch.compile tracing and CUDA-graph capture), the first time ``key`` is seen it
    compiles every config (``launch(config, warmup=True)`` returns Triton's compiled kernel),
    leaves out those that do not fit the device (``OutOfResources``), fail to compile (any other
    error of Triton's compiler: logged with its reason, as a WARNING of logger
    ``attnzoo.kernels``) or spill registers (unless all do), times the others with
    ``launch(config)`` (the launches must be idempotent: they rewrite the same outputs) and keeps
    the fastest. Without ``tune`` (the interpreter, CPU, tracing, ``ATTNZOO_AUTOTUNE=0``), the
    first config, unless the key was tuned before. Under ``torch.use_deterministic_algorithms``
    always the first config: configurations sum in different orders, and timings differ from
    one process to the next, so a tuned choice would make two runs differ. A compiler that
    aborts the process cannot be caught here: scripts/gpu_verify.py runs each stage in a process
    of its own for that."""

    def __init__(self, bench: Callable[[Callable[[], Any]], float] = _bench_ms,
                 store: Optional["TuningStore"] = None):
        self.bench = bench
        self.store = store
        self.best: Dict[Hashable, Any] = {}

    def choose(self, key: Hashable, configs: Sequence[Any], launch: Callable[..., Any],
               tune: bool, scope: str = "", *, device: torch.device) -> Any:
        """``scope``: what the choice holds for besides ``key`` (the GPU, Triton and attnzoo:
        :func:`tuning_scope`), under which the store keeps it. ``device``: the call's; the
        timing runs with it current (a compiled kernel loads into the current device's context,
        and Triton's timer records its events and synchronises there)."""
        if torch.are_deterministic_algorithms_enabled():
            return configs[0]
        if key in self.best:
            return self.best[key]
        if not tune or len(configs) == 1:
            return configs[0]
        configs = list(configs)[:MAX_CONFIGS]
        stored = self.store.get(scope, key) if self.store is not None else None
        if stored is not None and stored < len(configs):  # chosen by an earlier process
            self.best[key] = configs[stored]
            return self.best[key]
        guard = device.type == "cuda" and device.index != torch.cuda.current_device()
        with torch.cuda.device(device) if guard else contextlib.nullcontext():
            best = self._time(key, configs, launch)
        self.best[key] = best
        if self.store is not None:
            self.store.put(scope, key, configs.index(best))
        return best

    def _time(self, key, configs, launch):
        from triton.runtime.errors import OutOfResources
        spills, failed = {}, []
        for i, config in enumerate(configs):
            try:
                compiled = launch(config, warmup=True)
                compiled._init_handles()
                spills[i] = compiled.n_spills
            except OutOfResources:
                pass
            except Exception as e:  # noqa: BLE001 - a compiler error rules out that config only
                from ..profiling import first_line  # compiler errors run to pages
                reason = f"{type(e).__name__}: {first_line(e)}"
                failed.append(f"{config}: {reason}")
                _logger.warning("attnzoo: configuration %s of %s does not compile, left out: %s",
                                config, key, reason)
        if not spills:
            raise RuntimeError(f"no configuration of {key} fits this GPU: {list(configs)}"
                               + (f"; compile errors: {'; '.join(failed)}" if failed else ""))
        fewest = min(spills.values())
        times = {i: self.bench(lambda: launch(configs[i])) for i, n in spills.items()
                 if n == fewest}
        return configs[min(times, key=times.get)]


# Configurations a key tries at most (compiled, then timed): NA's spaces have 3 or 4.
MAX_CONFIGS = 4
TUNING_CACHE_ENV = "ATTNZOO_AUTOTUNE_CACHE"
_TUNING_FORMAT = "attnzoo autotune 1"


def tuning_cache_path() -> Optional[Path]:
    """Where the autotuner's choices persist: ``ATTNZOO_AUTOTUNE_CACHE`` (a file; ``0`` keeps
    them in the process only), else ``attnzoo_autotune.json`` in Triton's own cache folder
    (``TRITON_CACHE_DIR``, default ``~/.triton/cache``)."""
    where = os.environ.get(TUNING_CACHE_ENV, "").strip()
    if where == "0":
        return None
    if where:
        return Path(where).expanduser()
    triton_cache = os.environ.get("TRITON_CACHE_DIR", "").strip()
    return (Path(triton_cache) if triton_cache else Path.home() / ".triton" / "cache") / \
        "attnzoo_autotune.json"


def tuning_scope(device: torch.device) -> str:
    """What a tuned choice holds for besides its call key: the GPU (name and architecture),
    Triton's version and attnzoo's. A choice made under another scope is never used."""
    from .. import __version__
    info = device_info(str(device))
    return f"{info.name} {info.arch} triton {triton_version()} attnzoo {__version__}"


class TuningStore:
    """The autotuner's choices on disk (:func:`tuning_cache_path`), so that a second process's
    first step compiles and times nothing: per scope (:func:`tuning_scope`) and call key, the
    index of the chosen configuration in the key's space. Read once per process; each new
    choice is merged into the file as it is then (other processes write it too) and written
    whole, atomically (one writer at a time in a process: threads may tune at once). A file
    that cannot be read, is not JSON or is not this format is ignored, with one warning; one
    that cannot be written, likewise. Two processes writing at the same moment may each miss the
    other's newest choice, which is then tuned again by a later process."""

    def __init__(self, path: Callable[[], Optional[Path]] = tuning_cache_path):
        self.path = path
        self.entries: Optional[Dict[str, Dict[str, int]]] = None
        self._lock = threading.Lock()

    def get(self, scope: str, key: Hashable) -> Optional[int]:
        with self._lock:
            if self.entries is None:
                self.entries = self._read(self.path())
            index = self.entries.get(scope, {}).get(repr(key))
        return index if isinstance(index, int) and index >= 0 else None

    def put(self, scope: str, key: Hashable, index: int) -> None:
        with self._lock:
            self._put(scope, key, index)

    def _put(self, scope: str, key: Hashable, index: int) -> None:
        path = self.path()
        if self.entries is None:
            self.entries = {}
        self.entries.setdefault(scope, {})[repr(key)] = index
        if path is None:
            return
        merged = self._read(path, quiet=True)
        for name, choices in self.entries.items():
            merged.setdefault(name, {}).update(choices)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"format": _TUNING_FORMAT, "entries": merged}, indent=0))
            os.replace(tmp, path)
        except OSError as e:
            _warn_once(f"attnzoo: cannot write the autotune cache {path} ({e.strerror}); "
                       f"choices are kept for this process only (set {TUNING_CACHE_ENV})")

    @staticmethod
    def _read(path: Optional[Path], quiet: bool = False) -> Dict[str, Dict[str, int]]:
        if path is None or not path.exists():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != _TUNING_FORMAT or \
                    not isinstance(data.get("entries"), dict):
                raise ValueError(f"not an attnzoo autotune cache ({_TUNING_FORMAT!r})")
            return {scope: dict(choices) for scope, choices in data["entries"].items()
                    if isinstance(choices, dict)}
        except (OSError, ValueError) as e:
            if not quiet:
                from ..profiling import first_line
                _warn_once(f"attnzoo: ignoring the autotune cache {path}: {first_line(e)}")
            return {}


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    _logger.warning(message)


AUTOTUNE_ENV = "ATTNZOO_AUTOTUNE"


def will_tune(device: torch.device) -> bool:
    """Whether launches on ``device`` are timed at all, now or by a later call: compiled kernels
    on a CUDA device, ``ATTNZOO_AUTOTUNE`` not ``0``, deterministic algorithms off."""
    return (device.type == "cuda" and not _interpreted()
            and not torch.are_deterministic_algorithms_enabled()
            and os.environ.get(AUTOTUNE_ENV, "1").strip() != "0")


def can_tune(device: torch.device) -> bool:
    """Whether launches on ``device`` may be timed now (see :class:`Autotuner`): as
    :func:`will_tune`, and neither tracing (torch.compile) nor capturing a CUDA graph;
    ``ATTNZOO_AUTOTUNE=0`` turns tuning off (each launch takes its default configuration)."""
    return (will_tune(device) and (_tuning_for_trace() or not torch.compiler.is_compiling())
            and not torch.cuda.is_current_stream_capturing())


# ---------------------------------------------------------------------------------------------
# verification
# ---------------------------------------------------------------------------------------------

# The records of where each family's kernels passed their verification on a real GPU: one JSON
# object per line (scripts/gpu_verify.py prints the lines to add). Data, not code: recording a
# verification is adding a line. ATTNZOO_VERIFIED_KERNELS names more such files (os.pathsep
# between them): a user's own verification, on a GPU or Triton the package's records do not cover.
RECORDS_FILE = Path(__file__).with_name("verified.jsonl")
RECORDS_ENV = "ATTNZOO_VERIFIED_KERNELS"
FAMILIES = ("neighborhood", "qna", "san")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Verification(NamedTuple):
    """One verification of a kernel family on a real GPU: what ``auto`` trusts, for
    ``arch`` and ``dtypes`` only, with a Triton of the same major.minor as ``triton``, and for
    the family's Triton code as it was verified (``kernels``: :func:`kernels_digest`)."""
    family: str                # "neighborhood", "qna" or "san"
    arch: str                  # "sm_90"
    dtypes: Tuple[str, ...]    # ("float32", "bfloat16")
    gpu: str                   # torch.cuda.get_device_name()
    date: str                  # ISO date
    torch: str                 # torch.__version__ there
    triton: str                # triton.__version__ there
    kernels: str               # kernels_digest(family) there: 12 hex digits
    command: str               # what passed: "python scripts/gpu_verify.py --out DIR"

    def to_line(self) -> str:
        """The record as its line of the data file."""
        fields = self._asdict()
        fields["dtypes"] = list(self.dtypes)
        return json.dumps(fields, ensure_ascii=False)

    @classmethod
    def from_line(cls, line: str, where: str = "a record") -> "Verification":
        """Parse one line of a records file; a ``ValueError`` says what is wrong and where."""
        try:
            fields = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not a JSON object ({e})") from None
        if not isinstance(fields, dict) or set(fields) != set(cls._fields):
            got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
            raise ValueError(f"{where}: a record has exactly the fields {', '.join(cls._fields)}; "
                             f"got {got}")
        record = cls(**{**fields, "dtypes": tuple(fields["dtypes"])})
        problems = []
        if record.family not in FAMILIES:
            problems.append(f"family {record.family!r} is not one of {', '.join(FAMILIES)}")
        if not re.fullmatch(r"sm_\d+", str(record.arch)):
            problems.append(f"arch {record.arch!r} is not like 'sm_90'")
        unknown = [d for d in record.dtypes if d not in _DTYPES]
        if not record.dtypes or unknown:
            problems.append(f"dtypes {list(record.dtypes)!r} must be some of {', '.join(_DTYPES)}")
        if _major_minor(record.triton) is None:
            problems.append(f"triton {record.triton!r} is not a version like '3.6.0'")
        if not re.fullmatch(r"[0-9a-f]{12}", str(record.kernels)):
            problems.append(f"kernels {record.kernels!r} is not a digest of 12 hex digits "
                            "(attnzoo.kernels.kernels_digest)")
        if problems:
            raise ValueError(f"{where}: " + "; ".join(problems))
        return record


_MARKS = {tokenize.INDENT: "<indent>", tokenize.DEDENT: "<dedent>", tokenize.NEWLINE: ";"}


class _Definitions(NamedTuple):
    """What a module defines that Triton code can use, each as ``(node, text)``: ``kernels``,
    its functions decorated ``triton.jit``; ``values``, its module-level assignments to a name
    (constants, ``tl.constexpr``s, dtypes); ``imported``, the names it imports from tiling.py
    (``as`` name -> tiling's name)."""
    kernels: Dict[str, Tuple[ast.AST, str]]
    values: Dict[str, Tuple[ast.AST, str]]
    imported: Dict[str, str]


def _definitions(source: str) -> _Definitions:
    """Each definition's text is its tokens joined by spaces (decorators included, blocks and
    statement ends marked; comments, layout and a function's docstring left out): text that
    every Python version's tokenizer reads alike, where ``ast.unparse`` and ``ast.dump``
    change between versions. Tokens are taken by line (a module's statement has its lines to
    itself; ast's columns count bytes, tokenize's characters)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    found = _Definitions({}, {}, {})
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and node.module == "tiling":
            found.imported.update((a.asname or a.name, a.name) for a in node.names)
            continue
        if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d).startswith(("triton.jit", "jit")) for d in node.decorator_list):
            into, name = found.kernels, node.name
            doc = ast.get_docstring(node, clean=False) is not None
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
                target := (node.targets[0] if isinstance(node, ast.Assign) else node.target),
                ast.Name):
            into, name, doc = found.values, target.id, False
        else:
            continue
        first = min(n.lineno for n in (node, *getattr(node, "decorator_list", ())))
        skip = (node.body[0].lineno, node.body[0].end_lineno) if doc else (0, -1)
        words = []
        for t in tokens:
            row = t.start[0]
            if not first <= row <= node.end_lineno or skip[0] <= row <= skip[1] and t.type in (
                    tokenize.STRING, tokenize.NEWLINE):  # the docstring and its line's end
                continue
            if t.type in _MARKS:
                words.append(_MARKS[t.type])
            elif t.type in (tokenize.NAME, tokenize.OP, tokenize.NUMBER, tokenize.STRING):
                words.append(t.string)
        while words and words[0] == "<dedent>":  # those closing the statement before
            words.pop(0)
        while words and words[-1] == "<dedent>":  # where a Python version puts them at the end
            words.pop()
        into[name] = (node, " ".join(words))
    return found


def source_digest(source: str, tiling: str = "") -> str:
    """12 hex digits of the SHA-256 of the Triton code of a kernel module's ``source``: its
    functions decorated ``triton.jit`` and, found by name from them, directly or not, the
    constants, constexprs and functions of its own or of ``tiling`` (tiling.py's source) that
    they use (:func:`_definitions`). Comments, docstrings, layout, the order of definitions,
    host code and what the kernels do not use leave it as it is; a change to what they compile
    changes it, but for the launch configurations the host code passes (tiles, warps,
    stages: scripts/compile_kernels.py checks them for sm80-sm90)."""
    own, shared = _definitions(source), _definitions(tiling)
    scope = {**shared.kernels, **shared.values}
    names = {**{alias: scope[name] for alias, name in own.imported.items() if name in scope},
             **own.kernels, **own.values}
    mine = {id(node) for node, _ in (*own.kernels.values(), *own.values.values())}
    used = {id(node): (node, text) for node, text in own.kernels.values()}
    todo = list(own.kernels.values())
    while todo:
        node, _ = todo.pop()
        within = names if id(node) in mine else scope  # the names its module sees
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                found = within.get(sub.id)
            elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                  and sub.value.id == "tiling"):
                found = scope.get(sub.attr)
            else:
                continue
            if found is not None and id(found[0]) not in used:
                used[id(found[0])] = found
                todo.append(found)
    digest = hashlib.sha256()
    for text in sorted(text for _, text in used.values()):
        digest.update(text.encode() + b"\n")
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def kernels_digest(family: str) -> str:
    """:func:`source_digest` of ``family``'s module with ``tiling.py``, as installed: a
    verification record holds the digest of the kernels it verified, and ``auto`` trusts a
    record only while the installed kernels' digest is the same."""
    here = Path(__file__).parent
    return source_digest(*((here / name).read_text(encoding="utf-8")
                           for name in (f"{family}.py", "tiling.py")))


def _major_minor(version: str) -> Optional[Tuple[int, int]]:
    match = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(match[1]), int(match[2])) if match else None


def record_files() -> List[Path]:
    """The records files read: the package's, then those ``ATTNZOO_VERIFIED_KERNELS`` names."""
    extra = os.environ.get(RECORDS_ENV, "")
    return [RECORDS_FILE] + [Path(p) for p in extra.split(os.pathsep) if p.strip()]


@functools.lru_cache(maxsize=1)
def records() -> Tuple[Verification, ...]:
    """Every verification record (:func:`record_files`), read once per process (a missing or
    malformed file raises: a record that cannot be read must not pass for none)."""
    found = []
    for path in record_files():
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read the kernel verification records {path} "
                             f"({e.strerror}); check {RECORDS_ENV}") from None
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                found.append(Verification.from_line(line, f"{path}, line {number}"))
    return tuple(found)


@functools.lru_cache(maxsize=1)
def triton_version() -> str:
    import triton
    return triton.__version__


def verified(family: str, device: str, dtype: torch.dtype) -> Optional[Verification]:
    """The record that makes ``auto`` trust ``family``'s kernels for ``dtype`` on ``device``'s
    architecture with the installed Triton (same major.minor) and the installed kernels (same
    :func:`kernels_digest`), or ``None``."""
    arch, version = device_info(device).arch, _major_minor(triton_version())
    name, digest = str(dtype).replace("torch.", ""), kernels_digest(family)
    return next((r for r in records() if r.family == family and r.arch == arch
                 and name in r.dtypes and _major_minor(r.triton) == version
                 and r.kernels == digest), None)


def unverified(family: str, device: str, dtype: torch.dtype, kernels: str) -> Optional[str]:
    """A family's answer to ``auto`` (its backend's ``trusted``): ``None`` where a record
    covers the call (:func:`verified`), else why not (``kernels`` names them: "the cuda NA
    kernels"), logged once per reason and process. An explicit ``backend="cuda"`` does not ask."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "no GPU here (Triton's interpreter is for tests)"
    if verified(family, device, dtype) is not None:
        return None
    info = device_info(device)
    name, digest = str(dtype).replace("torch.", ""), kernels_digest(family)
    there = [r for r in records() if r.family == family and r.arch == info.arch]
    reason = (f"{kernels} (version {digest}) have not been verified on {info.arch} "
              f"({info.name}) in {name} with "
              f"Triton {'.'.join(map(str, _major_minor(triton_version()) or ()))}")
    others = sorted({f"Triton {r.triton} in {', '.join(r.dtypes)}" for r in there
                     if r.kernels == digest})
    if others:
        reason += f" (only with {'; '.join(others)})"
    earlier = sorted({r.kernels for r in there if r.kernels != digest})
    if earlier:
        reason += (f"; the records for {info.arch} are of other versions of them "
                   f"({', '.join(earlier)}): they changed since")
    _note_unverified(reason)
    return reason


@functools.lru_cache(maxsize=None)
def _note_unverified(reason: str) -> None:  # once per reason and process
    _logger.info("attnzoo: %s: auto leaves them out; backend='cuda' runs them, and "
                 "scripts/gpu_verify.py verifies them on this GPU (docs/backends.md)",
                 reason)
