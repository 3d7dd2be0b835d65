"""The attention backend switch and the op registry.

Every local-attention op in :mod:`attnzoo.ops` can run on several backends:

* ``"torch"``  - pure PyTorch reference, any device and dtype; the numerical oracle.
* ``"natten"`` - NATTEN's kernels (optional: ``pip install --no-build-isolation "natten>=0.20"``).
* ``"cuda"``   - attnzoo's own fused Triton kernels (CUDA tensors; CPU only under
  ``TRITON_INTERPRET=1``).
* ``"auto"``   - per call, the first backend of :data:`AUTO_ORDER` for the call's device that
  runs it (our kernels only where verified); ``torch`` is the last resort.

Selection, most specific first: an explicit ``backend=`` argument, :func:`use_backend` (a
context manager, per thread), :func:`set_backend` (process default), the ``ATTNZOO_BACKEND``
environment variable, then ``"auto"``. An explicitly requested backend that cannot do a call
raises :class:`BackendUnsupportedError` naming the backends that can; it never falls back
silently.

An op registers once (:func:`register_op`): per backend its implementation and support check,
the call-key type, its analytical MAC formula, benchmark calls and small check cases. Its public
function validates the arguments, describes the call with a small hashable key (device type,
dtype, options) and hands everything to :func:`dispatch`, which resolves the backend, lets
profilers observe the call (:func:`observe_ops`) and runs the implementation. ``auto``'s
preference is one table for every op (:data:`AUTO_ORDER`).

Every op's check cases (:func:`op_cases`) run on any backend against the float64 torch reference
with :func:`check_case`: the tests run every registered op on every backend that supports each
case, and ``attnzoo check`` does the same on the user's hardware.

Under ``torch.compile`` the choice is a constant of the graph: the requested name is read from
plain Python state (a ``threading.local`` and a module global, which Dynamo guards, so
``use_backend`` / ``set_backend`` after compiling recompile), and the resolution itself is an
``assume_constant_result`` function that Dynamo evaluates once instead of tracing. The
environment variable is read inside it, so changing ``ATTNZOO_BACKEND`` after compiling takes no
effect until the model is recompiled.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import warnings
import weakref
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, NamedTuple
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "BACKENDS", "CONCRETE_BACKENDS", "AUTO_ORDER", "ENV_VAR", "BackendUnsupportedError", "Backend",
    "set_backend", "get_backend", "use_backend", "reset", "on_reset", "register_op",
    "registered_ops", "dispatch", "resolve", "available_backends", "supported_backends",
    "call_limits", "observe_ops", "record_calls", "RUNS_ON", "op_examples", "Case",
    "CheckResult", "TOLERANCE", "case_inputs", "op_cases", "case_support", "check_case",
    "exact_fp32", "exporting", "tensors_key", "checked_once",
]

_logger = logging.getLogger(__name__)

# The backends that run ops (the torch reference first), and every name a user may request.
CONCRETE_BACKENDS: Tuple[str, ...] = ("torch", "natten", "cuda")
BACKENDS: Tuple[str, ...] = CONCRETE_BACKENDS + ("auto",)
ENV_VAR = "ATTNZOO_BACKEND"
# What each concrete backend is and where it runs, in a phrase (model cards).
RUNS_ON: Dict[str, str] = {
    "torch": "attnzoo's PyTorch reference, any device and dtype",
    "natten": "NATTEN's kernels (installed apart), CPU and CUDA",
    "cuda": "attnzoo's Triton kernels, CUDA GPUs of compute capability >= 8.0",
}

# auto's preference per device type of the call, fastest first; a backend that cannot run the
# call (or that an op does not implement) is passed over, and the torch reference comes last.
# On CUDA, attnzoo's fused kernels come first (they also take NAT's rpb, which NATTEN >= 0.20 does
# not) where their backend trusts them (``Backend.trusted``: verified on the GPU's architecture).
# On CPU (and any device not listed) only the reference: NA's tiled reference is 8-300x faster
# than NATTEN's unfused CPU path (BENCHMARKS.md, CPU); the Triton interpreter is for tests.
AUTO_ORDER: Dict[str, Tuple[str, ...]] = {"cuda": ("cuda", "natten", "torch"), "cpu": ("torch",)}


class BackendUnsupportedError(ValueError):
    """An explicitly requested backend cannot run this call (or is not installed)."""


def _check_name(name: object, source: str = "") -> str:
    """``name`` as a backend's name; ``source``: where it came from, if not an argument."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, one of {BACKENDS}; got {type(name).__name__}")
    lowered = name.strip().lower()
    if lowered not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}{source}; accepted: {', '.join(BACKENDS)}")
    return lowered


