"""Model throughput against a reference timm model, measured in one run.

    python scripts/bench_models.py                      # nat_tiny vs swin_tiny, CPU, 2 threads
    python scripts/bench_models.py --models nat_tiny,qna_vit_tiny --device cuda --dtype bfloat16 \\
        --batch-size 64 --train-batch-size 32

Inference (no_grad) and training steps (forward, backward, SGD step) are timed round-robin over
the models, so a machine that slows down mid-run slows every model alike; each figure is the
median over the rounds, and the ratio to the reference model is printed per mode.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import timm
import torch

import attnzoo  # noqa: F401  (registers the models)
from attnzoo.profiling import device_name, fmt, model_step, table, time_steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="nat_tiny")
    parser.add_argument("--reference", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--train-batch-size", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-train", dest="train", action="store_false")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    autocast = torch.autocast(args.device, dtype=dtype, enabled=dtype != torch.float32)
    names = [args.reference] + [m for m in args.models.split(",") if m]
    modes = ["inference"] + (["train"] if args.train else [])
    where = device_name(device) + (f", {args.threads} threads" if args.device == "cpu" else "")
    print(f"{where}, torch {torch.__version__}, {args.dtype}", flush=True)
    steps = {}
    for name in names:
        for mode in modes:
            # a model per mode: the training step runs in train mode (drop path, batch norm)
            model = timm.create_model(name).to(device).train(mode == "train")
            batch = args.batch_size if mode == "inference" else args.train_batch_size
            x = torch.randn(batch, 3, args.img_size, args.img_size, device=device)
            if mode == "inference":
                steps[name, mode] = (batch, model_step(model, x))
            else:
                optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
                steps[name, mode] = (batch, model_step(model, x, backward=True,
                                                       optimizer=optimizer))
    times = {key: [] for key in steps}
    for r in range(args.rounds):
        for (name, mode), (batch, step) in steps.items():
            print(f"round {r + 1}/{args.rounds}: {name} {mode}", file=sys.stderr, flush=True)
            with autocast:
                times[name, mode] += time_steps(step, device, warmup=1 if r == 0 else 0,
                                                repeats=1)
    rows = []
    for mode in modes:
        ref = None
        for name in names:
            batch = steps[name, mode][0]
            ips = batch / statistics.median(times[name, mode])
            ref = ref or ips
            rows.append([name, mode, str(batch), fmt(ips), fmt(ips / ref, suffix="x")])
    print(table(["model", "mode", "batch", "img/s", "vs " + args.reference], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
