"""``attnzoo`` command line.

``attnzoo list``                  the registered attnzoo models (and pretrained tags)
``attnzoo bench [MODEL]``         params, GMACs and throughput per available backend, random input
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import List, Optional, Sequence

import torch

from . import backends
from .models import list_models
from .profiling import count_macs, count_params, time_steps


def _cmd_list(args) -> int:
    for name in list_models(args.filter, pretrained=args.pretrained):
        print(name)
    return 0


def _step(model, x, backward: bool):
    """One benchmark step: inference, or forward+backward."""
    if backward:
        return lambda: model(x).float().logsumexp(-1).sum().backward()

    def infer():
        with torch.no_grad():
            model(x)
    return infer


def _cmd_bench(args) -> int:
    import timm

    device = torch.device(args.device)
    dtype = {"float32": torch.float32, "float16": torch.float16,
             "bfloat16": torch.bfloat16}[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    model = timm.create_model(args.model, pretrained=False).to(device=device, dtype=dtype)
    model.train(args.backward)
    size = args.img_size or model.pretrained_cfg["input_size"][-1]
    x = torch.randn(args.batch_size, 3, size, size, device=device, dtype=dtype)
    print(f"{args.model}: {count_params(model) / 1e6:.2f} M params, "
          f"{count_macs(model, (1, 3, size, size)) / 1e9:.2f} GMACs at {size}x{size}", flush=True)
    print(f"throughput, batch {args.batch_size}, {args.dtype} on {device}, "
          f"{'forward+backward' if args.backward else 'inference'}, {args.steps} steps:", flush=True)
    for name in args.backends.split(","):
        try:
            with backends.use_backend(name):
                seconds = statistics.median(time_steps(
                    _step(model, x, args.backward), device, args.warmup, args.steps))
        except backends.BackendUnsupportedError as e:
            print(f"  {name:>6}: unavailable ({e})", flush=True)
            continue
        print(f"  {name:>6}: {args.batch_size / seconds:9.1f} img/s  "
              f"({seconds * 1e3:.1f} ms/step)", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnzoo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="list attnzoo models registered with timm")
    p.add_argument("filter", nargs="?", default="", help="wildcard, e.g. 'dinat_*'")
    p.add_argument("--pretrained", action="store_true", help="list pretrained tags")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("bench", help="params, GMACs and throughput per backend (random input)")
    p.add_argument("model", nargs="?", default="nat_tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--img-size", type=int, default=None, help="default: the model's input size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--backends", default="auto,torch,natten,cuda",
                   help="comma-separated backends to time")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--backward", action="store_true", help="time forward+backward")
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
