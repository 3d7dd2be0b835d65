#!/usr/bin/env python
"""Benchmark the neighborhood-attention op (attnzoo.ops.na2d) per backend. Not a test.

Times the torch reference against NATTEN (and, on CUDA, attnzoo's own 'cuda' kernels where
implemented) at NAT/DiNAT layer sizes, forward only by default (under torch.no_grad), reporting
the median of --repeats runs after warm-up, peak memory, and the ratio natten/torch.

Target on CPU: the torch reference is >= 10x faster than NATTEN's CPU path (natten/torch >= 10).

    python scripts/bench_na.py                       # CPU, fp32 forward
    python scripts/bench_na.py --threads 1 --repeats 20
    python scripts/bench_na.py --backward            # + torch reference fwd+bwd
    python scripts/bench_na.py --device cuda --dtype fp16 --backward
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import warnings
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch

from attnzoo.backends import BackendUnsupportedError
from attnzoo.ops import na2d
from attnzoo.profiling import time_steps

TARGET_RATIO = 10.0


class Case(NamedTuple):
    name: str
    shape: Tuple[int, int, int, int, int]  # B, H, W, heads, head_dim
    kernel: int
    dilation: int


CASES = [
    Case("NAT L1 56x56", (1, 56, 56, 2, 32), 7, 1),
    Case("NAT L3 14x14 b8", (8, 14, 14, 8, 32), 7, 1),
    Case("DiNAT L1 d8", (1, 56, 56, 2, 32), 7, 8),
    Case("DiNAT L2 d4 b8", (8, 28, 28, 4, 32), 7, 4),
    Case("200x200 map", (1, 200, 200, 2, 32), 7, 1),
]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _proc_status_mib(field: str) -> Optional[float]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_cpu_peak() -> Optional[float]:
    """Reset the process's peak RSS (Linux: write 5 to /proc/self/clear_refs) and return the
    current RSS in MiB; None where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _proc_status_mib("VmRSS")


