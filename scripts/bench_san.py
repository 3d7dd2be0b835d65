#!/usr/bin/env python
"""Benchmark SAN's self-attention module (attnzoo.layers.SAM) per backend. Not a test.

Times one SAM forward+backward (train mode, BN on batch statistics) at SAN's stage-1 shape,
(8, 256, 56, 56) with a 7x7 footprint (rel 16, mid 64, 8 weight channels), pairwise and
patchwise, on every backend, and prints the median time and the peak memory: the baseline
attnzoo's fused SAN kernels (the ``cuda`` backend) will be measured against. The three SAN ops
alone, at every stage's shapes, are in ``python scripts/bench_ops.py --part 1 --ops
san_aggregation,san_subtraction,san_subtraction2``.

    python scripts/bench_san.py                                     # CPU, fp32, batch 8
    python scripts/bench_san.py --threads 1 --clock process         # a shared CPU machine
    python scripts/bench_san.py --device cuda --dtype bf16 --repeats 20
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

import torch

from attnzoo.backends import CONCRETE_BACKENDS, BackendUnsupportedError
from attnzoo.layers import SAM
from attnzoo.profiling import CLOCKS, DTYPES, device_name, first_line, fmt, table, time_call


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--channels", type=int, default=256, help="block width C (rel C/16, mid C/4)")
    p.add_argument("--size", type=int, default=56, help="map height and width")
    p.add_argument("--kernel", type=int, default=7)
    p.add_argument("--types", default="pairwise,patchwise")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="process: this process's CPU time (a shared CPU machine; with "
                        "--threads 1 it equals the wall time of a quiet machine)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.clock == "process" and device.type == "cuda":
        p.error("--clock process measures CPU time: not meaningful for GPU kernels")
    dtype = DTYPES[args.dtype]
    c, n, k = args.channels, args.size, args.kernel
    name = device_name(device)
    shape = f"({args.batch}, {c}, {n}, {n}) k={k}"
    print(f"# attnzoo SAM benchmark {shape}: {device.type} ({name}), {args.dtype}, threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}; one forward+backward in train "
          f"mode, median of {args.repeats} after {args.warmup} warm-up, {args.clock} clock; "
          f"peak memory above the inputs (CPU: growth of the peak RSS, an indicator)",
          flush=True)
    rows = []
    for sa_type in args.types.split(","):
        for backend in CONCRETE_BACKENDS:
            torch.manual_seed(0)
            sam = SAM(c, c // 16, c // 4, 8, kernel_size=k, sa_type=sa_type, backend=backend,
                      device=device, dtype=dtype).train()
            x = torch.randn(args.batch, c, n, n, device=device, dtype=dtype, requires_grad=True)
            label = f"SAM {sa_type:9s} {backend:6s}"
            try:
                t = time_call(lambda: sam(x), device, True, args.warmup, args.repeats,
                              clock=CLOCKS[args.clock])
            except BackendUnsupportedError as e:
                print(f"  {label} unavailable: {first_line(e)}", flush=True)
                rows.append(dict(sa_type=sa_type, backend=backend, ms=None, peak_mib=None))
                continue
            print(f"  {label} {t.ms:10.1f} ms  peak +{fmt(t.peak_mib, '.0f', 0)} MiB",
                  flush=True)
            rows.append(dict(sa_type=sa_type, backend=backend, ms=t.ms, peak_mib=t.peak_mib))

    print(f"\nBaseline, SAM forward+backward {shape}, {args.dtype} on {device.type}:")
    print(table(["sa_type", "backend", "ms", "peak MiB"],
                [[r["sa_type"], r["backend"], fmt(r["ms"], ".1f"), fmt(r["peak_mib"], ".0f")]
                 for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device.type, device_name=name, dtype=args.dtype, shape=shape,
                           threads=torch.get_num_threads(), clock=args.clock, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
