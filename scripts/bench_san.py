#!/usr/bin/env python
"""Benchmark SAN's self-attention module (attnzoo.layers.SAM) per backend. Not a test.

Times one SAM forward+backward (train mode) at SAN's stage-1 shape, (8, 256, 56, 56) with a
7x7 footprint (rel 16, mid 64, 8 weight channels), pairwise and patchwise, on every backend,
and reports the median time and the peak memory: the baseline attnzoo's fused kernels (the
``cuda`` backend) will be measured against. ``--ops`` also times the three SAN ops alone at the
same block's shapes.

    python scripts/bench_san.py                          # CPU, fp32, batch 8
    python scripts/bench_san.py --batch 2 --repeats 3    # a small CPU run
    python scripts/bench_san.py --device cuda --dtype fp16 --ops
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Callable, Dict, List, Optional

import torch

import attnzoo
from attnzoo.backends import BackendUnsupportedError
from attnzoo.layers import SAM
from attnzoo.ops import san_aggregation, san_subtraction, san_subtraction2
from bench_na import DTYPES, fmt, time_fn  # scripts/: the same timing and peak-memory rules

BACKENDS = ("torch", "natten", "cuda")


def sam_step(sa_type: str, args, device, dtype, backend: str) -> Callable[[], None]:
    """One forward+backward of a SAM in train mode (BN on batch statistics)."""
    c = args.channels
    torch.manual_seed(0)
    sam = SAM(c, c // 16, c // 4, 8, kernel_size=args.kernel, sa_type=sa_type, backend=backend,
              device=device, dtype=dtype).train()
    x = torch.randn(args.batch, c, args.size, args.size, device=device, dtype=dtype,
                    requires_grad=True)
    grad = torch.randn(args.batch, c // 4, args.size, args.size, device=device, dtype=dtype)

    def step():
        x.grad = None
        sam.zero_grad(set_to_none=True)
        sam(x).backward(grad)
    return step


def op_steps(args, device, dtype, backend: str) -> Dict[str, Callable[[], None]]:
    """Forward+backward of each SAN op at the benchmarked block's shapes."""
    B, c, n, k = args.batch, args.channels, args.size, args.kernel
    rel, mid = c // 16, c // 4

    def new(*shape):
        return torch.randn(shape, device=device, dtype=dtype, requires_grad=True)

    def step(fn, *inputs):
        def run():
            for t in inputs:
                t.grad = None
            out = fn(*inputs)
            out.backward(torch.ones_like(out))
        return run

    kw = dict(kernel_size=k, backend=backend)
    return {
        f"aggregation {B}x{mid}x{n}x{n} Cw {mid // 8}": step(
            lambda x, w: san_aggregation(x, w, **kw), new(B, mid, n, n), new(B, mid // 8, k * k, n * n)),
        f"subtraction2 {B}x{rel}x{n}x{n}": step(
            lambda a, b: san_subtraction2(a, b, **kw), new(B, rel, n, n), new(B, rel, n, n)),
        f"subtraction 1x2x{n}x{n}": step(lambda p: san_subtraction(p, **kw), new(1, 2, n, n)),
    }


def measure(label: str, make: Callable[[], Callable[[], None]], device, args) -> Optional[dict]:
    try:
        fn = make()
        fn()  # the first call also tells whether the backend can run it
    except BackendUnsupportedError as e:
        print(f"  {label:42s} unavailable: {str(e).splitlines()[0][:160]}", flush=True)
        return None
    t = time_fn(fn, device, args.warmup, args.repeats)
    print(f"  {label:42s} {t.median_ms:10.1f} ms (min {t.min_ms:.1f})  "
          f"peak +{fmt(t.peak_mib, '.0f')} MiB", flush=True)
    return {"median_ms": t.median_ms, "min_ms": t.min_ms, "peak_mib": t.peak_mib}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--channels", type=int, default=256, help="block width C (rel C/16, mid C/4)")
    p.add_argument("--size", type=int, default=56, help="map height and width")
    p.add_argument("--kernel", type=int, default=7)
    p.add_argument("--types", default="pairwise,patchwise")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--repeats", type=int, default=5, help="timed runs (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--ops", action="store_true", help="also time each SAN op alone")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    names = [b.strip() for b in args.backends.split(",")]
    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine())
    print(f"# attnzoo SAM benchmark: device={device.type} ({dev_name}), dtype={args.dtype}, "
          f"threads={torch.get_num_threads()}, torch {torch.__version__}, attnzoo "
          f"{attnzoo.__version__}; one forward+backward in train mode, median of "
          f"{args.repeats} after {args.warmup} warm-up; peak memory above the inputs "
          f"(CPU: peak RSS growth, an indicator)", flush=True)
    shape = f"({args.batch}, {args.channels}, {args.size}, {args.size}) k={args.kernel}"
    results = []
    for sa_type in args.types.split(","):
        print(f"\n[SAM {sa_type} {shape}]", flush=True)
        for b in names:
            row = measure(f"{b}", lambda: sam_step(sa_type, args, device, dtype, b), device,
                          args)
            results.append({"what": f"SAM {sa_type}", "backend": b, **(row or {})})
    if args.ops:
        print(f"\n[SAN ops at the same block, forward+backward]", flush=True)
        for b in names:
            for label, fn in op_steps(args, device, dtype, b).items():
                row = measure(f"{b:6s} {label}", lambda fn=fn: fn, device, args)
                results.append({"what": label, "backend": b, **(row or {})})

    print(f"\nBaseline {shape}, {args.dtype} on {device.type}:")
    print(f"{'':24s} {'backend':8s} {'ms':>10s} {'peak MiB':>10s}")
    for r in results:
        print(f"{r['what'][:24]:24s} {r['backend']:8s} {fmt(r.get('median_ms'), '10.1f')} "
              f"{fmt(r.get('peak_mib'), '10.0f')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.type, "dtype": args.dtype, "shape": shape,
                       "threads": torch.get_num_threads(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
