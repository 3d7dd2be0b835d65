"""What ``attnzoo check`` runs: every registered op's check cases on a backend, against the float64
torch reference, on the user's own hardware.

:func:`check_backend` runs one op's cases (:func:`attnzoo.backends.op_cases`) on one backend in
one dtype: per case, the op's own answer whether the backend can run it (and its backward), then
:func:`attnzoo.backends.check_case` where it can, and the worst errors against
:data:`attnzoo.backends.TOLERANCE`. A backend that fails in any other way (a kernel that does not
compile on this GPU, a driver error) fails its case with that error: finding those is what the
check is for. The ops register themselves when :mod:`attnzoo` is imported.
"""
from __future__ import annotations

import time
from typing import NamedTuple, Optional, Tuple, Union

import torch

from . import backends

__all__ = ["BackendCheck", "check_backend", "within", "severity"]


class BackendCheck(NamedTuple):
    """One op's check cases on one backend in one dtype."""
    op: str
    backend: str
    dtype: torch.dtype
    cases: int                   # the op's registered cases
    checked: Tuple[str, ...]     # labels of the cases run, forward and backward
    forward_only: Tuple[str, ...]  # labels run forward only (no backward on this backend here)
    not_run: Tuple[str, ...]     # why the other cases did not run, once per distinct reason
    forward: Optional[float]     # the worst error of the outputs (None: nothing ran)
    backward: Optional[float]    # the worst error of the inputs' gradients (None: none ran)
    failures: Tuple[Tuple[str, str], ...]  # (label, what is wrong): errors above tolerance
    seconds: float               # the check's time: backend and float64 reference

    @property
    def tolerance(self) -> float:
        return backends.TOLERANCE[self.dtype]


def within(error: Optional[float], tolerance: float) -> bool:
    """Whether ``error`` passes (a NaN does not; None, nothing measured, does)."""
    return error is None or error <= tolerance


def _reason(message: str) -> str:
    """The backend's own reason in a BackendUnsupportedError's message, without the op name and
    the list of backends that can (the table has both)."""
    reason = message.partition(" here: ")[2] or message
    return reason.rpartition(". Backends that can:")[0] or reason


def severity(error: Optional[float]) -> float:
    """Sort key of errors: the largest is the worst, a NaN worse than any (``max`` alone would
    keep whichever came first), nothing measured (None) the least."""
    return -1.0 if error is None else float("inf") if error != error else error


def _worst(errors) -> Optional[float]:
    return max(errors, key=severity, default=None)


def check_backend(op: str, backend: str, device: Union[str, torch.device],
                  dtype: torch.dtype) -> BackendCheck:
    """Run every check case of ``op`` that ``backend`` can run on ``device`` in ``dtype``
    (forward and every input's gradient; forward only where the backend has no backward here)
    against the float64 torch reference."""
    start = time.perf_counter()
    tolerance = backends.TOLERANCE[dtype]
    cases = backends.op_cases(op, device, dtype)
    checked, forward_only, not_run, failures = [], [], [], []
    forward, backward = [], []
    for case in cases:
        try:
            reason = backends.case_support(case, backend)
            with_backward = reason is None
            if not with_backward and backends.case_support(case, backend, False) is not None:
                if _reason(reason) not in not_run:
                    not_run.append(_reason(reason))
                continue
            result = backends.check_case(case, backend, with_backward)
        except Exception as e:  # noqa: BLE001 - any error of a backend is a failed check
            failures.append((case.label, f"{type(e).__name__}: {' '.join(str(e).split())}"))
            continue
        (checked if with_backward else forward_only).append(case.label)
        forward.append(result.forward)
        wrong = [f"forward {result.forward:.1e}"] if not within(result.forward, tolerance) else []
        if with_backward:
            backward.append(result.backward)
            if not within(result.backward, tolerance):
                wrong.append(f"backward {result.backward:.1e}")
        if wrong:
            failures.append((case.label, f"{', '.join(wrong)} > {tolerance:.0e}"))
    return BackendCheck(op, backend, dtype, len(cases), tuple(checked), tuple(forward_only),
                        tuple(not_run), _worst(forward), _worst(backward), tuple(failures),
                        time.perf_counter() - start)
