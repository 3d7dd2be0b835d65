#!/usr/bin/env python
"""Benchmark every backend of every registered attnzoo op, and NA against its baselines. Not a
test: it prints ratios measured in one run (and optionally writes JSON and a PNG plot).

Part 1, every op: for each op in ``attnzoo.backends.registered_ops()`` and each call of
``attnzoo.backends.op_examples(op, device, dtype)`` (the families' real shapes), every backend
of ``attnzoo.backends.CONCRETE_BACKENDS`` that can run it: time and peak memory of the forward
(under no_grad) and of forward+backward, and the ratio of the torch reference's time to each
backend's. Only the op is timed (an ``observe_ops`` observer around the dispatched call, plus
``backward()``), not the example's input creation.

Part 2, NA at NAT-tiny's stage shapes (224 px: 56/28/14/7 px, 2/4/8/16 heads, head dim 32,
K=7) and DiNAT's dilated ones: every backend with RPB (``cuda+rpb``, ...) and without (NATTEN
>= 0.20 has no RPB) and FlexAttention with a neighborhood block mask (compiled; dilation and
clamped windows in its mask_mod), with NAT's RPB through its ``score_mod`` (``flex+rpb``, the
comparison NAT needs) and without (``flex``), with the ratio of each to attnzoo's ``cuda+rpb``.
On a GPU it also prints the achieved fraction of the memory-bandwidth bound (reading q, k, v and
writing o once for the forward; reading q, k, v, o, dO and writing dQ, dK, dV once more for the
backward) at the device's peak bandwidth (from its memory clock and bus width, or
--peak-gbps). Timing and memory: :mod:`attnzoo.profiling`.

GPU targets (issue 10, bf16, forward and forward+backward, K=7, NAT-tiny stages): cuda+rpb
>= 2x faster than flex (no rpb) and >= 5x faster than the torch reference.

    python scripts/bench_ops.py                                  # CPU, fp32, what CPU can run
    python scripts/bench_ops.py --device cuda --dtype bf16 --batch 64 --plot ops.png
    python scripts/bench_ops.py --part 2 --no-flex --repeats 5
    python scripts/bench_ops.py --threads 1 --clock process --repeats 5  # a shared CPU machine
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from typing import Dict, List, Optional

os.environ.pop("TRITON_INTERPRET", None)  # a benchmark of the interpreter is meaningless

import torch  # noqa: E402

import attnzoo  # noqa: E402,F401  (registers the ops)
from attnzoo import backends  # noqa: E402
from attnzoo.ops import na2d  # noqa: E402
from attnzoo.profiling import (CLOCKS, DTYPES, Timing, device_name, first_line, fmt,  # noqa: E402
                               table, time_call, time_op_calls)

REFERENCE = "torch"  # the backend every other one is compared with (part 1) and checked against
OURS = "cuda+rpb"    # part 2: attnzoo's NA kernel with NAT's relative positional bias
TARGETS = {"flex": 2.0, "torch+rpb": 5.0}  # required speed-up of OURS over these (GPU, issue 10)


_SEEN_REASONS: set = set()


def _reason(e: BaseException) -> str:
    """The error's first line, or a back-reference once it was printed in full."""
    line = first_line(e)
    if line in _SEEN_REASONS:
        return "(as above)"
    _SEEN_REASONS.add(line)
    return line


# ---------------------------------------------------------------------------------------------
# part 1: every backend of every registered op
# ---------------------------------------------------------------------------------------------