class Timing(NamedTuple):
    median_ms: float
    min_ms: float
    peak_mib: Optional[float]   # CUDA: max allocated above the inputs; CPU: peak RSS growth


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> Timing:
    """Median wall time of ``fn`` (synchronised) over ``repeats`` runs after ``warmup`` runs."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = _reset_cpu_peak()
    times = [t * 1e3 for t in time_steps(fn, device, warmup, repeats)]
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    else:
        # Peak RSS above the RSS at the start of this case (an indicator: memory the allocator
        # already holds from earlier cases is reused without growing RSS).
        hwm = _proc_status_mib("VmHWM")
        peak = hwm - base if (base is not None and hwm is not None) else None
    return Timing(statistics.median(times), min(times), peak)


def make_inputs(case: Case, device, dtype, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(case.shape, generator=g).to(device=device, dtype=dtype)
               for _ in range(3))
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v


def forward_fn(q, k, v, case: Case, backend: str):
    def run():
        with torch.no_grad():
            return na2d(q, k, v, kernel_size=case.kernel, dilation=case.dilation, backend=backend)
    return run


def fwd_bwd_fn(q, k, v, case: Case, backend: str):
    grad = torch.randn_like(q)

    def run():
        for t in (q, k, v):
            t.grad = None
        out = na2d(q, k, v, kernel_size=case.kernel, dilation=case.dilation, backend=backend)
        out.backward(grad)
    return run


def fmt(x: Optional[float], spec: str = "8.2f") -> str:
    width = spec.split(".")[0]
    return format(x, spec) if x is not None else "n/a".rjust(int(width) if width else 0)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (CPU); default: torch's default")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per case (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--natten-repeats", type=int, default=3,
                   help="timed runs for natten on CPU (its unfused CPU path takes seconds)")
    p.add_argument("--natten-max-tokens", type=int, default=56 * 56,
                   help="skip natten on CPU above this many tokens per image: its CPU path "
                        "materialises the full N x N scores (200x200: ~12 GiB per head pair)")
    p.add_argument("--backward", action="store_true",
                   help="also time forward+backward (torch reference; natten only on CUDA)")
    p.add_argument("--no-natten", action="store_true", help="skip the natten backend")
    p.add_argument("--cases", default=None,
                   help="comma-separated substrings selecting cases by name")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    cases = CASES
    if args.cases:
        wanted = [s.strip().lower() for s in args.cases.split(",")]
        cases = [c for c in CASES if any(w in c.name.lower() for w in wanted)]
    warnings.filterwarnings("ignore", module=r"torch\.nn\.attention\.flex_attention")

    try:
        import natten
        natten_version = natten.__version__
    except ImportError:
        natten_version = None
    backends = ["torch"]
    if not args.no_natten and natten_version is not None:
        backends.append("natten")
    if device.type == "cuda":
        backends.append("cuda")

    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"{platform.processor() or platform.machine()}")
    print(f"# attnzoo na2d benchmark: device={device.type} ({dev_name}), dtype={args.dtype}, "
          f"threads={torch.get_num_threads()}, torch {torch.__version__}, "
          f"natten {natten_version or 'not installed'}; median of {args.repeats} "
          f"(natten on CPU: {args.natten_repeats}) after {args.warmup} warm-up; forward under "
          f"torch.no_grad{' + fwd/bwd' if args.backward else ''}", flush=True)

    results = []
    for case in cases:
        B, H, W, heads, hd = case.shape
        N = H * W
        dense_gib = B * heads * N * N * torch.finfo(dtype).bits / 8 / 2 ** 30
        print(f"\n[{case.name}] B={B} {H}x{W} heads={heads} head_dim={hd} K={case.kernel} "
              f"d={case.dilation} (a dense N x N score matrix would be {dense_gib:.2f} GiB)",
              flush=True)
        row = {"case": case.name, "shape": list(case.shape), "kernel": case.kernel,
               "dilation": case.dilation}
        q, k, v = make_inputs(case, device, dtype)
        ref = None
        for backend in backends:
            key = f"{backend}_fwd"
            if backend == "natten" and device.type == "cpu" and N > args.natten_max_tokens:
                print(f"  {backend:7s} fwd      skipped (> --natten-max-tokens {args.natten_max_tokens})",
                      flush=True)
                row[key] = None
                continue
            repeats = args.natten_repeats if (backend == "natten" and device.type == "cpu") \
                else args.repeats
            warmup = min(args.warmup, 1) if (backend == "natten" and device.type == "cpu") \
                else args.warmup
            fn = forward_fn(q, k, v, case, backend)
            try:
                out = fn()
            except (BackendUnsupportedError, NotImplementedError, RuntimeError) as e:
                print(f"  {backend:7s} fwd      unavailable: {str(e).splitlines()[0][:150]}",
                      flush=True)
                row[key] = None
                continue
            err = ""
            if ref is None:
                ref = out
            else:
                err = f"  max|diff| vs torch {(out.float() - ref.float()).abs().max().item():.1e}"
            t = time_fn(fn, device, warmup, repeats)
            row[key] = t.median_ms
            row[f"{backend}_fwd_peak_mib"] = t.peak_mib
            print(f"  {backend:7s} fwd  {t.median_ms:10.2f} ms (min {t.min_ms:.2f})  "
                  f"peak +{fmt(t.peak_mib, '.0f')} MiB{err}", flush=True)
            del out
        del ref
        if args.backward:
            for backend in backends:
                key = f"{backend}_fwdbwd"
                if backend != "torch" and device.type == "cpu":
                    row[key] = None  # natten's CPU path has no backward
                    continue
                qg, kg, vg = make_inputs(case, device, dtype, requires_grad=True)
                fn = fwd_bwd_fn(qg, kg, vg, case, backend)
                try:
                    fn()
                except (BackendUnsupportedError, NotImplementedError, RuntimeError) as e:
                    print(f"  {backend:7s} fwd+bwd  unavailable: {str(e).splitlines()[0][:150]}",
                          flush=True)
                    row[key] = None
                    continue
                t = time_fn(fn, device, args.warmup, args.repeats)
                row[key] = t.median_ms
                row[f"{backend}_fwdbwd_peak_mib"] = t.peak_mib
                print(f"  {backend:7s} fwd+bwd {t.median_ms:8.2f} ms (min {t.min_ms:.2f})  "
                      f"peak +{fmt(t.peak_mib, '.0f')} MiB", flush=True)
        results.append(row)

    # summary table
    cols = [f"{b} fwd ms" for b in backends]
    if args.backward:
        cols += ["torch f+b ms"] + (["natten f+b ms"] if device.type == "cuda" and
                                    "natten" in backends else [])
    header = f"{'case':18s} {'shape (B,H,W,h,d)':22s} {'K':>2s} {'d':>2s} " + " ".join(
        f"{c:>14s}" for c in cols) + f" {'natten/torch':>13s} {'torch peak MiB':>15s}"
    print("\n" + header)
    print("-" * len(header))
    ratios = []
    for row in results:
        vals = [row.get(f"{b}_fwd") for b in backends]
        if args.backward:
            vals.append(row.get("torch_fwdbwd"))
            if device.type == "cuda" and "natten" in backends:
                vals.append(row.get("natten_fwdbwd"))
        tr, nt = row.get("torch_fwd"), row.get("natten_fwd")
        ratio = nt / tr if tr and nt else None
        row["natten_over_torch"] = ratio
        if ratio is not None:
            ratios.append(ratio)
        print(f"{row['case']:18s} {str(tuple(row['shape'])):22s} {row['kernel']:2d} "
              f"{row['dilation']:2d} " + " ".join(fmt(x, "14.2f") for x in vals)
              + f" {fmt(ratio, '12.1f')}{'x' if ratio is not None else ' '}"
              + f" {fmt(row.get('torch_fwd_peak_mib'), '15.0f')}")
    if device.type == "cpu" and ratios:
        worst = min(ratios)
        verdict = "MET" if worst >= TARGET_RATIO else "NOT met"
        print(f"\nTarget on CPU: torch reference >= {TARGET_RATIO:.0f}x faster than natten "
              f"(natten/torch >= {TARGET_RATIO:.0f}). Worst ratio {worst:.1f}x, geometric mean "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.1f}x: {verdict}.")
    elif device.type == "cpu":
        print(f"\nTarget on CPU: natten/torch >= {TARGET_RATIO:.0f}x (natten not measured).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.type, "dtype": args.dtype,
                       "threads": torch.get_num_threads(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
