#!/usr/bin/env python
"""ONNX export of each family's smallest model, measured in one run (issue 26): the time of
timm's ``onnx_export`` with the TorchScript exporter (opset 17) and with the dynamo exporter,
the graphs' node counts (total and the commonest op types), and onnxruntime's CPU throughput
beside PyTorch eager's (same threads, batch and input; medians of rounds taken round-robin over
the model's runtimes, so that a machine that slows down mid-run slows them alike). Where
onnxruntime is more than 1.5x slower than PyTorch, onnxruntime's profiler
(``SessionOptions.enable_profiling``) says which op types take its time.

Exports take the model's default input size, dynamic batch, and dynamic height and width where
the model allows them (``attnzoo.hub.dynamic_size_refusal``); the dynamo exporter is also timed
with a dynamic batch only (timm's ``onnx_export.py --dynamo`` without ``--dynamic-size``). Export
times are wall seconds and, in brackets, this process's CPU seconds, which other processes on a
shared machine disturb much less (the exporters run Python on one core). PyTorch runs
attnzoo's default backend (``auto``: the torch reference on CPU).

    python scripts/bench_export.py                      # the six models, 2 threads, batch 8
    python scripts/bench_export.py --models nat_mini --rounds 3
    python scripts/bench_export.py --phases --write BENCHMARKS.md

``--phases`` also runs the dynamo exporter's three stages one at a time (``torch.export``, the
translation to ONNX, onnxscript's optimizer) and prints each one's CPU time and nodes: where
an export's time goes.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Dict, List, Tuple

import onnx
import onnxruntime
import onnxscript
import timm
import torch
from timm.utils.onnx import onnx_export

import attnzoo
from attnzoo.hub import dynamic_size_refusal
from attnzoo.profiling import device_name, fmt, model_step, time_steps, write_table

# each family's smallest model, DiNAT and SAN's two attention types apart (issue 26's list)
MODELS = ("nat_mini", "dinat_mini", "qna_vit_tiny", "san10_pairwise", "san10_patchwise",
          "quest_vit_tiny_patch16_224")
SLOW = 1.5  # issue 26: onnxruntime this much slower than PyTorch is profiled


def export(model: torch.nn.Module, path: Path, x: torch.Tensor, exporter: str,
           dynamic_size: bool) -> Tuple[float, float]:
    """Wall and CPU seconds of ``onnx_export`` (without its checker, run afterwards)."""
    opset = 17 if exporter == "torchscript" else None  # the dynamo exporter writes 18 and up
    wall, cpu = time.perf_counter(), time.process_time()
    # the dynamo exporter prints its steps; the tracer warns about Python checks of sizes
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        onnx_export(model, str(path), example_input=x, opset=opset, dynamic_size=dynamic_size,
                    use_dynamo=exporter == "dynamo", check=False)
    return time.perf_counter() - wall, time.process_time() - cpu


def warm_up(folder: str) -> None:
    """One export of a small module with each exporter, so that the first model's figures do
    not hold what a process pays once (imports, the dynamo exporter's op registry)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(1)).eval()
    for exporter in ("torchscript", "dynamo"):
        export(model, Path(folder) / f"warm_up.{exporter}.onnx", torch.randn(2, 3, 8, 8),
               exporter, True)


def dynamo_phases(model: torch.nn.Module, x: torch.Tensor, dynamic_size: bool):
    """CPU seconds and nodes of the dynamo exporter's three stages, run one at a time as
    ``torch.onnx.export(dynamo=True)`` runs them: ``torch.export`` (non-strict, with the
    size-oblivious shapes torch.onnx's capture sets, torch/onnx/_internal/exporter/
    _capture_strategies.py), then the translation of that program (decompositions, type
    promotion, ONNX ops; ``optimize=False``), then onnxscript's optimizer."""
    axes = [0, 2, 3] if dynamic_size else [0]
    shapes = ({axis: torch.export.Dim.DYNAMIC for axis in axes},)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        cpu = time.process_time()
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            program = torch.export.export(model, (x,), dynamic_shapes=shapes, strict=False)
        stages = [("torch.export", time.process_time() - cpu, len(program.graph.nodes))]
        cpu = time.process_time()
        onnx_program = torch.onnx.export(program, (x,), dynamo=True, optimize=False)
        stages.append(("translation", time.process_time() - cpu, len(onnx_program.model.graph)))
        cpu = time.process_time()
        onnx_program.optimize()
        stages.append(("optimizer", time.process_time() - cpu, len(onnx_program.model.graph)))
    return stages


def fresh_dynamo_phases(name: str, threads: int):
    """:func:`dynamo_phases` of model ``name`` in this (new) process: in the process that has
    just exported the same model, the stages run faster than in an export of their own (torch's
    symbolic-shape caches already hold the model's expressions)."""
    torch.set_num_threads(threads)
    warm_up(tempfile.mkdtemp(prefix="bench_export_"))
    torch.manual_seed(0)
    model = timm.create_model(name).eval()
    x = torch.randn(2, *model.pretrained_cfg["input_size"])
    return dynamo_phases(model, x, dynamic_size_refusal(model.pretrained_cfg) is None)


def session(path: Path, threads: int, profile_prefix: str = "") -> onnxruntime.InferenceSession:
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    if profile_prefix:
        options.enable_profiling, options.profile_file_prefix = True, profile_prefix
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def profile(path: Path, x: torch.Tensor, threads: int, runs: int, folder: str):
    """onnxruntime's own profile of ``runs`` runs after a warm-up: per op type and per node,
    the summed kernel time in ms per run."""
    sess = session(path, threads, f"{folder}/{path.stem}")
    feed = {sess.get_inputs()[0].name: x.numpy()}
    for _ in range(runs + 1):
        sess.run(None, feed)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    warm_up_end = min(e["ts"] + e["dur"] for e in events if e.get("name") == "model_run")
    by_op: Dict[str, float] = collections.Counter()
    by_node: Dict[Tuple[str, str], float] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= warm_up_end:
            op = e["args"]["op_name"]
            by_op[op] += e["dur"] / 1e3 / runs
            by_node[op, e["name"][:-len("_kernel_time")]] += e["dur"] / 1e3 / runs
    return by_op, by_node


def op_summary(counts: collections.Counter, top: int) -> str:
    return ", ".join(f"{op} {n}" for op, n in counts.most_common(top))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated timm models")
    p.add_argument("--batch-size", type=int, default=8, help="images per throughput step")
    p.add_argument("--threads", type=int, default=2, help="torch's and onnxruntime's threads")
    p.add_argument("--rounds", type=int, default=5, help="throughput rounds (medians)")
    p.add_argument("--top", type=int, default=5, help="op types listed per graph and profile")
    p.add_argument("--phases", action="store_true",
                   help="also time the dynamo exporter's stages one by one (dynamic size where "
                        "allowed)")
    p.add_argument("--write", default=None, metavar="BENCHMARKS.md",
                   help="replace the tables between the file's markers")
    args = p.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = sorted(set(names) - set(attnzoo.list_models()))
    if unknown:
        p.error(f"--models: unknown {unknown}; accepted: {', '.join(attnzoo.list_models())}")
    torch.set_num_threads(args.threads)
    where = (f"{device_name('cpu')}, {os.cpu_count()} cores, {args.threads} threads; torch "
             f"{torch.__version__}, timm {timm.__version__}, onnx {onnx.__version__}, "
             f"onnxruntime {onnxruntime.__version__}, onnxscript {onnxscript.__version__}")
    print(where, flush=True)
    folder = tempfile.mkdtemp(prefix="bench_export_")
    warm_up(folder)

    export_rows, graph_lines, phase_rows, run_rows, profiles = [], [], [], [], []
    for name in names:
        torch.manual_seed(0)
        model = timm.create_model(name).eval()
        cfg = model.pretrained_cfg
        dynamic = dynamic_size_refusal(cfg) is None
        x = torch.randn(2, *cfg["input_size"])
        cells, nodes, files = [], [], {}
        # a fixed-size model has no dynamic-size export: its dynamo graph is the batch one
        for label, exporter, size in (("TorchScript", "torchscript", dynamic),
                                      ("dynamo, batch", "dynamo", False),
                                      ("dynamo", "dynamo", True)):
            if size and not dynamic:
                cells.append("fixed size")
                continue
            kind = f"{label}{' and size' if size else ''}"
            path = Path(folder) / f"{name}.{exporter}{'.size' if size else ''}.onnx"
            print(f"{name}: exporting, {kind}...", file=sys.stderr, flush=True)
            wall, cpu = export(model, path, x, exporter, size)
            onnx.checker.check_model(str(path), full_check=True)
            with torch.no_grad():
                want = model(x)
            check = session(path, args.threads)
            got = torch.from_numpy(check.run(None, {check.get_inputs()[0].name: x.numpy()})[0])
            del check
            diff = float((got - want).abs().max())
            counts = collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)
            print(f"{name}: {kind}: {wall:.1f} s ({cpu:.1f} s CPU), {sum(counts.values())} "
                  f"nodes, onnxruntime vs PyTorch {diff:.1e}", file=sys.stderr, flush=True)
            cells.append(f"{wall:.1f} ({cpu:.1f})")
            if exporter == "torchscript" or size or not dynamic:  # the most dynamic graphs
                files["TorchScript" if exporter == "torchscript" else "dynamo"] = path
                nodes.append(f"{sum(counts.values())}")
                graph_lines.append(f"- {name}, {kind}: {sum(counts.values())} nodes "
                                   f"({op_summary(counts, args.top)}); onnxruntime vs PyTorch "
                                   f"{diff:.1e}")
        export_rows.append([name] + cells + nodes)
        if args.phases:
            print(f"{name}: the dynamo exporter's stages...", file=sys.stderr, flush=True)
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                stages = pool.apply(fresh_dynamo_phases, (name, args.threads))
            phase_rows.append(f"| {name} | " + " | ".join(
                f"{cpu:.1f} ({nodes} nodes)" for _, cpu, nodes in stages)
                + f" | {sum(cpu for _, cpu, _ in stages):.1f} |")
        # throughput: rounds round-robin over this model's runtimes (the ratios compare them),
        # then its sessions go: onnxruntime's arena keeps each one's peak (a few GB at batch 8),
        # and every model's together exceeded this machine's 23 GB
        xb = torch.randn(args.batch_size, *cfg["input_size"])
        steps = {"PyTorch": model_step(model, xb)}
        for label, path in files.items():
            sess = session(path, args.threads)
            feed = {sess.get_inputs()[0].name: xb.numpy()}
            steps[f"onnxruntime ({label})"] = (lambda s=sess, f=feed: s.run(None, f))
        times: Dict[str, List[float]] = {runtime: [] for runtime in steps}
        for r in range(args.rounds):
            for runtime, step in steps.items():
                print(f"round {r + 1}/{args.rounds}: {name} {runtime}", file=sys.stderr,
                      flush=True)
                times[runtime] += time_steps(step, "cpu", warmup=1 if r == 0 else 0, repeats=1)
        del steps, sess
        ips = {runtime: args.batch_size / statistics.median(t) for runtime, t in times.items()}
        torch_ips = ips["PyTorch"]
        cells = [fmt(torch_ips, ".1f").strip()]
        for label, path in files.items():
            ort = ips[f"onnxruntime ({label})"]
            cells += [fmt(ort, ".1f").strip(), fmt(ort / torch_ips, ".2f", suffix="x").strip()]
            if torch_ips > SLOW * ort:
                print(f"{name}: onnxruntime ({label}) {torch_ips / ort:.1f}x slower than "
                      "PyTorch: profiling it...", file=sys.stderr, flush=True)
                by_op, by_node = profile(path, xb, args.threads, 3, folder)
                total = sum(by_op.values())
                ops = ", ".join(f"{op} {ms:.0f} ms ({100 * ms / total:.0f}%)"
                                for op, ms in sorted(by_op.items(), key=lambda o: -o[1])[:args.top])
                top_nodes = ", ".join(f"{node} ({op}) {ms:.0f} ms" for (op, node), ms in sorted(
                    by_node.items(), key=lambda o: -o[1])[:3])
                profiles.append(f"- {name}, onnxruntime ({label}), {torch_ips / ort:.1f}x slower "
                                f"than PyTorch: {total:.0f} ms of kernels per batch of "
                                f"{args.batch_size}: {ops}. Slowest nodes: {top_nodes}")
        run_rows.append([name] + cells)

    export_table = (
        "| model | TorchScript, batch and size: s (CPU s) | dynamo, batch: s (CPU s) | dynamo, "
        "batch and size: s (CPU s) | TorchScript nodes | dynamo nodes |\n"
        "|---|---|---|---|---|---|\n"
        + "\n".join("| " + " | ".join(row) + " |" for row in export_rows))
    run_head = ["model", "PyTorch img/s", "onnxruntime (TorchScript) img/s", "vs PyTorch",
                "onnxruntime (dynamo) img/s", "vs PyTorch"]
    run_table = ("| " + " | ".join(run_head) + " |\n|" + "---|" * len(run_head) + "\n"
                 + "\n".join("| " + " | ".join(row) + " |" for row in run_rows))
    text = (f"{where}; export at the model's input size, batch 2; throughput at batch "
            f"{args.batch_size}, medians of {args.rounds} rounds.\n\nExport time (timm's "
            f"onnx_export, checker not included) and nodes of the written graphs:\n\n"
            f"{export_table}\n\nThe graphs (the dynamic-size ones where the model allows it):\n\n"
            + "\n".join(graph_lines) + f"\n\nonnxruntime (CPUExecutionProvider) against PyTorch "
            f"eager, same input and threads:\n\n{run_table}\n\n"
            + ("The dynamo exporter's stages, one at a time in a process of their own, CPU s "
               "(the dynamic-size export where the model allows it; nodes after each stage: "
               "torch.export's FX graph, ONNX before and after the optimizer):\n\n| model | "
               "torch.export | translation | optimizer | total |\n|---|---|---|---|---|\n"
               + "\n".join(phase_rows) + "\n\n"
               if phase_rows else "")
            + ("Where onnxruntime is more than 1.5x slower, its profiler's kernel time by op "
               "type:\n\n" + "\n".join(profiles) if profiles else
               "onnxruntime is nowhere more than 1.5x slower than PyTorch."))
    print(text)
    if args.write:
        try:
            write_table(args.write, "bench_export.py", text)
        except ValueError as e:
            p.error(str(e))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