def part_ops(args, device, dtype) -> List[dict]:
    rows = []
    ops = [op for op in backends.registered_ops() if not args.ops or op in args.ops]
    print(f"\n== part 1: {len(ops)} registered op(s): {', '.join(ops)} ==", flush=True)
    for op in ops:
        examples = backends.op_examples(op, device, dtype)
        if not examples:
            print(f"[{op}] registers no benchmark examples", flush=True)
        for label, run in examples:
            print(f"[{op}] {label}", flush=True)
            for backward in ([False, True] if args.backward else [False]):
                kind = "fwd+bwd" if backward else "fwd"
                results: Dict[str, Timing] = {}
                for backend in backends.CONCRETE_BACKENDS:
                    repeats = args.repeats
                    if backend == "natten" and device.type == "cpu":
                        repeats = min(repeats, args.cpu_natten_repeats)  # seconds per call
                    try:
                        t = time_op_calls(lambda: run(backend), device, backward, args.warmup,
                                          repeats, clock=CLOCKS[args.clock])
                    except backends.BackendUnsupportedError as e:
                        print(f"  {kind:7s} {backend:6s} unavailable: {_reason(e)}",
                              flush=True)
                        continue
                    except (RuntimeError, NotImplementedError) as e:
                        print(f"  {kind:7s} {backend:6s} failed: {_reason(e)}", flush=True)
                        continue
                    results[backend] = t
                    ref = results.get(REFERENCE)
                    ratio = (f"  {REFERENCE}/{backend} {ref.ms / t.ms:6.2f}x"
                             if ref and backend != REFERENCE else "")
                    print(f"  {kind:7s} {backend:6s} {t.ms:10.3f} ms  "
                          f"peak +{fmt(t.peak_mib, '.1f', 0)} MiB{ratio}", flush=True)
                rows.append(dict(part=1, op=op, case=label, kind=kind,
                                 **{f"{b}_ms": r.ms for b, r in results.items()},
                                 **{f"{b}_peak_mib": r.peak_mib for b, r in results.items()}))
    return rows


# ---------------------------------------------------------------------------------------------
# part 2: NA vs natten and FlexAttention at NAT-tiny's stage shapes
# ---------------------------------------------------------------------------------------------

def raise_recompile_limit(limit: int = 256) -> None:
    """flex_attention compiles a graph per shape and pass, more than Dynamo's default recompile
    limit (8) over part 2's cases: past it Dynamo would run the later cases eagerly."""
    import torch._dynamo
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):  # the names differ between torch versions
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))


