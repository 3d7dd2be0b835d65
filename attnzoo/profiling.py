"""Model size and cost accounting, and the measuring every benchmark shares.

Counting: :func:`count_params`, :func:`count_macs` (fvcore's convention, the papers').
Measuring (``attnzoo bench`` and every script in ``scripts/``): :func:`time_steps` (the timing
loop), :func:`time_call` and :func:`time_op_calls` (median time and peak memory of a call, or of
the attnzoo ops inside it), :class:`PeakMemory`, :func:`model_step` (an inference or training
step), :data:`CLOCKS`, :data:`DTYPES`, :func:`synchronize`. Printing: :func:`fmt`, :func:`table`,
:func:`first_line`, :func:`device_name`, :func:`write_table` (a script's figures into
BENCHMARKS.md between its markers).
"""
from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from typing import Callable, Iterable, List, NamedTuple, Optional, Sequence, Union

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from . import backends

__all__ = ["count_params", "count_macs", "CLOCKS", "DTYPES", "synchronize", "time_steps",
           "PeakMemory", "Timing", "time_call", "time_op_calls", "model_step", "fmt", "table",
           "first_line", "device_name", "write_table"]


def _sdpa_cpu_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)  # FlopCounterMode passes shapes


# FlopCounterMode counts SDPA's CUDA kernels and its math path (the meta device) but not the CPU
# flash kernel: without this, a model's count would depend on its device.
_SDPA_CPU = {op: _sdpa_cpu_flops for op in [
    getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)] if op is not None}


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model: torch.nn.Module,
               input_size: Union[Sequence[int], torch.Tensor]) -> int:
    """Multiply-accumulates of one forward pass, counted like fvcore (the papers' convention):
    convolutions and matmuls as PyTorch's FlopCounterMode sees them, and every registered
    attnzoo op by its registered MAC formula, whatever its backend actually computes (the tiled
    NA reference does more, an elementwise aggregation shows FlopCounterMode nothing).
    ``input_size``: the input's shape ``(B, C, H, W)``, or an input tensor (fvcore's and thop's
    habit), counted as it is."""
    if isinstance(input_size, torch.Tensor):
        x = input_size
    else:
        if not (isinstance(input_size, Sequence) and all(
                isinstance(n, int) and not isinstance(n, bool) for n in input_size)):
            raise TypeError(f"count_macs: input_size must be a shape such as (1, 3, 224, 224) "
                            f"or an input tensor, got {input_size!r}")
        param = next(model.parameters())
        x = torch.randn(*input_size, device=param.device, dtype=param.dtype)
    counter = FlopCounterMode(display=False, custom_mapping=_SDPA_CPU)
    seen_flops, op_macs = [0], [0]

    @contextlib.contextmanager
    def observer(op: str, backend: str, macs: int):
        before = counter.get_total_flops()
        yield
        seen_flops[0] += counter.get_total_flops() - before
        op_macs[0] += macs

    # The torch references run anywhere, the meta device included (NATTEN's Flex path cannot
    # run under a FlopCounterMode); the count does not depend on the backend.
    with torch.no_grad(), backends.use_backend("torch"), backends.observe_ops(observer), counter:
        model(x)
    return (counter.get_total_flops() - seen_flops[0]) // 2 + op_macs[0]


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------

# wall time by default; "process" is this process's CPU time, which other processes on a shared
# CPU machine disturb much less (with one thread it equals the wall time of a quiet machine).
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
# the benchmarks' short dtype names
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

Clock = Callable[[], float]


def synchronize(device: Union[str, torch.device]) -> None:
    """Wait for ``device``'s queued kernels (a no-op on CPU), so a measurement contains them."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(fn: Callable[[], object], device: Union[str, torch.device], warmup: int = 1,
               repeats: int = 5, clock: Clock = time.perf_counter) -> List[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls; on CUDA
    each call is synchronised so its kernels are inside the measurement."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        synchronize(device)
        times.append(clock() - start)
    return times


def _status_mib(field: str) -> Optional[float]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory above what was allocated at :meth:`start`: CUDA allocator statistics, or on
    CPU the growth of the peak resident set (Linux ``/proc/self/status`` VmHWM, reset through
    ``/proc/self/clear_refs``; an indicator only: memory the allocator already holds is reused
    without growing it). ``None`` where it cannot be measured."""

    def __init__(self, device: Union[str, torch.device]):
        self.device = torch.device(device)
        self.base: Optional[float] = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device) / 2 ** 20
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current RSS
                self.base = _status_mib("VmRSS")
            except OSError:
                self.base = None

    def peak_mib(self) -> Optional[float]:
        if self.base is None:
            return None
        if self.device.type == "cuda":
            synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / 2 ** 20 - self.base
        hwm = _status_mib("VmHWM")
        return None if hwm is None else max(hwm - self.base, 0.0)