# ---------------------------------------------------------------------------------------------
# the requested backend
# ---------------------------------------------------------------------------------------------

# Per thread (a threading.local, which torch.compile traces and guards on every supported torch;
# a ContextVar is not traceable before torch 2.6). ``backend`` unset means no use_backend block.
_context = threading.local()
_process_backend: Optional[str] = None


def set_backend(name: Optional[str]) -> None:
    """Set the process-wide default backend (``None`` clears it)."""
    global _process_backend
    _process_backend = None if name is None else _check_name(name)


class use_backend(contextlib.ContextDecorator):
    """Ops without an explicit ``backend=`` use ``name`` inside a ``with`` block, or inside every
    call of a function decorated with ``@use_backend(name)``; per thread, restored on exit.

    ``name`` is checked here, when ``use_backend(name)`` is called, so an unknown one raises at
    once. Called bare, without ``with`` or a decorated function, it does nothing, as any context
    manager; so that this cannot pass unnoticed, a ``use_backend`` that is never entered warns
    (``RuntimeWarning``, like a coroutine never awaited) when it is dropped.
    :func:`set_backend` is the call that sets the backend for the whole process."""

    _used = True  # until __init__ has checked the name: a rejected name raised, no warning

    def __init__(self, name: str):
        self.name = _check_name(name)
        self._used = False

    def _stack(self) -> List[Optional[str]]:
        """What each entry replaced: a stack per object and thread (the same object may be
        re-entered, and entered by several threads at once: a module-level one)."""
        stacks = getattr(_context, "entered", None)
        if stacks is None:
            stacks = _context.entered = {}
        return stacks.setdefault(id(self), [])

    def __enter__(self) -> str:
        self._used = True
        self._stack().append(getattr(_context, "backend", None))
        _context.backend = self.name
        return self.name

    def __exit__(self, *exc) -> None:
        stack = self._stack()
        _context.backend = stack.pop()
        if not stack:
            del _context.entered[id(self)]

    def __call__(self, func):
        self._used = True
        return super().__call__(func)

    def _recreate_cm(self) -> "use_backend":
        return use_backend(self.name)  # a fresh one per decorated call: threads, recursion

    def __repr__(self) -> str:
        return f"use_backend({self.name!r})"

    def __del__(self) -> None:
        if not self._used:
            warnings.warn(
                f"attnzoo.use_backend({self.name!r}) was never entered, so it changed nothing: "
                f"use `with attnzoo.use_backend({self.name!r}):` for a block (or decorate a "
                f"function with it), attnzoo.set_backend({self.name!r}) for the whole process",
                RuntimeWarning, stacklevel=2)


def reset() -> None:
    """Forget every backend request and cached choice: this thread's :func:`use_backend`, the
    process default of :func:`set_backend` and the resolution cache (also what ops cached about
    optional installs, such as NATTEN's API and Triton's version). The environment variable is
    the user's and stays. For tests, which start each case from this state."""
    global _process_backend
    _context.backend = None
    _process_backend = None
    _resolve.cache_clear()
    for clear in _install_caches:
        clear()


# cache_clear functions of what ops cached about optional installs (see on_reset)
_install_caches: List[Callable[[], None]] = []


def on_reset(*cache_clears: Callable[[], None]) -> None:
    """Have :func:`reset` also call ``cache_clears``: an op's caches of what is installed (a
    module probed once), so that a test that fakes an install sees it re-probed."""
    _install_caches.extend(cache_clears)


