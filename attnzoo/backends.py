"""The attention backend switch.

Every local-attention op in :mod:`attnzoo.ops` can run on several backends:

* ``"torch"``  - pure PyTorch reference, any device and dtype; the numerical oracle.
* ``"natten"`` - NATTEN's kernels (optional: ``pip install --no-build-isolation natten``).
* ``"cuda"``   - attnzoo's own fused Triton kernels (CUDA tensors; CPU only under
  ``TRITON_INTERPRET=1``).
* ``"auto"``   - per call, the fastest backend that supports it; ``torch`` is the last resort.

Selection, most specific first: an explicit ``backend=`` argument, :func:`use_backend` (a
context manager), :func:`set_backend` (process default), the ``ATTNZOO_BACKEND`` environment
variable, then ``"auto"``. An explicitly requested backend that cannot do a call raises
:class:`BackendUnsupportedError` naming the backends that can; it never falls back silently.

Ops describe a call with a small hashable key (device type, dtype, options) and register, per
backend, a function returning ``None`` when the backend supports that key or a short reason
when it does not. ``auto`` decisions are cached per (op, key).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

__all__ = [
    "BACKENDS", "BackendUnsupportedError", "set_backend", "get_backend", "use_backend",
    "resolve", "register_op", "available_backends", "supported_backends",
]

_logger = logging.getLogger(__name__)

BACKENDS: Tuple[str, ...] = ("torch", "natten", "cuda", "auto")
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


# A ContextVar (not a thread-local) so use_backend() also scopes correctly across asyncio tasks;
# reading it is cheap enough for every op call.
_context_backend: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar(
    "attnzoo_backend", default=None)
_process_backend: Optional[str] = None


def set_backend(name: Optional[str]) -> None:
    """Set the process-wide default backend (``None`` clears it)."""
    global _process_backend
    _process_backend = None if name is None else _check_name(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Within the ``with`` block, ops without an explicit ``backend=`` use ``name``."""
    token = _context_backend.set(_check_name(name))
    try:
        yield _context_backend.get()
    finally:
        _context_backend.reset(token)


def get_backend(explicit: Optional[str] = None) -> str:
    """The requested backend name (not yet resolved): argument > context > process > env > auto."""
    if explicit is not None:
        return _check_name(explicit)
    for value in (_context_backend.get(), _process_backend):
        if value is not None:
            return value
    env = os.environ.get(ENV_VAR)
    if env:
        return _check_name(env, argument=f"environment variable {ENV_VAR}")
    return "auto"


# op name -> ({backend: support check}, auto's order of preference for a call key)
_SupportFn = Callable[[tuple], Optional[str]]
_OrderFn = Callable[[tuple], Sequence[str]]
_OPS: Dict[str, Tuple[Dict[str, _SupportFn], _OrderFn, Callable[[tuple], tuple]]] = {}


def register_op(op: str, support: Dict[str, _SupportFn], order: Optional[_OrderFn] = None,
                key_type: Callable[..., tuple] = tuple) -> None:
    """Register an op's backends. ``support`` maps each concrete backend to
    ``fn(key) -> None | reason``; ``order(key)`` lists the backends ``auto`` tries for that call,
    fastest first (default: the order of ``support``); ``key_type`` is the call key's class (a
    NamedTuple), rebuilt from a plain tuple where torch.compile needs one."""
    unknown = set(support) - set(BACKENDS[:-1])
    if unknown:
        raise ValueError(f"op {op!r} registers unknown backends {sorted(unknown)}")
    _OPS[op] = (dict(support), order or (lambda key: tuple(support)), key_type)
    _resolve.cache_clear()


def _support(op: str) -> Dict[str, _SupportFn]:
    try:
        return _OPS[op][0]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; registered: {sorted(_OPS)}") from None


def supported_backends(op: str, key: tuple) -> Tuple[str, ...]:
    """Concrete backends that can run ``op`` for call ``key``."""
    return tuple(b for b, fn in _support(op).items() if fn(key) is None)


def available_backends(op: str, key: tuple) -> Dict[str, Optional[str]]:
    """For each concrete backend of ``op``: ``None`` if it can run ``key``, else the reason."""
    return {b: fn(key) for b, fn in _support(op).items()}


@functools.lru_cache(maxsize=4096)
def _resolve(op: str, key: tuple, requested: str) -> str:
    support = _support(op)
    if requested == "auto":
        for backend in _OPS[op][1](key):
            if support[backend](key) is None:
                _logger.debug("attnzoo: auto backend for %s%s -> %s", op, key, backend)
                return backend
        reasons = "; ".join(f"{b}: {r}" for b, r in available_backends(op, key).items())
        raise BackendUnsupportedError(f"no attnzoo backend can run {op} for {key} ({reasons})")
    reason = support[requested](key) if requested in support else (
        f"{op} has no {requested!r} implementation")
    if reason is not None:
        others = [b for b in supported_backends(op, key) if b != requested]
        alternatives = ", ".join(repr(b) for b in others + ["auto"]) if others else "none"
        raise BackendUnsupportedError(
            f"backend {requested!r} cannot run {op} here: {reason}. "
            f"Backends that can: {alternatives}.")
    return requested


# Under torch.compile the choice is a constant of the graph: Dynamo neither traces the support
# checks (nor the debug log) nor breaks the graph for them. It gets the key as a plain tuple
# (Dynamo mis-rebuilds NamedTuple arguments of constant-result functions).
@torch.compiler.assume_constant_result
def _resolve_constant(op: str, fields: tuple, requested: str) -> str:
    return _resolve(op, _OPS[op][2](*fields), requested)


def resolve(op: str, key: tuple, backend: Optional[str] = None) -> str:
    """The concrete backend that will run ``op`` for call ``key`` (cached per call key).

    ``backend`` is the explicit argument (``None``: context/process/env/auto). Raises
    :class:`BackendUnsupportedError` when an explicitly requested backend cannot run the call,
    naming the backends that can; ``auto`` falls back to the torch reference last.
    """
    _support(op)  # unknown ops fail here, with the list of registered ones
    return _resolve_constant(op, tuple(key), get_backend(backend))
