#!/usr/bin/env python
"""QnA-ViT-Tiny vs Swin-Tiny inference throughput, measured in one run. Not a test.

Both models from timm (random weights), batch 8 at 224 x 224, fp32, eval mode under
torch.no_grad, on the CPU by default. The models are timed in alternating rounds (so a change
of machine load hits both), each round the median of ``--steps`` batches after a warm-up; the
result is the median over rounds. The paper measures 1060 vs 723 img/s on a V100 (1.47x);
target here: qna_vit_tiny >= 1.5x the img/s of swin_tiny_patch4_window7_224.

    python scripts/bench_qna_vit.py
    python scripts/bench_qna_vit.py --threads 2 --rounds 5 --steps 5
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import List, Optional

import timm
import torch

import attnzoo  # noqa: F401  (registers qna_vit_*)
from attnzoo.profiling import count_macs, count_params, time_steps

TARGET = 1.5


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs=2, default=["qna_vit_tiny", "swin_tiny_patch4_window7_224"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed batches per model and round")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device)
    models = {}
    for name in args.models:
        torch.manual_seed(0)
        model = timm.create_model(name).to(device).eval()
        gmacs = count_macs(model, (1, 3, args.img_size, args.img_size)) / 1e9
        print(f"{name}: {count_params(model) / 1e6:.2f} M params, {gmacs:.2f} GMACs", flush=True)
        models[name] = model
    print(f"# batch {args.batch_size} at {args.img_size} px, fp32, {device.type}, threads="
          f"{torch.get_num_threads()}, torch {torch.__version__}, timm {timm.__version__}; "
          f"{args.rounds} alternating rounds of {args.steps} timed batches", flush=True)

    def infer(model):
        def run():
            with torch.no_grad():
                model(x)
        return run

    rates = {name: [] for name in models}
    for r in range(args.rounds):
        for name, model in models.items():
            seconds = statistics.median(time_steps(infer(model), device, warmup=1,
                                                   repeats=args.steps))
            rates[name].append(args.batch_size / seconds)
            print(f"  round {r + 1}/{args.rounds} {name:32s} {rates[name][-1]:8.1f} img/s",
                  flush=True)
    (a, ra), (b, rb) = ((n, statistics.median(v)) for n, v in rates.items())
    print(f"\n{'model':32s} {'img/s':>8s}\n{a:32s} {ra:8.1f}\n{b:32s} {rb:8.1f}")
    print(f"\n{a} / {b}: {ra / rb:.2f}x (target >= {TARGET}x: "
          f"{'MET' if ra / rb >= TARGET else 'NOT met'}; paper, V100: 1060 / 723 = 1.47x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