def _requested(explicit: Optional[str]) -> Optional[str]:
    """argument > use_backend > set_backend; ``None`` leaves the env var / auto to resolution."""
    if explicit is not None:
        return explicit
    context = getattr(_context, "backend", None)
    return context if context is not None else _process_backend


def _from_env() -> str:
    env = os.environ.get(ENV_VAR)
    return _check_name(env, f" (environment variable {ENV_VAR})") if env else "auto"


def get_backend(explicit: Optional[str] = None) -> str:
    """The requested backend name (not yet resolved): argument > context > process > env > auto."""
    requested = _requested(explicit)
    return _from_env() if requested is None else _check_name(requested)


# ---------------------------------------------------------------------------------------------
# the op registry
# ---------------------------------------------------------------------------------------------

def _always(key: tuple) -> Optional[str]:
    return None


class Backend(NamedTuple):
    """One backend of an op: ``impl(*args)`` and ``support(key) -> None | reason``;
    ``trusted(key) -> None | reason`` is what ``auto`` asks on top (a kernel not yet verified
    on the call's GPU is left to an explicit request); ``limits(key) -> None | reason``: the
    part of ``support``'s answer that the call alone decides, on any machine (NATTEN >= 0.20
    has no rpb; a kernel's largest head dim), in a short phrase that model cards state
    (:func:`call_limits`); whether it is installed and the device are ``support``'s alone."""
    impl: Callable[..., Any]
    support: Callable[[tuple], Optional[str]] = _always
    trusted: Callable[[tuple], Optional[str]] = _always
    limits: Callable[[tuple], Optional[str]] = _always


# ``examples(device, dtype)`` -> [(label, run)], ``run(backend)`` calling the public op at a
# family's real shapes (fresh inputs that require grad): what benchmarks time.
Examples = Callable[[torch.device, torch.dtype], List[Tuple[str, Callable[[str], torch.Tensor]]]]


class Case(NamedTuple):
    """One small call of an op, to check a backend against the float64 torch reference.

    ``call(*inputs, backend=name)`` calls the public op once; ``inputs`` are its tensors (all
    differentiable, made by :func:`case_inputs`) in the dtype and on the device the case was
    built for."""
    label: str
    inputs: Tuple[torch.Tensor, ...]
    call: Callable[..., torch.Tensor]


# ``cases(device, dtype)`` -> [Case]: small calls covering the op's options.
Cases = Callable[[torch.device, torch.dtype], List[Case]]


class _Op(NamedTuple):
    backends: Dict[str, Backend]
    key_type: Callable[..., tuple]
    macs: Callable[..., int]
    examples: Optional[Examples]
    cases: Optional[Cases]
    export: Callable[..., Any]


_OPS: Dict[str, _Op] = {}


def register_op(name: str, *, backends: Mapping[str, Backend], macs: Callable[..., int],
                key_type: Callable[..., tuple] = tuple, examples: Optional[Examples] = None,
                cases: Optional[Cases] = None,
                export: Optional[Callable[..., Any]] = None) -> None:
    """Register (or replace) op ``name``.

    Args:
        backends: concrete backend name -> :class:`Backend`; ``torch`` is required (the oracle).
        macs: ``macs(*args) -> int``, the op's multiply-accumulates for the arguments its
            implementations take, counted the papers' way whatever a backend really computes
            (:func:`attnzoo.profiling.count_macs` uses it).
        key_type: the call key's class, a NamedTuple whose ``device`` field (the device type)
            picks ``auto``'s order in :data:`AUTO_ORDER`; the key is rebuilt from a plain tuple
            where torch.compile needs one.
        examples: ``examples(device, dtype) -> [(label, run)]``: calls of the public op at the
            families' real shapes, ``run(backend)`` returning its output (inputs require grad);
            what ``scripts/bench_ops.py`` times.
        cases: ``cases(device, dtype) -> [Case]``: small calls covering the op's options
            (borders, odd sizes, every argument), which :func:`check_case` runs on any backend
            against the float64 reference; the tests run them on every backend that supports
            them, so a new backend of the op is tested by registering it.
        export: the op's exportable formula, same arguments as the implementations (default:
            the torch reference): what every call runs while :func:`exporting`, whatever the
            backend (see :mod:`attnzoo.ops`).
    """
    unknown = set(backends) - set(CONCRETE_BACKENDS)
    if unknown:
        raise ValueError(f"op {name!r} registers unknown backends {sorted(unknown)}; "
                         f"accepted: {', '.join(CONCRETE_BACKENDS)}")
    if "torch" not in backends:
        raise ValueError(f"op {name!r} must register the 'torch' reference backend")
    _OPS[name] = _Op(dict(backends), key_type, macs, examples, cases,
                     export or backends["torch"].impl)
    _resolve.cache_clear()


