"""The attention backend switch and the op registry.

Every local-attention op in :mod:`attnzoo.ops` can run on several backends:

* ``"torch"``  - pure PyTorch reference, any device and dtype; the numerical oracle.
* ``"natten"`` - NATTEN's kernels (optional: ``pip install --no-build-isolation natten``).
* ``"cuda"``   - attnzoo's own fused Triton kernels (CUDA tensors; CPU only under
  ``TRITON_INTERPRET=1``).
* ``"auto"``   - per call, the fastest backend that supports it; ``torch`` is the last resort.

Selection, most specific first: an explicit ``backend=`` argument, :func:`use_backend` (a
context manager, per thread), :func:`set_backend` (process default), the ``ATTNZOO_BACKEND``
environment variable, then ``"auto"``. An explicitly requested backend that cannot do a call
raises :class:`BackendUnsupportedError` naming the backends that can; it never falls back
silently.

An op registers once (:func:`register_op`): per backend its implementation and support check,
``auto``'s order, the call-key type and its analytical MAC formula. Its public function validates
the arguments, describes the call with a small hashable key (device type, dtype, options) and
hands everything to :func:`dispatch`, which resolves the backend, lets profilers observe the call
(:func:`observe_ops`) and runs the implementation.

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
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, NamedTuple
from typing import Optional, Sequence, Tuple

import torch

__all__ = [
    "BACKENDS", "CONCRETE_BACKENDS", "ENV_VAR", "BackendUnsupportedError", "Backend", "set_backend", "get_backend",
    "use_backend", "register_op", "registered_ops", "dispatch", "resolve", "available_backends",
    "supported_backends", "observe_ops", "op_examples",
]

_logger = logging.getLogger(__name__)

# The backends that run ops (the torch reference first), and every name a user may request.
CONCRETE_BACKENDS: Tuple[str, ...] = ("torch", "natten", "cuda")
BACKENDS: Tuple[str, ...] = CONCRETE_BACKENDS + ("auto",)
ENV_VAR = "ATTNZOO_BACKEND"


class BackendUnsupportedError(ValueError):
    """An explicitly requested backend cannot run this call (or is not installed)."""


def _check_name(name: object, argument: str = "backend") -> str:
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a str, one of {BACKENDS}; got {type(name).__name__}")
    lowered = name.strip().lower()
    if lowered not in BACKENDS:
        raise ValueError(f"unknown {argument} {name!r}; accepted: {', '.join(BACKENDS)}")
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


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Within the ``with`` block (in this thread), ops without an explicit ``backend=`` use
    ``name``."""
    name = _check_name(name)
    previous = getattr(_context, "backend", None)
    _context.backend = name
    try:
        yield name
    finally:
        _context.backend = previous


def _requested(explicit: Optional[str]) -> Optional[str]:
    """argument > use_backend > set_backend; ``None`` leaves the env var / auto to resolution."""
    if explicit is not None:
        return explicit
    context = getattr(_context, "backend", None)
    return context if context is not None else _process_backend


def _from_env() -> str:
    env = os.environ.get(ENV_VAR)
    return _check_name(env, argument=f"environment variable {ENV_VAR}") if env else "auto"


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
    """One backend of an op: ``impl(*args)`` and ``support(key) -> None | reason``."""
    impl: Callable[..., Any]
    support: Callable[[tuple], Optional[str]] = _always


# ``examples(device, dtype)`` -> [(label, run)], ``run(backend)`` calling the public op at a
# family's real shapes (fresh inputs that require grad): what benchmarks time.
Examples = Callable[[torch.device, torch.dtype], List[Tuple[str, Callable[[str], torch.Tensor]]]]


class _Op(NamedTuple):
    backends: Dict[str, Backend]
    order: Callable[[tuple], Sequence[str]]
    key_type: Callable[..., tuple]
    macs: Callable[..., int]
    examples: Optional[Examples]


_OPS: Dict[str, _Op] = {}


def register_op(name: str, *, backends: Mapping[str, Backend], macs: Callable[..., int],
                key_type: Callable[..., tuple] = tuple,
                order: Optional[Callable[[tuple], Sequence[str]]] = None,
                examples: Optional[Examples] = None) -> None:
    """Register (or replace) op ``name``.

    Args:
        backends: concrete backend name -> :class:`Backend`; ``torch`` is required (the oracle).
        macs: ``macs(*args) -> int``, the op's multiply-accumulates for the arguments its
            implementations take, counted the papers' way whatever a backend really computes
            (:func:`attnzoo.profiling.count_macs` uses it).
        key_type: the call key's class (a NamedTuple); the key is rebuilt from a plain tuple
            where torch.compile needs one.
        order: ``order(key)`` lists the backends ``auto`` tries for that call, fastest first
            (default: the order of ``backends``).
        examples: ``examples(device, dtype) -> [(label, run)]``: calls of the public op at the
            families' real shapes, ``run(backend)`` returning its output (inputs require grad);
            what ``scripts/bench_ops.py`` times.
    """
    unknown = set(backends) - set(CONCRETE_BACKENDS)
    if unknown:
        raise ValueError(f"op {name!r} registers unknown backends {sorted(unknown)}; "
                         f"accepted: {', '.join(CONCRETE_BACKENDS)}")
    if "torch" not in backends:
        raise ValueError(f"op {name!r} must register the 'torch' reference backend")
    _OPS[name] = _Op(dict(backends), order or (lambda key: tuple(backends)), key_type, macs,
                     examples)
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


def supported_backends(op: str, key: tuple) -> Tuple[str, ...]:
    """Concrete backends that can run ``op`` for call ``key``."""
    return tuple(b for b, reason in available_backends(op, key).items() if reason is None)


@functools.lru_cache(maxsize=4096)
def _resolve(op: str, key: tuple, requested: str) -> str:
    spec = _op(op)
    if requested == "auto":
        for name in spec.order(key):
            if spec.backends[name].support(key) is None:
                _logger.debug("attnzoo: auto backend for %s%s -> %s", op, key, name)
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


def dispatch(op: str, key: tuple, backend: Optional[str], *args: Any) -> Any:
    """Run ``op`` for call ``key`` on the backend the selection rules give; ``args`` (already
    validated by the public op) go to the implementation unchanged."""
    spec = _OPS[op]
    name = resolve(op, key, backend, args)
    impl = spec.backends[name].impl
    if not _observers:
        return impl(*args)
    with contextlib.ExitStack() as stack:
        for observer in _observers:
            stack.enter_context(observer(op, name, spec.macs(*args)))
        return impl(*args)
