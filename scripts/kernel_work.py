#!/usr/bin/env python
"""Logits the NA kernels compute against those they need, per stage shape and per model, for
today's tilings and for a74a38a's (8 x 8 query tiles streaming 2-D blocks of 16 / 32 columns).
Not a test; no GPU, no Triton compile: the count mirrors the kernels' loops
(``attnzoo.kernels.tiling.logit_work``, checked against the interpreted kernels by
tests/test_kernels_neighborhood.py).

Each query needs K * K logits; a program computes ``tile x block`` logits for every block of
its region, inside a window or not. Per stage shape: the useful fraction of the forward (and
dQ, the same loops) and of the key-centric dK/dV pass. Per model: the logit work of the
forward and both backward passes over every NA layer (heads included), today / a74a38a.

    python scripts/kernel_work.py                              # every NAT/DiNAT model, bf16
    python scripts/kernel_work.py --models nat_tiny,dinat_tiny --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Dict, List, Tuple

import timm
import torch

import attnzoo
from attnzoo.kernels import neighborhood as kn
from attnzoo.kernels.tiling import Tiling, logit_work, region_extents
from attnzoo.layers import neighborhood as na_layer
from attnzoo.profiling import write_table

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

Layer = Tuple[Tuple[int, int], int, int, int, int]  # (H, W), K, dilation, heads, head dim


def model_layers(name: str) -> List[Layer]:
    """The NA calls of model ``name`` at its default input size (a forward on meta tensors)."""
    layers = []

    def record(q, k, v, kernel_size, dilation, rpb, scale, backend):
        layers.append((tuple(q.shape[1:3]), kernel_size, dilation, q.shape[3], q.shape[4]))
        return torch.empty_like(v)

    real = na_layer.na2d_dispatch, na_layer.na2d_qkv_dispatch
    na_layer.na2d_dispatch = record
    na_layer.na2d_qkv_dispatch = lambda qkv, *args: record(*qkv.unbind(3), *args)
    try:
        with torch.device("meta"):
            model = timm.create_model(name)
            model(torch.empty((1,) + tuple(model.pretrained_cfg["input_size"])))
    finally:
        na_layer.na2d_dispatch, na_layer.na2d_qkv_dispatch = real
    return layers


def a74a38a_work(spatial, K: int, d: int, key_pass: bool) -> int:
    """Logits per (batch, head) with a74a38a's tiling: 8 x 8 tiles, regions streamed in blocks
    of ROWS region rows x COLS columns (COLS 16 or 32, ROWS a power of two, ~32 keys)."""
    rows_max, cols = min(8 + K - 1, spatial[0]), 8 + K - 1
    COLS = min((16, 32), key=lambda c: (math.ceil(cols / c) * (c + 16), c))
    ROWS = 1
    while ROWS * 2 * COLS <= 32 and ROWS * 2 <= rows_max:
        ROWS *= 2
    ys = region_extents(spatial[0], K, d, 8, key_pass)
    xs = region_extents(spatial[1], K, d, 8, key_pass)
    return sum(ny * nx * 64 * math.ceil(ey / ROWS) * ROWS * math.ceil(ex / COLS) * COLS
               for ey, ny in ys.items() for ex, nx in xs.items())


def today(spatial, K: int, d: int, head_dim: int, dtype, kernel: str) -> Tuple[int, Tiling]:
    """Logits per (batch, head) and the tiling of ``kernel``'s default configuration."""
    t = kn.configs(kernel, spatial, (K, K), (d, d), (head_dim, head_dim), dtype)[0].tiling
    return logit_work(spatial, (K, K), (d, d), t, kernel == "dkdv").computed, t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None,
                   help="comma-separated attnzoo models (default: every NAT/DiNAT model)")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES),
                   help="the tiling's dtype (fp32 caps tile x block pieces at half the size)")
    p.add_argument("--write", default=None, metavar="BENCHMARKS.md",
                   help="replace the tables between the file's markers")
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    names = (args.models.split(",") if args.models else
             [m for m in attnzoo.list_models() if m.startswith(("nat_", "dinat_"))])
    unknown = sorted(set(names) - set(attnzoo.list_models()))
    if unknown:
        p.error(f"--models: unknown {unknown}; accepted: {', '.join(attnzoo.list_models())}")

    stages: Dict[tuple, set] = {}
    totals = []
    for name in names:
        before = after = 0
        for spatial, K, d, heads, head_dim in model_layers(name):
            stages.setdefault((spatial, K, d, head_dim), set()).add(name)
            for kernel in kn.KERNELS:
                key_pass = kernel == "dkdv"
                before += heads * a74a38a_work(spatial, K, d, key_pass)
                after += heads * today(spatial, K, d, head_dim, dtype, kernel)[0]
        totals.append(f"| {name} | {after / before:.2f}x |")
        print(f"{name}: logit work {after / before:.2f}x a74a38a's", flush=True)

    rows = []
    for (spatial, K, d, head_dim), users in sorted(stages.items(), key=lambda s: (-s[0][0][0],
                                                                                    s[0][1:])):
        needed = spatial[0] * spatial[1] * K * K
        cells = []
        for kernel in ("fwd", "dkdv"):
            old = a74a38a_work(spatial, K, d, kernel == "dkdv")
            new, t = today(spatial, K, d, head_dim, dtype, kernel)
            cells.append(f"{100 * needed / old:.1f}% | {100 * needed / new:.1f}% "
                         f"({t.TH}x{t.TW}, {t.BN})")
        rows.append(f"| {spatial[0]}x{spatial[1]} K{K} d{d} | " + " | ".join(cells)
                    + f" | {', '.join(sorted(users))} |")
    table = ("| stage shape | fwd, dQ: a74a38a | today (tile, block) | dK/dV: a74a38a | "
             "today (tile, block) | models |\n|---|---|---|---|---|---|\n" + "\n".join(rows))
    summary = ("| model | fwd + dQ + dK/dV logit work, today / a74a38a |\n|---|---|\n"
               + "\n".join(totals))
    print(table + "\n\n" + summary)
    if args.write:
        try:
            write_table(args.write, "kernel_work.py",
                        f"Useful logits ({args.dtype} tilings):\n\n{table}\n\n{summary}")
        except ValueError as e:
            p.error(str(e))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