def registered_ops() -> Tuple[str, ...]:
    return tuple(sorted(_OPS))


def op_examples(op: str, device: torch.device, dtype: torch.dtype
                ) -> List[Tuple[str, Callable[[str], torch.Tensor]]]:
    """The registered benchmark calls of ``op`` (empty if it registered none)."""
    examples = _op(op).examples
    return list(examples(device, dtype)) if examples is not None else []


def _op(name: str) -> _Op:
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; registered: {', '.join(sorted(_OPS))}") from None


def available_backends(op: str, key: tuple) -> Dict[str, Optional[str]]:
    """For each concrete backend of ``op``: ``None`` if it can run call ``key``, else why not."""
    return {b: backend.support(key) for b, backend in _op(op).backends.items()}


def call_limits(op: str, keys: Sequence[tuple]) -> Dict[str, Optional[str]]:
    """For each concrete backend: ``None`` if nothing in calls ``keys`` of ``op`` is beyond it
    on any machine (its :attr:`Backend.limits`), else why, each reason once; a backend that
    ``op`` does not register is beyond it. Machine-independent: what model cards say."""
    spec = _op(op)
    result: Dict[str, Optional[str]] = {}
    for name in CONCRETE_BACKENDS:
        backend = spec.backends.get(name)
        if backend is None:
            result[name] = f"{op} has no {name!r} implementation"
            continue
        reasons = dict.fromkeys(r for r in map(backend.limits, keys) if r is not None)
        result[name] = "; ".join(reasons) or None
    return result


def supported_backends(op: str, key: tuple) -> Tuple[str, ...]:
    """Concrete backends that can run ``op`` for call ``key``."""
    return tuple(b for b, reason in available_backends(op, key).items() if reason is None)


@functools.lru_cache(maxsize=4096)
def _resolve(op: str, key: tuple, requested: str) -> str:
    spec = _op(op)
    if requested == "auto":
        device = getattr(key, "device", None)
        device = torch.device(device).type if device is not None else None  # "cuda:1" -> cuda
        for name in AUTO_ORDER.get(device, ("torch",)):
            backend = spec.backends.get(name)
            if backend and backend.support(key) is None and backend.trusted(key) is None:
                _logger.debug("attnzoo: auto backend for %s %s -> %s", op, key, name)
                return name
        reasons = "; ".join(f"{b}: {r}" for b, r in available_backends(op, key).items())
        raise BackendUnsupportedError(f"no attnzoo backend can run {op} for {key} ({reasons})")
    if requested in spec.backends:
        reason = spec.backends[requested].support(key)
    else:
        reason = f"{op} has no {requested!r} implementation"
    if reason is not None:
        others = [b for b in supported_backends(op, key) if b != requested]
        alternatives = ", ".join(repr(b) for b in others + ["auto"]) if others else "none"
        raise BackendUnsupportedError(
            f"backend {requested!r} cannot run {op} here: {reason}. "
            f"Backends that can: {alternatives}.")
    return requested


_ERRORS = {"U": BackendUnsupportedError, "V": ValueError, "T": TypeError}