def flex_na(shape, kernel: int, dilation: int, device, compile_: bool):
    """FlexAttention computing 2-D NA (clamped windows per dilation group) on
    ``[B, H, W, heads, d]``; returns fn(q, k, v, rpb=None), the bias ``[heads, 2K-1, 2K-1]``
    added unscaled through ``score_mod`` as NAT adds it, or raises if this torch lacks it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, W, heads, D = shape
    r = kernel // 2

    def axis_ok(qi, ki, L):
        g = qi % dilation
        length = (L - g + dilation - 1) // dilation
        start = torch.minimum(torch.clamp(qi // dilation - r, min=0), length - kernel)
        kk = ki // dilation
        return (ki % dilation == g) & (kk >= start) & (kk < start + kernel)

    def mask_mod(b, h, q_idx, kv_idx):
        return (axis_ok(q_idx // W, kv_idx // W, H) & axis_ok(q_idx % W, kv_idx % W, W))

    block_mask = create_block_mask(mask_mod, None, None, H * W, H * W, device=str(device))
    if compile_:
        raise_recompile_limit()
    attend = torch.compile(flex_attention, dynamic=False) if compile_ else flex_attention

    def fn(q, k, v, bias=None):
        flat = lambda t: t.reshape(B, H * W, heads, D).transpose(1, 2)  # noqa: E731
        score_mod = None
        if bias is not None:
            def score_mod(score, b, h, q_idx, kv_idx):  # offsets in dilation-group steps
                dy = (kv_idx // W - q_idx // W) // dilation + kernel - 1
                dx = (kv_idx % W - q_idx % W) // dilation + kernel - 1
                last = 2 * kernel - 2  # clamped: outside the window the mask drops the score
                return score + bias[h, dy.clamp(0, last), dx.clamp(0, last)]
        out = attend(flat(q), flat(k), flat(v), score_mod=score_mod, block_mask=block_mask,
                     scale=D ** -0.5)
        return out.transpose(1, 2).reshape(B, H, W, heads, D)
    return fn


def peak_bandwidth_gbps(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate


def part_na(args, device, dtype) -> List[dict]:
    B = args.batch
    cases = [(f"nat_tiny s{i} {B}x{56 >> i}x{56 >> i}x{2 << i}x32 k7",
              (B, 56 >> i, 56 >> i, 2 << i, 32), 7, 1) for i in range(4)]
    cases += [(f"dinat s0 d8 {B}x56x56x2x32", (B, 56, 56, 2, 32), 7, 8),
              (f"dinat s1 d4 {B}x28x28x4x32", (B, 28, 28, 4, 32), 7, 4)]
    peak_gbps = args.peak_gbps or peak_bandwidth_gbps(device)
    print(f"\n== part 2: NA at NAT-tiny's stage shapes, batch {B} "
          f"(peak bandwidth {fmt(peak_gbps, '.0f', 0)} GB/s) ==", flush=True)
    rows = []
    for label, shape, K, d in cases:
        print(f"[{label}] dilation {d}", flush=True)
        g = torch.Generator().manual_seed(0)
        base = [torch.randn(shape, generator=g).to(device=device, dtype=dtype) for _ in range(3)]
        # the bias in fp32 whatever the dtype: a parameter under autocast, as NAT trains
        rpb0 = (torch.randn((shape[3], 2 * K - 1, 2 * K - 1), generator=g) * 0.1).to(device)
        # every backend with NAT's rpb and without (one that cannot say so, e.g. NATTEN >= 0.20
        # has no rpb), then FlexAttention with and without it
        variants = {
            f"{b}+rpb" if with_rpb else b:
                lambda q, k, v, rpb, b=b, with_rpb=with_rpb: na2d(
                    q, k, v, kernel_size=K, dilation=d, rpb=rpb if with_rpb else None, backend=b)
            for b in backends.CONCRETE_BACKENDS for with_rpb in (True, False)}
        if not args.no_flex:
            try:
                flex = flex_na(shape, K, d, device, compile_=True)
                variants["flex+rpb"] = flex
                variants["flex"] = lambda q, k, v, rpb: flex(q, k, v)
            except (ImportError, RuntimeError) as e:
                print(f"  flex unavailable: {_reason(e)}", flush=True)
        # the reference without rpb, to check the others compute the same function
        with torch.no_grad():
            expected = na2d(*base, kernel_size=K, dilation=d, backend=REFERENCE).float()
        row = dict(part=2, case=label, shape=list(shape), kernel=K, dilation=d,
                   variants=list(variants))
        elem = torch.finfo(dtype).bits // 8
        tensor_bytes = math.prod(shape) * elem
        for backward in ([False, True] if args.backward else [False]):
            kind = "fwd+bwd" if backward else "fwd"
            for name, fn in variants.items():
                repeats = args.repeats
                if name.startswith("natten") and device.type == "cpu":
                    repeats = min(repeats, args.cpu_natten_repeats)
                inputs = [t.clone().requires_grad_(backward) for t in base]
                rpb = rpb0.clone().requires_grad_(backward)
                diff = None
                try:
                    if "+rpb" not in name and name != REFERENCE and not backward:
                        with torch.no_grad():
                            diff = (fn(*inputs, rpb).float() - expected).abs().max().item()
                    t = time_call(lambda: fn(*inputs, rpb), device, backward, args.warmup,
                                  repeats, clock=CLOCKS[args.clock])
                except (backends.BackendUnsupportedError, RuntimeError, NotImplementedError,
                        ImportError) as e:
                    print(f"  {kind:7s} {name:9s} unavailable: {_reason(e)}", flush=True)
                    continue
                row[f"{name}_{kind}_ms"] = t.ms
                row[f"{name}_{kind}_peak_mib"] = t.peak_mib
                extra = (f"  max|diff| vs {REFERENCE} (no rpb) {diff:.1e}" if diff is not None
                         else "")
                if peak_gbps:
                    moved = tensor_bytes * (12 if backward else 4)
                    fraction = moved / (peak_gbps * 1e9) / (t.ms * 1e-3)
                    row[f"{name}_{kind}_bw_fraction"] = fraction
                    extra += f"  {100 * fraction:5.1f}% of the bandwidth bound"
                print(f"  {kind:7s} {name:9s} {t.ms:10.3f} ms  peak +{fmt(t.peak_mib, '.1f', 0)} "
                      f"MiB{extra}", flush=True)
            ours = row.get(f"{OURS}_{kind}_ms")
            for other in variants:
                theirs = row.get(f"{other}_{kind}_ms")
                if ours and theirs and other != OURS:
                    row[f"{other}_over_{OURS}_{kind}"] = theirs / ours
                    target = TARGETS.get(other)
                    met = "met" if target and theirs / ours >= target else "NOT met"
                    verdict = "" if target is None or device.type != "cuda" else (
                        f" (target >= {target:.0f}x: {met})")
                    print(f"  {kind:7s} {other}/{OURS} = {theirs / ours:.2f}x{verdict}",
                          flush=True)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# summary, plot
# ---------------------------------------------------------------------------------------------

def _variants(na_rows: List[dict]) -> List[str]:
    """Part 2's variants measured in some case, in their order of appearance."""
    names = dict.fromkeys(name for r in na_rows for name in r["variants"])
    return [n for n in names if any(k.startswith(n + "_") and k.endswith("_ms")
                                    for r in na_rows for k in r)]


