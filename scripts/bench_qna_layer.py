#!/usr/bin/env python
"""The QnA paper's Figure 3 setting: one layer's forward on a 256 x 256 x 64 input, window
k = 3..11. Not a test.

Layers, all 64 -> 64 channels, batch 1, fp32, under torch.no_grad:

* ``qna``  - attnzoo.layers.QnA: 8 heads (head_dim 8), 2 learned queries, relative bias and
  window weights, stride 1 (the paper's QnA-ViT setting), on the torch reference backend;
* ``sasa`` - stand-alone self-attention (Ramachandran et al. 2019) as its public
  implementations do it: ``F.unfold`` the k x k neighbourhood of every pixel's keys and values
  (k*k times their memory), one query per pixel, 8 heads, a relative bias per offset and head,
  out-of-bounds keys masked;
* ``conv`` - a k x k convolution (nn.Conv2d, no bias).

Each (layer, k) runs in a fresh subprocess: peak memory is the growth of the process's peak
RSS during the first forward (Linux ``/proc/self/status`` VmHWM, reset through
``/proc/self/clear_refs``; CUDA: max allocated), then the median of ``--repeats`` timed forwards.
Targets at k = 7: QnA uses >= 5x less peak memory and is >= 3x faster than SASA.

    python scripts/bench_qna_layer.py                 # CPU, k = 3 5 7 9 11
    python scripts/bench_qna_layer.py --kernels 3 7 --repeats 5 --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import attnzoo
from attnzoo.layers import QnA
from attnzoo.profiling import PeakMemory, fmt, table, time_steps

TARGET_MEMORY, TARGET_SPEED = 5.0, 3.0
LAYERS = ("qna", "sasa", "conv")


class SASA(nn.Module):
    """Unfold-based stand-alone local self-attention on NHWC maps."""

    def __init__(self, dim: int, heads: int, k: int):
        super().__init__()
        self.heads, self.k = heads, k
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.rel = nn.Parameter(torch.randn(heads, k * k) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        h, d, k = self.heads, C // self.heads, self.k
        q, key, v = self.qkv(x).permute(0, 3, 1, 2).chunk(3, dim=1)           # NCHW each
        keys = F.unfold(key, k, padding=k // 2).view(B, h, d, k * k, H * W)   # k*k x memory
        values = F.unfold(v, k, padding=k // 2).view(B, h, d, k * k, H * W)
        outside = F.unfold(x.new_ones(1, 1, H, W), k, padding=k // 2).view(1, 1, k * k, H * W) == 0
        # products and sums as the public implementations write them (on this CPU ~2x faster
        # than einsum, which copies the unfolded tensors into a batched-matmul layout)
        logits = (q.reshape(B, h, d, 1, H * W) * keys).sum(2) * d ** -0.5       # [B, h, k*k, N]
        logits = (logits + self.rel.view(1, h, k * k, 1)).masked_fill(outside, float('-inf'))
        out = (logits.softmax(2).unsqueeze(2) * values).sum(3)                  # [B, h, d, N]
        return self.proj(out.reshape(B, C, H, W).permute(0, 2, 3, 1))


def measure(layer: str, k: int, size: int, dim: int, device: str, repeats: int) -> dict:
    """One (layer, k) in this (fresh) process: peak memory of the first forward, then times."""
    torch.manual_seed(0)
    dev = torch.device(device)
    if layer == "qna":
        module = QnA(dim, dim, num_heads=8, kernel_size=k, backend="torch")
    elif layer == "sasa":
        module = SASA(dim, 8, k)
    else:
        module = nn.Conv2d(dim, dim, k, padding=k // 2, bias=False)
    module = module.to(dev).eval()
    x = torch.randn(1, size, size, dim, device=dev)
    if layer == "conv":
        x = x.permute(0, 3, 1, 2).contiguous()

    def run():
        with torch.no_grad(), attnzoo.use_backend("torch"):
            return module(x)

    memory = PeakMemory(dev)
    memory.start()
    run()
    peak = memory.peak_mib()
    times = time_steps(run, dev, warmup=1, repeats=repeats)
    return {"layer": layer, "k": k, "ms": statistics.median(times) * 1e3, "peak_mib": peak}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", type=int, nargs="+", default=[3, 5, 7, 9, 11])
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeats", type=int, default=3, help="timed forwards per case (median)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS))
    p.add_argument("--one", nargs=2, metavar=("LAYER", "K"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:  # the subprocess of one case
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.size, args.dim, args.device,
                                 args.repeats)))
        return 0

    print(f"# QnA Figure 3 setting: 1 x {args.size} x {args.size} x {args.dim}, forward, fp32, "
          f"{args.device}, threads={args.threads or torch.get_num_threads()}, torch "
          f"{torch.__version__}; median of {args.repeats} after 1 warm-up; peak = growth of peak "
          f"RSS (CUDA: allocated) during the first forward; one subprocess per case", flush=True)
    rows = {}
    for k in args.kernels:
        for layer in args.layers:
            cmd = [sys.executable, __file__, "--one", layer, str(k), "--size", str(args.size),
                   "--dim", str(args.dim), "--device", args.device, "--repeats",
                   str(args.repeats)] + (["--threads", str(args.threads)] if args.threads else [])
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"  k={k:2d} {layer:4s} failed: {done.stderr.strip().splitlines()[-1:]}",
                      flush=True)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows[layer, k] = row
            peak = fmt(row["peak_mib"], ".1f", 8)
            print(f"  k={k:2d} {layer:4s} {row['ms']:10.1f} ms   peak +{peak} MiB", flush=True)

    def cell(layer, k, key):
        row = rows.get((layer, k))
        return fmt(row[key] if row else None, ".1f")

    def ratio(a, b, k, key):
        if (a, k) in rows and (b, k) in rows and rows[b, k][key] and rows[a, k][key] is not None:
            return rows[a, k][key] / rows[b, k][key]
        return None

    print()
    print(table(
        ["k", "qna ms", "sasa ms", "conv ms", "qna MiB", "sasa MiB", "conv MiB",
         "sasa/qna time", "sasa/qna mem", "conv/qna time"],
        [[str(k)] + [cell(layer, k, key) for key in ("ms", "peak_mib") for layer in LAYERS]
         + [fmt(ratio(*pair, k, key), suffix="x") for pair, key in (
             (("sasa", "qna"), "ms"), (("sasa", "qna"), "peak_mib"), (("conv", "qna"), "ms"))]
         for k in args.kernels]))
    if 7 in args.kernels:
        speed, memory = ratio("sasa", "qna", 7, "ms"), ratio("sasa", "qna", 7, "peak_mib")
        if speed is not None and memory is not None:
            met = speed >= TARGET_SPEED and memory >= TARGET_MEMORY
            print(f"\nTarget at k=7: QnA >= {TARGET_MEMORY:.0f}x less peak memory and >= "
                  f"{TARGET_SPEED:.0f}x faster than SASA. Measured {memory:.1f}x less memory, "
                  f"{speed:.1f}x faster: {'MET' if met else 'NOT met'}.")
    ks = [k for k in args.kernels if ("qna", k) in rows and ("sasa", k) in rows]
    if len(ks) >= 2:
        lo, hi = ks[0], ks[-1]
        def grow(layer, key):
            return rows[layer, hi][key] / max(rows[layer, lo][key], 1e-9)
        print(f"Growth k={lo} -> k={hi}: QnA time x{grow('qna', 'ms'):.1f}, SASA time "
              f"x{grow('sasa', 'ms'):.1f}; QnA memory x{grow('qna', 'peak_mib'):.1f}, SASA memory "
              f"x{grow('sasa', 'peak_mib'):.1f} (k*k grows x{hi * hi / (lo * lo):.1f}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