@torch.compiler.assume_constant_result
def _choose(op: str, fields: tuple, requested: Optional[str]) -> str:
    """The backend for a call, or ``"!" + error code + message``: errors come back as values so
    that under torch.compile they are raised by traced code (as the real exception type where
    Dynamo allows a graph break), not wrapped as an internal Dynamo error."""
    try:
        name = _from_env() if requested is None else _check_name(requested)
        return _resolve(op, _op(op).key_type(*fields), name)
    except (ValueError, TypeError) as e:
        code = "U" if isinstance(e, BackendUnsupportedError) else (
            "V" if isinstance(e, ValueError) else "T")
        return f"!{code}{e}"


# torch 2.4-2.5's Dynamo stores an assume_constant_result value in the compiled frame's globals
# under the function's __name__: a name no module uses keeps it from shadowing anything.
_choose.__name__ = "_attnzoo_chosen_backend"


def resolve(op: str, key: tuple, backend: Optional[str] = None,
            args: Sequence[Any] = ()) -> str:
    """The concrete backend that will run ``op`` for call ``key`` (cached per call key).

    ``backend`` is the explicit argument (``None``: context/process/env/auto). Raises
    :class:`BackendUnsupportedError` when an explicitly requested backend cannot run the call,
    naming the backends that can and describing the call's ``args`` (shapes, dtypes, devices);
    ``auto`` falls back to the torch reference last.
    """
    choice = _choose(op, tuple(key), _requested(backend))
    if choice.startswith("!"):
        message = choice[2:]
        if choice[1] == "U" and args:
            message += f" The call: {op}({_describe(args)})."
        raise _ERRORS[choice[1]](message)
    return choice


def _describe(args: Sequence[Any]) -> str:
    return ", ".join(f"{str(a.dtype).replace('torch.', '')}{list(a.shape)} on {a.device}"
                     if isinstance(a, torch.Tensor) else repr(a) for a in args)


# Context-manager factories ``observer(op, backend, macs)`` entered around every dispatched call
# while observe_ops() is active (profiling); empty otherwise, so dispatch pays one truth test.
_observers: List[Callable[[str, str, int], ContextManager]] = []


@contextlib.contextmanager
def observe_ops(observer: Callable[[str, str, int], ContextManager]) -> Iterator[None]:
    """Within the block, every op call runs inside ``observer(op_name, backend, macs)``:
    the backend that runs it and the op's registered MAC formula for that call."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)


# Per record_calls() block, each op's distinct call keys in order of appearance; empty otherwise.
_recorders: List[Dict[str, List[tuple]]] = []


@contextlib.contextmanager
def record_calls() -> Iterator[Dict[str, List[tuple]]]:
    """Within the block, the call key of every dispatched op call is recorded: the yielded
    dict maps each op to its distinct keys (what :func:`call_limits` takes)."""
    calls: Dict[str, List[tuple]] = {}
    _recorders.append(calls)
    try:
        yield calls
    finally:
        _recorders.remove(calls)


# torch.export (the ONNX dynamo exporter included) sets this flag; torch < 2.5 has no such flag.
# The flag is read, not torch.compiler.is_exporting(): torch 2.11's Dynamo folds that call to
# True under every torch.compile, which would put compiled models on the export formulas.
if hasattr(torch.compiler, "_is_exporting_flag"):
    def _is_exporting() -> bool:
        return torch.compiler._is_exporting_flag
else:
    _is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


def exporting() -> bool:
    """Whether the running code is being traced for export: by ``torch.export`` (which the ONNX
    dynamo exporter runs) or by ``torch.jit.trace`` (which the TorchScript ONNX exporter
    runs). Ops then run their exportable formula, whatever the backend."""
    return _is_exporting() or torch.jit.is_tracing()


def export_dropout(dropout: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``dropout(x)`` in an export formula: skipped in eval, where it is the identity yet still
    a node of the exported graph, one more for the exporters' per-node work."""
    return dropout(x) if dropout.training else x


# Per torch.export trace (keyed by its fake-tensor mode, dropped with it): export_memo's values.
_export_memos: "weakref.WeakKeyDictionary[Any, Dict[tuple, Any]]" = weakref.WeakKeyDictionary()