class Timing(NamedTuple):
    ms: float                  # median
    peak_mib: Optional[float]  # PeakMemory over the timed calls


def time_call(fn: Callable[[], torch.Tensor], device: Union[str, torch.device],
              backward: bool = False, warmup: int = 1, repeats: int = 5,
              clock: Clock = time.perf_counter) -> Timing:
    """Median time of ``fn()`` (under ``no_grad``; with ``backward``, plus the backward of its
    output with a constant gradient, no RNG inside the timing) and the peak memory of the timed
    calls."""
    def step():
        if backward:
            out = fn()
            out.backward(torch.ones_like(out))
        else:
            with torch.no_grad():
                fn()

    for _ in range(warmup):
        step()
    synchronize(device)
    memory = PeakMemory(device)
    memory.start()
    times = time_steps(step, device, warmup=0, repeats=repeats, clock=clock)
    return Timing(statistics.median(times) * 1e3, memory.peak_mib())


def time_op_calls(run: Callable[[], torch.Tensor], device: Union[str, torch.device],
                  backward: bool = False, warmup: int = 1, repeats: int = 5,
                  clock: Clock = time.perf_counter) -> Timing:
    """Median time of the attnzoo op calls inside ``run()`` (observed at dispatch, so not the
    creation of their inputs) plus, with ``backward``, of ``out.backward(grad)``; peak memory
    from an op's entry to the end of the backward."""
    memory = PeakMemory(device)
    spent: List[float] = []

    @contextlib.contextmanager
    def observer(op: str, backend: str, macs: int):
        synchronize(device)
        memory.start()
        start = clock()
        yield
        synchronize(device)
        spent.append(clock() - start)

    times, peaks = [], []
    for i in range(warmup + repeats):
        spent.clear()
        grad_ctx = contextlib.nullcontext() if backward else torch.no_grad()
        with grad_ctx, backends.observe_ops(observer):
            out = run()
        total = sum(spent)
        if backward:
            grad = torch.randn_like(out)
            synchronize(device)
            start = clock()
            out.backward(grad)
            synchronize(device)
            total += clock() - start
        peak = memory.peak_mib()
        del out
        if i >= warmup:
            times.append(total * 1e3)
            peaks.append(peak)
    peaks = [p for p in peaks if p is not None]
    return Timing(statistics.median(times), max(peaks) if peaks else None)


def model_step(model: torch.nn.Module, x: torch.Tensor, backward: bool = False,
               optimizer: Optional[torch.optim.Optimizer] = None) -> Callable[[], None]:
    """One benchmark step of ``model`` on ``x``: a forward under ``no_grad``; with ``backward``
    a forward and the backward of a cross-entropy loss (against class 0); with an
    ``optimizer`` also its ``zero_grad`` and ``step``: a training step."""
    if not backward:
        def infer():
            with torch.no_grad():
                model(x)
        return infer
    target = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)

    def train():
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x).float(), target).backward()
        if optimizer is not None:
            optimizer.step()
    return train


# ---------------------------------------------------------------------------------------------
# printing
# ---------------------------------------------------------------------------------------------

def fmt(x: Optional[float], spec: str = ".2f", width: int = 9, suffix: str = "") -> str:
    """``x`` formatted by ``spec`` with ``suffix`` (``"x"`` for a ratio), right-aligned in
    ``width``; ``n/a`` for ``None``."""
    return (format(x, spec) + suffix if x is not None else "n/a").rjust(width)


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A plain-text table: the header, a rule, one line per row; the first column left-aligned,
    the others right-aligned, each as wide as its widest cell (format numbers with :func:`fmt`
    first)."""
    rows = [[str(cell).strip() for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in [list(header)] + rows) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return " ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    head = line(header)
    return "\n".join([head, "-" * len(head)] + [line(r) for r in rows])


def first_line(e: BaseException) -> str:
    """An error's first line (its type where it has no message): a progress row's reason."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def device_name(device: Union[str, torch.device]) -> str:
    """The GPU's name, or the CPU's (``platform.processor()``, else the machine type)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def write_table(path: Union[str, "os.PathLike[str]"], script: str, text: str) -> None:
    """Replace what lies between ``<!-- {script} table begin -->`` and ``... end -->`` in
    ``path`` (BENCHMARKS.md) with ``text``: a script rewrites its own figures, nothing else."""
    begin, end = f"<!-- {script} table begin -->", f"<!-- {script} table end -->"
    with open(path) as f:
        old = f.read()
    if begin not in old or end not in old:
        raise ValueError(f"{path} has no {begin} ... {end} markers")
    head, rest = old.split(begin, 1)
    with open(path, "w") as f:
        f.write(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")