def plot(rows: List[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path}); `pip install matplotlib`")
        return
    na_rows = [r for r in rows if r["part"] == 2]
    names = _variants(na_rows)
    kinds = [k for k in ("fwd", "fwd+bwd")
             if any(f"{n}_{k}_ms" in r for r in na_rows for n in names)]
    if not kinds:
        return
    fig, axes = plt.subplots(1, len(kinds), figsize=(7 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            values = [r.get(f"{name}_{kind}_ms", float("nan")) for r in na_rows]
            ax.bar([i + j * width for i in range(len(na_rows))], values, width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(na_rows))])
        ax.set_xticklabels([r["case"].split(" ", 2)[-1] if r["case"].startswith("nat")
                            else r["case"] for r in na_rows], rotation=30, ha="right",
                           fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log)")
        ax.set_title(f"NA {kind}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def summary(rows: List[dict], device: torch.device) -> None:
    """One line per NA case and pass; ratios over OURS, or over the reference with rpb where
    OURS cannot run (CPU)."""
    na_rows = [r for r in rows if r["part"] == 2]
    if not na_rows:
        return
    names = _variants(na_rows)
    base = OURS if any(k.startswith(OURS + "_") for r in na_rows for k in r) \
        else REFERENCE + "+rpb"
    others = [n for n in names if n != base]
    lines = []
    for r in na_rows:
        for kind in ("fwd", "fwd+bwd"):
            ours = r.get(f"{base}_{kind}_ms")
            if ours is None:
                continue
            bw = r.get(f"{OURS}_{kind}_bw_fraction")
            lines.append([r["case"], kind]
                         + [fmt(r.get(f"{n}_{kind}_ms"), ".3f") for n in names]
                         + [fmt(r[f"{o}_{kind}_ms"] / ours if f"{o}_{kind}_ms" in r else None)
                            for o in others]
                         + [fmt(None if bw is None else 100 * bw, ".1f", suffix="%")])
    print()
    print(table(["NA case", "pass"] + [f"{n} ms" for n in names]
                + [f"{o}/{base}" for o in others] + [f"{OURS} bw bound"], lines))
    if device.type == "cuda":
        print("targets (issue 10): " + ", ".join(f"{o}/{OURS} >= {t:.0f}"
                                                 for o, t in TARGETS.items())
              + ", forward and forward+backward")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--part", choices=("1", "2", "all"), default="all")
    p.add_argument("--ops", default="", help="comma-separated ops for part 1 (default: all)")
    p.add_argument("--batch", type=int, default=None,
                   help="part 2 batch (default: 64 on CUDA, 2 on CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (median); default "
                                                             "20 on CUDA, 3 on CPU")
    p.add_argument("--warmup", type=int, default=None, help="default 5 on CUDA, 1 on CPU")
    p.add_argument("--cpu-natten-repeats", type=int, default=1,
                   help="NATTEN's CPU path takes seconds per call")
    p.add_argument("--no-backward", dest="backward", action="store_false",
                   help="forward only")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (compiles)")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="memory bandwidth for the bound (default: from the device)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="process: CPU time of this process (a shared CPU machine; with "
                        "--threads 1 it equals the wall time of a quiet machine)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG plot of part 2 here")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    args.batch = args.batch or (64 if cuda else 2)
    args.repeats = args.repeats or (20 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "process" and cuda:
        p.error("--clock process measures CPU time: not meaningful for GPU kernels")
    warnings.filterwarnings("ignore", module=r"torch\.nn\.attention\.flex_attention")
    try:
        import natten
        natten_version = natten.__version__
    except ImportError:
        natten_version = "not installed"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    name = device_name(device)
    print(f"# attnzoo op benchmark: {device.type} ({name}), {dtype}, threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}, triton {triton_version}, "
          f"natten {natten_version}; median of {args.repeats} after {args.warmup} warm-up, "
          f"{args.clock} clock",
          flush=True)
    if not cuda:
        print("# CPU: the cuda backend needs a GPU (its CPU path is Triton's interpreter, for "
              "tests), so it is reported unavailable", flush=True)
    rows = []
    if args.part in ("1", "all"):
        rows += part_ops(args, device, dtype)
    if args.part in ("2", "all"):
        rows += part_na(args, device, dtype)
    summary(rows, device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device.type, device_name=name, dtype=str(dtype),
                           torch=torch.__version__, triton=triton_version, natten=natten_version,
                           rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