def export_memo(key: tuple, like: torch.Tensor, make: Callable[..., Any], *args: Any) -> Any:
    """``make(*args)`` once per ``torch.export`` trace and ``key``: the index tensors an export
    formula derives from sizes are then shared by every layer of the same sizes (a stage's
    blocks) and sit in the graph once, not once per block. The dynamo exporter's time grows with
    the graph (BENCHMARKS.md "ONNX export"); ``make``'s tensors are only read, never written.

    ``key`` holds plain values and sizes; a traced size counts as its symbolic expression, equal
    expressions being equal sizes. ``like`` is a tensor of the trace. Elsewhere (eager calls,
    ``torch.jit.trace``, whose sizes are traced values with no expression), ``make`` runs."""
    mode = torch._guards.detect_fake_mode((like,)) if _is_exporting() else None
    if mode is None:
        return make(*args)
    key = tuple(str(k) if isinstance(k, torch.SymInt) else k for k in key)
    memo = _export_memos.setdefault(mode, {})
    if key not in memo:
        memo[key] = make(*args)
    return memo[key]


# What the argument checks of warm calls returned, by the calls' metadata (checked_once).
_CHECKED: Dict[tuple, Any] = {}
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def tensors_key(*tensors: Optional[torch.Tensor]) -> Optional[tuple]:
    """Each tensor's ``(shape, strides, dtype, device)`` (``None`` for ``None``): what an op's
    argument checks decide a tensor by (the strides: how far the kernels' offsets reach).
    ``None`` where one is not a plain tensor: no key, the checks run (and say what is wrong); a
    traced tensor's sizes may be symbolic."""
    key = []
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) in _PLAIN_TENSORS:
            key.append((t.shape, t.stride(), t.dtype, t.device))
        else:
            return None
    return tuple(key)


def checked_once(key: Optional[tuple], check: Callable[[], Any]) -> Any:
    """``check()``: an op's argument checks, returning what the call derives from them (its
    call key, normalised sizes), run once per ``key``, the call's metadata that they decide by
    (the op's name, its options, :func:`tensors_key`), so that warm calls skip them (every
    block of a model after its first step). ``key`` ``None``, or while torch.compile traces
    (a global dict read and written there would be guarded and replayed): every time."""
    if key is None or torch.compiler.is_compiling():
        return check()
    result = _CHECKED.get(key)
    if result is None:
        result = check()
        if len(_CHECKED) >= 4096:  # (inputs of ever new sizes)
            _CHECKED.clear()
        _CHECKED[key] = result
    return result


def dispatch(op: str, key: tuple, backend: Optional[str], *args: Any,
             empty: Optional[bool] = None) -> Any:
    """Run ``op`` for call ``key`` on the backend the selection rules give; ``args`` (already
    validated by the public op) go to the implementation unchanged.

    A call with an empty tensor (a batch of 0) is still resolved, so an unsupported request
    raises as for any other size, but the torch reference computes it: its result is empty
    (or a reduction over nothing), and kernels may refuse empty launches (NATTEN does).
    ``empty``: whether a tensor of ``args`` is empty, where the op knows it already (its
    checks, run once per call metadata); ``None``: looked at here.

    While :func:`exporting`, the op's export formula runs instead, and no backend is resolved."""
    spec = _OPS[op]
    if exporting():
        return spec.export(*args)
    name = resolve(op, key, backend, args)
    for calls in _recorders:
        keys = calls.setdefault(op, [])
        if key not in keys:
            keys.append(key)
    if empty is None:
        empty = 0 in [a.numel() for a in args if isinstance(a, torch.Tensor)]
    impl = spec.backends["torch" if empty else name].impl
    if not _observers:
        return impl(*args)
    with contextlib.ExitStack() as stack:
        for observer in _observers:
            stack.enter_context(observer(op, name, spec.macs(*args)))
        return impl(*args)


# ---------------------------------------------------------------------------------------------
# checking a backend against the reference
# ---------------------------------------------------------------------------------------------

