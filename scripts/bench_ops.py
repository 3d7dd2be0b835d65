#!/usr/bin/env python
"""Benchmark every backend of every registered attnzoo op, and NA against its baselines. Not a
test: it prints ratios measured in one run (and optionally writes JSON and a PNG plot).

Part 1, every op: for each op in ``attnzoo.backends.registered_ops()`` and each call of
``attnzoo.backends.op_examples(op, device, dtype)`` (the families' real shapes), every backend
(torch, natten, cuda) that can run it: time and peak memory of the forward (under no_grad) and of
forward+backward, and the ratio of the torch reference's time to each backend's. Only the op is
timed (an ``observe_ops`` observer around the dispatched call, plus ``backward()``), not the
example's input creation.

Part 2, NA at NAT-tiny's stage shapes (224 px: 56/28/14/7 px, 2/4/8/16 heads, head dim 32,
K=7) and DiNAT's dilated ones: attnzoo ``cuda`` with RPB (and without), the ``torch`` reference
with RPB, ``natten`` (NATTEN >= 0.20 has no RPB) and FlexAttention with a neighborhood block
mask (compiled; dilation and clamped windows in its mask_mod, no RPB), with the ratios
flex / cuda, torch / cuda and natten / cuda. On a GPU it also prints the achieved fraction of
the memory-bandwidth bound (reading q, k, v and writing o once for the forward; reading
q, k, v, o, dO and writing dQ, dK, dV once more for the backward) at the device's peak
bandwidth (from its memory clock and bus width, or --peak-gbps).

GPU targets (issue 10, bf16, forward and forward+backward, K=7, NAT-tiny stages): cuda+rpb
>= 2x faster than flex (no rpb) and >= 5x faster than the torch reference.

    python scripts/bench_ops.py                                  # CPU, fp32, what CPU can run
    python scripts/bench_ops.py --device cuda --dtype bf16 --batch 64 --plot ops.png
    python scripts/bench_ops.py --part 2 --no-flex --repeats 5
    python scripts/bench_ops.py --threads 1 --clock process --repeats 5  # a shared CPU machine
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional

os.environ.pop("TRITON_INTERPRET", None)  # a benchmark of the interpreter is meaningless

import torch  # noqa: E402

import attnzoo  # noqa: E402,F401  (registers the ops)
from attnzoo import backends  # noqa: E402
from attnzoo.ops import na2d  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CONCRETE = ("torch", "natten", "cuda")
# time.perf_counter (wall) by default; --clock process measures this process's CPU time, which
# other processes on a shared CPU machine disturb much less (use it with --threads 1).
clock = time.perf_counter
TARGETS = {"flex": 2.0, "torch": 5.0}  # required speed-up of cuda+rpb over these (GPU)


# ---------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_mib(field: str) -> Optional[float]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Memory:
    """Peak memory above what was allocated at ``start()``: CUDA allocator statistics, or on
    CPU the growth of the peak resident set (Linux; an indicator only: memory the allocator
    already holds is reused without growing it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # resets VmHWM to the current RSS
                self.base = _rss_mib("VmRSS")
            except OSError:
                self.base = None

    def peak_mib(self) -> Optional[float]:
        if self.base is None:
            return None
        if self.device.type == "cuda":
            return (torch.cuda.max_memory_allocated(self.device) - self.base) / 2 ** 20
        hwm = _rss_mib("VmHWM")
        return None if hwm is None else max(hwm - self.base, 0.0)


class Timing(NamedTuple):
    ms: float                 # median
    peak_mib: Optional[float]


def time_op_calls(run: Callable[[], torch.Tensor], device: torch.device, backward: bool,
                  warmup: int, repeats: int) -> Timing:
    """Median time of the attnzoo op calls inside ``run()`` (observed at dispatch) plus, with
    ``backward``, of ``out.backward(grad)``; peak memory from the op's entry to the end."""
    memory = Memory(device)
    spent: List[float] = []

    @contextlib.contextmanager
    def observer(op, backend, macs):
        _sync(device)
        memory.start()
        start = clock()
        yield
        _sync(device)
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
            _sync(device)
            start = clock()
            out.backward(grad)
            _sync(device)
            total += clock() - start
        peak = memory.peak_mib()
        del out
        if i >= warmup:
            times.append(total * 1e3)
            peaks.append(peak)
    peaks = [p for p in peaks if p is not None]
    return Timing(statistics.median(times), max(peaks) if peaks else None)


def fmt(x: Optional[float], spec: str = ".2f", width: int = 9) -> str:
    return (format(x, spec) if x is not None else "n/a").rjust(width)


_SEEN_REASONS: set = set()


def _first_line(e: BaseException) -> str:
    """The error's first line, or a back-reference once it was printed in full."""
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    if line in _SEEN_REASONS:
        return "(as above)"
    _SEEN_REASONS.add(line)
    return line


# ---------------------------------------------------------------------------------------------
# part 1: every backend of every registered op
# ---------------------------------------------------------------------------------------------

def part_ops(args, device, dtype) -> List[dict]:
    rows = []
    ops = [op for op in backends.registered_ops() if not args.ops or op in args.ops]
    print(f"\n== part 1: {len(ops)} registered op(s): {', '.join(ops)} ==", flush=True)
    for op in ops:
        examples = backends.op_examples(op, device, dtype)
        if not examples:
            print(f"[{op}] registers no benchmark examples", flush=True)
        for label, run in examples:
            print(f"[{op}] {label}", flush=True)
            for backward in ([False, True] if args.backward else [False]):
                kind = "fwd+bwd" if backward else "fwd"
                results: Dict[str, Timing] = {}
                for backend in CONCRETE:
                    repeats = args.repeats
                    if backend == "natten" and device.type == "cpu":
                        repeats = min(repeats, args.cpu_natten_repeats)  # seconds per call
                    try:
                        t = time_op_calls(lambda: run(backend), device, backward, args.warmup,
                                          repeats)
                    except backends.BackendUnsupportedError as e:
                        print(f"  {kind:7s} {backend:6s} unavailable: {_first_line(e)}",
                              flush=True)
                        continue
                    except (RuntimeError, NotImplementedError) as e:
                        print(f"  {kind:7s} {backend:6s} failed: {_first_line(e)}", flush=True)
                        continue
                    results[backend] = t
                    ref = results.get("torch")
                    ratio = (f"  torch/{backend} {ref.ms / t.ms:6.2f}x"
                             if ref and backend != "torch" else "")
                    print(f"  {kind:7s} {backend:6s} {t.ms:10.3f} ms  "
                          f"peak +{fmt(t.peak_mib, '.1f', 0)} MiB{ratio}", flush=True)
                rows.append(dict(part=1, op=op, case=label, kind=kind,
                                 **{f"{b}_ms": r.ms for b, r in results.items()},
                                 **{f"{b}_peak_mib": r.peak_mib for b, r in results.items()}))
    return rows


# ---------------------------------------------------------------------------------------------
# part 2: NA vs natten and FlexAttention at NAT-tiny's stage shapes
# ---------------------------------------------------------------------------------------------

def flex_na(shape, kernel: int, dilation: int, device, compile_: bool):
    """FlexAttention computing 2-D NA (clamped windows per dilation group, no RPB) on
    ``[B, H, W, heads, d]``; returns fn(q, k, v) or raises if this torch lacks it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, W, heads, D = shape
    r = kernel // 2

    def axis_ok(qi, ki, L):
        g = qi % dilation
        length = (L - g + dilation - 1) // dilation
        start = torch.minimum(torch.clamp(qi // dilation - r, min=0), length - kernel)
        kk = ki // dilation
        return (ki % dilation == g) & (kk >= start) & (kk < start + kernel)

    def mask_mod(b, h, q_idx, kv_idx):
        return (axis_ok(q_idx // W, kv_idx // W, H) & axis_ok(q_idx % W, kv_idx % W, W))

    block_mask = create_block_mask(mask_mod, None, None, H * W, H * W, device=str(device))
    attend = torch.compile(flex_attention, dynamic=False) if compile_ else flex_attention

    def fn(q, k, v):
        flat = lambda t: t.reshape(B, H * W, heads, D).transpose(1, 2)  # noqa: E731
        out = attend(flat(q), flat(k), flat(v), block_mask=block_mask, scale=D ** -0.5)
        return out.transpose(1, 2).reshape(B, H, W, heads, D)
    return fn


def peak_bandwidth_gbps(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate


def part_na(args, device, dtype) -> List[dict]:
    B = args.batch
    cases = [(f"nat_tiny s{i} {B}x{56 >> i}x{56 >> i}x{2 << i}x32 k7",
              (B, 56 >> i, 56 >> i, 2 << i, 32), 7, 1) for i in range(4)]
    cases += [(f"dinat s0 d8 {B}x56x56x2x32", (B, 56, 56, 2, 32), 7, 8),
              (f"dinat s1 d4 {B}x28x28x4x32", (B, 28, 28, 4, 32), 7, 4)]
    peak_gbps = args.peak_gbps or peak_bandwidth_gbps(device)
    print(f"\n== part 2: NA at NAT-tiny's stage shapes, batch {B} "
          f"(peak bandwidth {fmt(peak_gbps, '.0f', 0)} GB/s) ==", flush=True)
    rows = []
    for label, shape, K, d in cases:
        print(f"[{label}] dilation {d}", flush=True)
        g = torch.Generator().manual_seed(0)
        base = [torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(3)]
        rpb0 = (torch.randn((shape[3], 2 * K - 1, 2 * K - 1), generator=g) * 0.1).to(
            device=device, dtype=dtype)
        variants = {
            "cuda+rpb": lambda q, k, v, rpb: na2d(q, k, v, kernel_size=K, dilation=d, rpb=rpb,
                                                  backend="cuda"),
            "cuda": lambda q, k, v, rpb: na2d(q, k, v, kernel_size=K, dilation=d,
                                              backend="cuda"),
            "torch+rpb": lambda q, k, v, rpb: na2d(q, k, v, kernel_size=K, dilation=d, rpb=rpb,
                                                   backend="torch"),
            "natten": lambda q, k, v, rpb: na2d(q, k, v, kernel_size=K, dilation=d,
                                                backend="natten"),
        }
        if not args.no_flex:
            try:
                flex = flex_na(shape, K, d, device, compile_=True)
                variants["flex"] = lambda q, k, v, rpb: flex(q, k, v)
            except (ImportError, RuntimeError) as e:
                print(f"  flex unavailable: {_first_line(e)}", flush=True)
        # the torch reference without rpb, to check the others compute the same function
        with torch.no_grad():
            expected = na2d(*base, kernel_size=K, dilation=d, backend="torch").float()
        row = dict(part=2, case=label, shape=list(shape), kernel=K, dilation=d)
        elem = torch.finfo(dtype).bits // 8
        tensor_bytes = math.prod(shape) * elem
        for backward in ([False, True] if args.backward else [False]):
            kind = "fwd+bwd" if backward else "fwd"
            for name, fn in variants.items():
                repeats = args.repeats
                if name == "natten" and device.type == "cpu":
                    repeats = min(repeats, args.cpu_natten_repeats)
                inputs = [t.clone().requires_grad_(backward) for t in base]
                rpb = rpb0.clone().requires_grad_(backward)
                diff = None
                try:
                    if name in ("cuda", "natten", "flex") and not backward:
                        with torch.no_grad():
                            diff = (fn(*inputs, rpb).float() - expected).abs().max().item()
                    t = time_fn(lambda: fn(*inputs, rpb), device, backward, args.warmup,
                                repeats)
                except (backends.BackendUnsupportedError, RuntimeError, NotImplementedError,
                        ImportError) as e:
                    print(f"  {kind:7s} {name:9s} unavailable: {_first_line(e)}", flush=True)
                    continue
                row[f"{name}_{kind}_ms"] = t.ms
                row[f"{name}_{kind}_peak_mib"] = t.peak_mib
                extra = f"  max|diff| vs torch (no rpb) {diff:.1e}" if diff is not None else ""
                if peak_gbps and name.startswith("cuda"):
                    moved = tensor_bytes * (12 if backward else 4)
                    fraction = moved / (peak_gbps * 1e9) / (t.ms * 1e-3)
                    row[f"{name}_{kind}_bw_fraction"] = fraction
                    extra += f"  {100 * fraction:5.1f}% of the bandwidth bound"
                print(f"  {kind:7s} {name:9s} {t.ms:10.3f} ms  peak +{fmt(t.peak_mib, '.1f', 0)} "
                      f"MiB{extra}", flush=True)
            ours = row.get(f"cuda+rpb_{kind}_ms")
            for other in ("flex", "torch+rpb", "natten"):
                theirs = row.get(f"{other}_{kind}_ms")
                if ours and theirs:
                    row[f"{other}_over_cuda_{kind}"] = theirs / ours
                    target = TARGETS.get(other.split("+")[0])
                    met = "met" if target and theirs / ours >= target else "NOT met"
                    verdict = "" if target is None or device.type != "cuda" else (
                        f" (target >= {target:.0f}x: {met})")
                    print(f"  {kind:7s} {other}/cuda+rpb = {theirs / ours:.2f}x{verdict}",
                          flush=True)
        rows.append(row)
    return rows


def time_fn(fn, device, backward: bool, warmup: int, repeats: int) -> Timing:
    """Median time of ``fn()`` (plus ``backward`` of its output) and its peak memory."""
    memory = Memory(device)
    times, peaks = [], []
    for i in range(warmup + repeats):
        grad_ctx = contextlib.nullcontext() if backward else torch.no_grad()
        _sync(device)
        memory.start()
        start = clock()
        with grad_ctx:
            out = fn()
        if backward:
            out.backward(torch.ones_like(out))  # a constant grad: no RNG inside the timing
        _sync(device)
        elapsed = clock() - start
        peaks.append(memory.peak_mib())
        del out
        if i >= warmup:
            times.append(elapsed * 1e3)
    peaks = [p for p in peaks[warmup:] if p is not None]
    return Timing(statistics.median(times), max(peaks) if peaks else None)


# ---------------------------------------------------------------------------------------------
# summary, plot
# ---------------------------------------------------------------------------------------------

def plot(rows: List[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path}); `pip install matplotlib`")
        return
    na_rows = [r for r in rows if r["part"] == 2]
    if not na_rows:
        return
    kinds = [k for k in ("fwd", "fwd+bwd") if any(f"torch+rpb_{k}_ms" in r for r in na_rows)]
    names = ["cuda+rpb", "cuda", "flex", "natten", "torch+rpb"]
    fig, axes = plt.subplots(1, len(kinds), figsize=(7 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            values = [r.get(f"{name}_{kind}_ms", float("nan")) for r in na_rows]
            ax.bar([i + j * width for i in range(len(na_rows))], values, width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(na_rows))])
        ax.set_xticklabels([r["case"].split(" ", 2)[-1] if r["case"].startswith("nat")
                            else r["case"] for r in na_rows], rotation=30, ha="right",
                           fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log)")
        ax.set_title(f"NA {kind}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def summary(rows: List[dict], device: torch.device) -> None:
    """One line per NA case and pass; ratios over cuda+rpb, or over the torch reference where
    cuda cannot run (CPU)."""
    na_rows = [r for r in rows if r["part"] == 2]
    if not na_rows:
        return
    names = ["cuda+rpb", "cuda", "flex", "natten", "torch+rpb"]
    base = "cuda+rpb" if any(k.startswith("cuda+rpb_") for r in na_rows for k in r) \
        else "torch+rpb"
    others = [n for n in ("flex", "natten", "torch+rpb") if n != base]
    head = (f"{'NA case':34s} {'pass':7s} " + " ".join(f"{n + ' ms':>12s}" for n in names)
            + " " + " ".join(f"{o + '/' + base:>18s}" for o in others) + f" {'bw bound':>8s}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in na_rows:
        for kind in ("fwd", "fwd+bwd"):
            ours = r.get(f"{base}_{kind}_ms")
            if ours is None:
                continue
            ratios = [r[f"{o}_{kind}_ms"] / ours if f"{o}_{kind}_ms" in r else None
                      for o in others]
            bw = r.get(f"cuda+rpb_{kind}_bw_fraction")
            print(f"{r['case']:34s} {kind:7s} "
                  + " ".join(fmt(r.get(f"{n}_{kind}_ms"), ".3f", 12) for n in names) + " "
                  + " ".join(fmt(x, ".2f", 18) for x in ratios)
                  + (f" {100 * bw:7.1f}%" if bw is not None else f" {'n/a':>8s}"))
    if device.type == "cuda":
        print(f"targets (issue 10): flex/cuda+rpb >= {TARGETS['flex']:.0f}, torch+rpb/cuda+rpb "
              f">= {TARGETS['torch']:.0f}, forward and forward+backward")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--part", choices=("1", "2", "all"), default="all")
    p.add_argument("--ops", default="", help="comma-separated ops for part 1 (default: all)")
    p.add_argument("--batch", type=int, default=None,
                   help="part 2 batch (default: 64 on CUDA, 2 on CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (median); default "
                                                             "20 on CUDA, 3 on CPU")
    p.add_argument("--warmup", type=int, default=None, help="default 5 on CUDA, 1 on CPU")
    p.add_argument("--cpu-natten-repeats", type=int, default=1,
                   help="NATTEN's CPU path takes seconds per call")
    p.add_argument("--no-backward", dest="backward", action="store_false",
                   help="forward only")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiles)")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="memory bandwidth for the bound (default: from the device)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="process: CPU time of this process (a shared CPU machine; with "
                        "--threads 1 it equals the wall time of a quiet machine)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG plot of part 2 here")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    args.batch = args.batch or (64 if cuda else 2)
    args.repeats = args.repeats or (20 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "process":
        if cuda:
            p.error("--clock process measures CPU time: not meaningful for GPU kernels")
        global clock
        clock = time.process_time
    warnings.filterwarnings("ignore", module=r"torch\.nn\.attention\.flex_attention")
    try:
        import natten
        natten_version = natten.__version__
    except ImportError:
        natten_version = "not installed"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    name = torch.cuda.get_device_name(device) if cuda else (platform.processor()
                                                            or platform.machine())
    print(f"# attnzoo op benchmark: {device.type} ({name}), {dtype}, threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}, triton {triton_version}, "
          f"natten {natten_version}; median of {args.repeats} after {args.warmup} warm-up, "
          f"{args.clock} clock",
          flush=True)
    if not cuda:
        print("# CPU: the cuda backend needs a GPU (its CPU path is Triton's interpreter, for "
              "tests), so it is reported unavailable", flush=True)
    rows = []
    if args.part in ("1", "all"):
        rows += part_ops(args, device, dtype)
    if args.part in ("2", "all"):
        rows += part_na(args, device, dtype)
    summary(rows, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device.type, device_name=name, dtype=str(dtype),
                           torch=torch.__version__, triton=triton_version, natten=natten_version,
                           rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
