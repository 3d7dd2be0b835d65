"""attnzoo's fused GPU kernels, written in Triton (the ``cuda`` backend of the ops).

One module per op family (``neighborhood.py``, ``qna.py``, ``san.py``), each exposing a
``torch.autograd.Function`` with forward and backward; ``tiling.py`` holds what the families'
kernels share (window arithmetic, query tiles and the key regions they stream, strided loads,
the online-softmax step, the precision rule, the work count). This module holds what their host
code shares:

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

**Tuning.** :class:`Autotuner`: the fastest of a few launch configurations per key (shape,
kernel size, dilation, head dim, dtype, device), timed once per process on the call's device;
the first configuration without a GPU to time on.

**Verification.** :data:`VERIFIED` records, per family, the GPU architectures on which the
kernels passed their validation on a real GPU. ``auto`` sends a call to a family's kernels only
on a verified architecture (:func:`verified`); ``backend="cuda"`` runs them anywhere.

Triton is optional: importing :mod:`attnzoo.kernels` does not import it. The kernels run on CUDA
tensors; on CPU tensors only under Triton's interpreter, which is how CI proves them correct:
``TRITON_INTERPRET=1`` must be set when a kernel module is first imported (Triton then builds
interpreted functions) and while the kernels run on CPU (:func:`interpreter_enabled`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import torch

__all__ = ["triton_missing", "interpreter_enabled", "DeviceInfo", "device_info", "KernelLimits",
           "Autotuner", "Verification", "VERIFIED", "verified", "unverified", "launch_on_device"]

_logger = logging.getLogger(__name__)


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET is set now (parsed the way Triton parses it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# tl.gather (the rpb gradient) appeared in Triton 3.2.
MIN_TRITON = (3, 2)


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


def _interpreted() -> bool:
    """The kernel modules were built for Triton's interpreter (TRITON_INTERPRET was set when
    the first of them was imported)."""
    from .tiling import INTERPRETED
    return INTERPRETED


def launch_on_device(kernel, grid, *args, warmup: bool = False, **kwargs):
    """Launch Triton ``kernel`` on the device of its first argument. Triton launches on the
    current CUDA device, so eager calls are guarded (a compiled graph guards devices itself).
    ``warmup``: compile only, and return the compiled kernel (the autotuner reads its spills)."""
    eager_cuda = args[0].is_cuda and not torch.compiler.is_compiling()
    with torch.cuda.device(args[0].device) if eager_cuda else contextlib.nullcontext():
        if warmup:
            return kernel.warmup(*args, grid=grid, **kwargs)
        kernel[grid](*args, **kwargs)
    return None


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
    leaves out those that do not fit the device (``OutOfResources``) or spill registers (unless
    all do), times the others with ``launch(config)`` (the launches must be idempotent: they
    rewrite the same outputs) and keeps the fastest. Without ``tune`` (the interpreter, CPU,
    tracing), the first config, unless the key was tuned before."""

    def __init__(self, bench: Callable[[Callable[[], Any]], float] = _bench_ms):
        self.bench = bench
        self.best: Dict[Hashable, Any] = {}

    def choose(self, key: Hashable, configs: Sequence[Any], launch: Callable[..., Any],
               tune: bool) -> Any:
        if key in self.best:
            return self.best[key]
        if not tune or len(configs) == 1:
            return configs[0]
        from triton.runtime.errors import OutOfResources
        spills = {}
        for i, config in enumerate(configs):
            try:
                compiled = launch(config, warmup=True)
                compiled._init_handles()
                spills[i] = compiled.n_spills
            except OutOfResources:
                pass
        if not spills:
            raise RuntimeError(f"no configuration of {key} fits this GPU: {list(configs)}")
        fewest = min(spills.values())
        times = {i: self.bench(lambda: launch(configs[i])) for i, n in spills.items()
                 if n == fewest}
        self.best[key] = configs[min(times, key=times.get)]
        return self.best[key]


def can_tune(device: torch.device) -> bool:
    """Whether launches on ``device`` may be timed now (see :class:`Autotuner`)."""
    return (device.type == "cuda" and not _interpreted() and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing())


# ---------------------------------------------------------------------------------------------
# verification
# ---------------------------------------------------------------------------------------------

class Verification(NamedTuple):
    """One validation of a kernel family on a real GPU."""
    arch: str        # "sm_90"
    gpu: str         # torch.cuda.get_device_name()
    date: str        # ISO date
    commands: str    # what passed, e.g. "pytest tests/test_kernels_neighborhood.py"
    versions: str    # "torch 2.x, triton 3.x"


# Per family, the GPU architectures where its kernels passed the kernel tests (compiled, on
# CUDA tensors) and `attnzoo check --device cuda` against the torch reference. Empty: the
# kernels have been verified under Triton's interpreter and compiled for sm80-sm90, but have
# never run on a GPU. Add a Verification after those commands pass on a GPU (README, "Attention
# backends").
VERIFIED: Dict[str, Tuple[Verification, ...]] = {
    "neighborhood": (),
    "qna": (),
    "san": (),
}


def verified(family: str, device: str) -> Optional[Verification]:
    """The record of ``family``'s validation on ``device``'s architecture, or ``None``."""
    arch = device_info(device).arch
    return next((v for v in VERIFIED.get(family, ()) if v.arch == arch), None)


def unverified(family: str, device: str, kernels: str) -> Optional[str]:
    """A family's answer to ``auto`` (its backend's ``trusted``): ``None`` on a GPU whose
    architecture :data:`VERIFIED` records for ``family``, else why not (``kernels`` names them:
    "the cuda NA kernels"), logged once per architecture and process. An explicit
    ``backend="cuda"`` does not ask."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "no GPU here (Triton's interpreter is for tests)"
    if verified(family, device) is not None:
        return None
    info = device_info(device)
    reason = f"{kernels} have not been verified on {info.arch} ({info.name})"
    _note_unverified(reason)
    return reason


@functools.lru_cache(maxsize=None)
def _note_unverified(reason: str) -> None:  # once per family, architecture and process
    _logger.info("attnzoo: %s: auto leaves them out there; backend='cuda' runs them", reason)