# The largest error a backend computing in each dtype may show on the registered cases: max
# |got - ref| relative to max(1, max |ref|), for the output and each input's gradient (relative:
# the gradients of bias tables are sums over every query). From the errors of the torch reference
# and the Triton kernels on those cases (tests/test_ops_registry.py), with margin.
TOLERANCE: Dict[torch.dtype, float] = {
    torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 8e-2}


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """Within the block, fp32 is computed as fp32: no TF32 in matmuls (cuBLAS and attnzoo's
    kernels follow ``torch.get_float32_matmul_precision()``) nor in cuDNN's convolutions (on by
    default: QnA's depthwise convolutions). What a comparison against the float64 reference at
    fp32's tolerance needs on a GPU; restored on exit."""
    cudnn_tf32, precision = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
        torch.set_float32_matmul_precision(precision)


class CheckResult(NamedTuple):
    """Errors of a backend on a :class:`Case`, measured as :data:`TOLERANCE` says."""
    forward: float
    backward: Optional[float]  # the largest over the inputs' gradients; None: not checked


def case_inputs(shapes: Sequence[Sequence[int]], device: torch.device, dtype: torch.dtype,
                seed: int = 0) -> Tuple[torch.Tensor, ...]:
    """Standard-normal tensors of ``shapes`` for a :class:`Case`, drawn in float64 on the CPU from
    ``seed`` (the same values on every device), then rounded to ``dtype`` on ``device``."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(device, dtype)
                 for shape in shapes)


def op_cases(op: str, device: Union[str, torch.device], dtype: torch.dtype) -> List[Case]:
    """The registered check cases of ``op`` for ``device`` and ``dtype`` (empty if none)."""
    cases = _op(op).cases
    return list(cases(torch.device(device), dtype)) if cases is not None else []


class _Chosen(Exception):
    """Stops a dry run once dispatch has chosen a backend."""


def _stop(op: str, backend: str, macs: int) -> ContextManager:
    raise _Chosen


def case_support(case: Case, backend: str, backward: bool = True) -> Optional[str]:
    """``None`` if ``backend`` can run ``case`` (its backward too, with ``backward``), else why
    not: the op's own answer, from a dry run of the call that stops once dispatch has chosen
    the backend (no computation)."""
    leaves = [t.detach().requires_grad_(backward) for t in case.inputs]
    try:
        with torch.set_grad_enabled(backward), observe_ops(_stop):
            case.call(*leaves, backend=backend)
    except _Chosen:
        return None
    except BackendUnsupportedError as e:
        return str(e)
    raise RuntimeError(f"check case {case.label!r} returned without dispatching an op")


def _run_case(case: Case, inputs: Sequence[torch.Tensor], backend: str, backward: bool,
              weight_dtype: torch.dtype) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]:
    leaves = [t.detach().requires_grad_(backward) for t in inputs]
    with torch.set_grad_enabled(backward):
        out = case.call(*leaves, backend=backend)
    if not backward:
        return out, ()
    # the gradients of a fixed random weighting of the output; the weights are rounded to the
    # checked dtype, so that the backend and the float64 reference see the same ones
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64).to(weight_dtype)
    return out, torch.autograd.grad(out, leaves, weight.to(out))


def _error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    ref = ref.detach()
    return float((got.detach().to(ref) - ref).abs().max()) / max(1.0, float(ref.abs().max()))


def check_case(case: Case, backend: str, backward: bool = True) -> CheckResult:
    """Run ``case`` on ``backend`` and on the torch reference in float64 (on the same values:
    the case's inputs, rounded to its dtype), the output and, with ``backward``, the gradients
    of every input, fp32 without TF32 (:func:`exact_fp32`); return the largest errors (see
    :data:`TOLERANCE`). A backend that cannot
    run the case raises :class:`BackendUnsupportedError` (:func:`case_support` tells first)."""
    dtype = case.inputs[0].dtype
    with exact_fp32():  # fp32 rows compare fp32 itself, not TF32, with the reference
        out, grads = _run_case(case, case.inputs, backend, backward, dtype)
    ref, ref_grads = _run_case(case, [t.to(torch.float64) for t in case.inputs], "torch",
                               backward, dtype)
    return CheckResult(_error(out, ref), max(map(_error, grads, ref_grads)) if backward else None)
