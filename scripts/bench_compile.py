#!/usr/bin/env python
"""First-call time of ``torch.compile`` per model (issue 36): each family's smallest model beside
timm's swin_tiny and resnet50, each in a process of its own (a fresh Dynamo and Inductor cache:
``TORCHINDUCTOR_CACHE_DIR`` is a new empty folder per model), on the CPU.

Per model and mode (``infer``: ``torch.no_grad()`` forward; ``train``: forward, loss, backward):
the wall seconds of the first call of ``torch.compile(model)`` (default mode) minus an eager
call's, split into Dynamo's tracing and the backend's work (AOT autograd + Inductor: what
``torch._dynamo.utils.compile_times`` records under ``OutputGraph.call_user_compiler``), the
graphs compiled, the graph breaks, and the recompiles a second input size causes
(``--size2``; for a fixed-size model the same size with batch 2: the graphs it adds, or the
error it raises). Outputs, and in training the gradients, are compared with eager (max
|diff|). The ratio column is each model's time over swin_tiny's in the same run:
compare ratios, not seconds, on a shared machine.

    python scripts/bench_compile.py                       # all, 224 px, batch 1, 1 thread
    python scripts/bench_compile.py --models san10_pairwise swin_tiny_patch4_window7_224
    python scripts/bench_compile.py --modes infer --write BENCHMARKS.md
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

MODELS = ("nat_mini", "dinat_mini", "qna_vit_tiny", "san10_pairwise", "san10_patchwise",
          "quest_vit_tiny_patch16_224", "swin_tiny_patch4_window7_224", "resnet50")
ANCHOR = "swin_tiny_patch4_window7_224"
LIMIT = 1.5  # issue 36: every family within this many times swin_tiny's first call


def _counters() -> Dict[str, int]:
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values())}


def _backend_seconds() -> float:
    """Seconds spent in the backend (AOT autograd + Inductor) so far in this process."""
    from torch._dynamo.utils import compile_times
    table = compile_times(repr="csv", aggregate=True)
    names, values = table if isinstance(table, tuple) else ([], [])
    return sum(float(v) for n, v in zip(names, values) if "call_user_compiler" in n)


def measure(name: str, mode: str, size: int, size2: int, threads: int) -> Dict[str, Any]:
    """One model, one mode, in this (fresh) process."""
    import timm
    import torch
    import attnzoo  # noqa: F401 - registers the models

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = timm.create_model(name)
    fixed = model.pretrained_cfg.get("fixed_input_size", False)
    if fixed:
        size = model.pretrained_cfg["input_size"][-1]
    model = model.train(mode == "train")
    x = torch.randn(1, 3, size, size)
    x2 = torch.randn(2 if fixed else 1, 3, size if fixed else size2, size if fixed else size2)

    def step(m, inp):
        if mode == "infer":
            with torch.no_grad():
                return m(inp)
        for p in model.parameters():
            p.grad = None
        out = m(inp)
        out.float().pow(2).mean().backward()
        return out.detach()

    t = time.perf_counter()
    want = step(model, x)
    eager = time.perf_counter() - t
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    torch._dynamo.reset()
    compiled = torch.compile(model)
    t = time.perf_counter()
    got = step(compiled, x)
    first = time.perf_counter() - t - eager
    after = _counters()
    backend = _backend_seconds()
    diff = (got - want).abs().max().item()
    if mode == "train":
        diff = max([diff] + [(p.grad - g).abs().max().item() for p, g in zip(
            (p for p in model.parameters() if p.grad is not None), grads)])
    try:  # a failure here is a finding of the table, not the end of the run
        step(compiled, x2)
        again = _counters()
        recompiles = str(again["graphs"] - after["graphs"])
    except Exception as e:  # noqa: BLE001 - Inductor's errors are many
        recompiles = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
    return {"model": name, "mode": mode, "first_s": first, "dynamo_s": first - backend,
            "backend_s": backend, "graphs": after["graphs"], "breaks": after["breaks"],
            "recompiles": recompiles, "max_diff": diff}


def _child(args: argparse.Namespace, name: str, mode: str) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS=str(args.threads))
        cmd = [sys.executable, __file__, "--child", name, mode, "--size", str(args.size),
               "--size2", str(args.size2), "--threads", str(args.threads)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    anchor = {r["mode"]: r["first_s"] for r in rows if r["model"] == ANCHOR}
    picked = "".join(f" --{flag} {' '.join(value)}" for flag, value, default in (
        ("modes", args.modes, ["infer", "train"]), ("models", args.models, list(MODELS)))
        if value != default)
    lines = [f"`python scripts/bench_compile.py{picked} --size {args.size} --size2 {args.size2} "
             f"--threads {args.threads}`: CPU, batch 1, one process and an empty Inductor "
             "cache per model and mode; seconds of the first compiled call beyond an eager "
             f"call; ratio: over {ANCHOR}'s in the same run (issue 36's limit: {LIMIT}x).", "",
             "| model | mode | first call s | ratio | Dynamo s | AOT+Inductor s | graphs | "
             "breaks | recompiles at 2nd size | max diff vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["first_s"] / anchor[r["mode"]] if r["mode"] in anchor else float("nan")
        # a training step's outputs differ from eager's by its dropout / drop-path draws
        diff = f"{r['max_diff']:.1e}" if r["mode"] == "infer" else "-"
        lines.append(f"| {r['model']} | {r['mode']} | {r['first_s']:.1f} | {ratio:.2f}x | "
                     f"{r['dynamo_s']:.1f} | {r['backend_s']:.1f} | {r['graphs']} | "
                     f"{r['breaks']} | {r['recompiles']} | {diff} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS),
                   help="timm names (default: %(default)s)")
    p.add_argument("--modes", nargs="+", default=["infer", "train"], choices=["infer", "train"],
                   help="(default: both)")
    p.add_argument("--size", type=int, default=224, help="input side (default: 224)")
    p.add_argument("--size2", type=int, default=192,
                   help="the second input side, for recompiles (default: 192)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    p.add_argument("--write", default=None, metavar="BENCHMARKS.md",
                   help="replace the script's table in this file (default: print only)")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child, args.size, args.size2, args.threads)))
        return 0
    rows = []
    for mode in args.modes:
        for name in args.models:
            print(f"[{len(rows) + 1}/{len(args.models) * len(args.modes)}] {name} {mode}",
                  file=sys.stderr, flush=True)
            rows.append(_child(args, name, mode))
            print(f"        {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    text = table(rows, args)
    print(text)
    if args.write:
        from attnzoo.profiling import write_table
        write_table(args.write, "bench_compile.py", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
