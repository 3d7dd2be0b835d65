#!/usr/bin/env python
"""Compile attnzoo's Triton kernels as Triton launches them for the registered models, for sm80,
sm86, sm89 and sm90, without a GPU. Not a test.

The Triton interpreter (how CI checks the kernels' numbers on CPU) accepts programs the compiler
rejects, and says nothing of registers, spills or shared memory. This script:

1. runs every registered NAT/DiNAT model forward and backward at its default input size on the
   meta device, with its NA layers routed to the kernels (``kernels.neighborhood.na_fused``)
   and their launches captured instead of run: the q, k, v the layers really pass (views of
   one qkv projection), the output gradient autograd passes back, in fp32, fp16 and bf16;
2. for every distinct launch, arch and configuration of the kernel's autotune space there
   (``kernels.neighborhood.configs`` with the arch's shared memory), derives the signature,
   constexprs and attributes with Triton's own launch-time binder (``JITFunction.run`` does the
   same: ints equal to 1 become constexprs, 16-divisible ints and 16-byte-aligned pointers get
   ``tt.divisibility``), and compiles it to a cubin with Triton's NVIDIA backend (ptxas ships
   with Triton; Triton's cache makes a rerun fast);
3. prints per stage shape, dtype and kernel the registers, spills (the stack frame:
   ``cuobjdump --dump-resource-usage``) and shared memory against the arch's limit, the worst
   over the models' launches and the configurations; ``--write`` puts the table in
   BENCHMARKS.md between its markers.

QnA's and SAN's kernels (``--families qna,san``; one configuration each, nothing in shared
memory of their own) are compiled for the launches of their ops' registered examples, the
families' stage shapes (``attnzoo.backends.op_examples``), forward and backward, captured the
same way on meta tensors; their table has markers of its own.

    python scripts/compile_kernels.py --write BENCHMARKS.md   # every model (about an hour)
    python scripts/compile_kernels.py --quick --arch 80,90    # one launch (the test suite)
    python scripts/compile_kernels.py --models nat_tiny --arch 90 --dtypes bf16 --jobs 2
    python scripts/compile_kernels.py --families qna,san --arch 80,90 --write BENCHMARKS.md

Exit status 1 if a compile fails, spills, needs more shared memory than its arch has, or more
than ``kernels.neighborhood.shared_memory`` says (the bound the support check and the
autotuner rely on). Must run without TRITON_INTERPRET (it unsets it).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compiled kernels

import timm  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

import attnzoo  # noqa: E402
from attnzoo import backends, kernels  # noqa: E402
from attnzoo.kernels import neighborhood as kn  # noqa: E402
from attnzoo.kernels.tiling import LOG2E  # noqa: E402
from attnzoo.layers import neighborhood as na_layer  # noqa: E402
from attnzoo.profiling import first_line  # noqa: E402

# name -> (dtype, torch.get_float32_matmul_precision() while launching)
DTYPES = {"fp32": (torch.float32, "highest"), "tf32": (torch.float32, "high"),
          "fp16": (torch.float16, "highest"), "bf16": (torch.bfloat16, "highest")}
# Shared memory one block may use (opt-in): A100 163 KiB, RTX 30xx / A10 99, RTX 40xx / L4 99,
# H100 227 (CUDA C Programming Guide, compute capabilities table).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
KERNELS = {"_na_fwd_kernel": "fwd", "_na_bwd_dq_kernel": "dq", "_na_bwd_dkdv_kernel": "dkdv"}
# family -> its ops (none: NA, captured from the models) and the BENCHMARKS.md block it writes
FAMILIES = {"na": ((), "table"), "qna": (("qna2d",), "qna san table"),
            "san": (("san_aggregation", "san_subtraction", "san_subtraction2"), "qna san table")}
OP_FAMILY = {"qna2d": "qna", "san_aggregation": "san", "san_subtraction": "san",
             "san_subtraction2": "san"}  # (attnzoo.kernels' family names)


def markers(block: str) -> Tuple[str, str]:
    return f"<!-- compile_kernels.py {block} begin -->", f"<!-- compile_kernels.py {block} end -->"


class Call(NamedTuple):
    """One NA call of a model: what ``kn.na_fused`` was given, and the output gradient."""
    stage: str                  # "56x56 K7 d1 hd32" (a row of the table)
    q: torch.Tensor             # meta tensors, with the layers' strides and offsets
    k: torch.Tensor
    v: torch.Tensor
    rpb: Optional[torch.Tensor]
    kernel_size: Tuple[int, int]
    dilation: Tuple[int, int]
    scale: float
    do: torch.Tensor

    def launches(self, config: "kn.Config") -> Dict[str, tuple]:
        """Kernel name -> its launch (jit function, args, kwargs) for this call, forward and
        backward, in ``config``."""
        q, k, v = (t.detach().requires_grad_() for t in (self.q, self.k, self.v))
        rpb = None if self.rpb is None else self.rpb.detach().requires_grad_()
        with kernels.capture_launches() as launches:
            kn.na_fused(q, k, v, self.kernel_size, self.dilation, rpb, self.scale,
                        config).backward(self.do)
        return {KERNELS[fn.__name__]: (fn, args, kwargs) for fn, _, args, kwargs in launches}


def _stage(q, v, kernel_size, dilation, has_rpb) -> str:
    return (f"{q.shape[1]}x{q.shape[2]} K{kernel_size[0]} d{dilation[0]} hd{q.shape[-1]}"
            + ("" if q.shape[-1] == v.shape[-1] else f"/{v.shape[-1]}")
            + ("" if has_rpb else " no rpb"))


def model_calls(name: str, dtype: torch.dtype, batch: int = 2) -> List[Call]:
    """Run model ``name`` forward and backward on meta tensors with its NA layers on the
    kernels (launches captured, not run); return its NA calls."""
    def on_kernels(q, k, v, kernel_size, dilation, rpb, scale, backend, qkv=None):
        return kn.na_fused(q, k, v, (kernel_size,) * 2, (dilation,) * 2, rpb, scale, qkv=qkv)

    def packed_on_kernels(qkv, *args):
        return on_kernels(*qkv.unbind(3), *args, qkv=qkv)

    real = na_layer.na2d_dispatch, na_layer.na2d_qkv_dispatch
    na_layer.na2d_dispatch, na_layer.na2d_qkv_dispatch = on_kernels, packed_on_kernels
    try:
        with torch.device("meta"):
            model = timm.create_model(name).to(dtype)
        size = model.pretrained_cfg["input_size"]
        with kernels.capture_launches() as launches:
            model(torch.empty((batch,) + tuple(size), device="meta", dtype=dtype)).sum().backward()
    finally:
        na_layer.na2d_dispatch, na_layer.na2d_qkv_dispatch = real
    forward = [(args, kernels.launch_arguments(fn, args, kw)) for fn, _, args, kw in launches
               if KERNELS[fn.__name__] == "fwd"]
    # autograd runs the layers' backward last to first; dQ's launch holds the output gradient
    grads = [args[5] for fn, _, args, kw in reversed(launches) if KERNELS[fn.__name__] == "dq"]
    calls = []
    for (args, kw), do in zip(forward, grads):
        q, k, v = args[:3]
        ks, dil = (kw["KH"], kw["KW"]), (kw["DIL_Y"], kw["DIL_X"])
        rpb = args[3] if kw["HAS_RPB"] else None
        calls.append(Call(_stage(q, v, ks, dil, rpb is not None), q, k, v, rpb, ks, dil,
                          kw["qk_scale"] / LOG2E, do))
    return calls


def qkv_call(shape, kernel_size, dilation, has_rpb, dtype, label=None) -> Call:
    """A call with q, k, v as views of one qkv tensor, as the layers pass them."""
    B, H, W, heads, d = shape
    q, k, v = torch.empty(B, H, W, 3, heads, d, device="meta", dtype=dtype).unbind(3)
    rpb = (torch.empty(heads, 2 * kernel_size[0] - 1, 2 * kernel_size[1] - 1, device="meta",
                       dtype=dtype) if has_rpb else None)
    return Call(label or _stage(q, v, kernel_size, dilation, has_rpb), q, k, v, rpb,
                kernel_size, dilation, d ** -0.5, torch.empty_like(v))


def example_launches(op: str, dtype: torch.dtype) -> Dict[str, List[tuple]]:
    """Example label -> the launches (jit function, args, kwargs) of ``op``'s registered example
    on the ``cuda`` backend, forward and backward, captured on meta tensors (the kernel module's
    support check is told yes: meta tensors are not CUDA tensors)."""
    out = {}
    with kernels.supported_anywhere(OP_FAMILY[op]):
        for label, run in backends.op_examples(op, "meta", dtype):
            backends.reset()
            with kernels.capture_launches() as launches:
                run("cuda").float().sum().backward()
            out[f"{op} {label}"] = [(fn, args, kwargs) for fn, _, args, kwargs in launches]
    return out


def _short(fn) -> str:
    return fn.__name__.strip("_").replace("_kernel", "")


def specialize(fn, args, kwargs, arch: int):
    """(ASTSource, options) as ``fn[grid](*args, **kwargs)`` would compile them for ``arch``:
    Triton's launch-time binder and argument packing (JITFunction.run / _pack_args)."""
    backend = make_backend(GPUTarget("cuda", arch, 32))
    kwargs = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options


def resources(cubin: bytes) -> int:
    """Registers per thread of a cubin (cuobjdump, bundled with Triton)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, timeout=120, check=True).stdout
    return int(re.search(r"REG:(\d+)", out).group(1))


class Result(NamedTuple):
    regs: int
    spills: int     # bytes of spill stores
    shared: int
    bound: int
    error: str = ""


def compile_one(job) -> Result:
    """Compile one specialized launch: (kernel name, signature, constexprs, attrs, options,
    arch, shared-memory bound, kernel module); picklable, for a worker process. Spills are what
    ptxas reports (``-v``, which Triton passes; its log is printed with TRITON_DUMP_PTXAS_LOG, so
    compiles bypass Triton's cache to produce it)."""
    fn_name, signature, constexprs, attrs, options, arch, bound, module = job
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True
    log = io.StringIO()
    try:
        src = ASTSource(getattr(importlib.import_module(module), fn_name), signature,
                        constexprs, attrs)
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log.getvalue()))
        return Result(resources(compiled.asm["cubin"]), spills, compiled.metadata.shared, bound)
    except Exception as e:  # report and go on: the point is to list every failure
        return Result(0, 0, 0, bound, first_line(e)[:300])


def _signature(call: Call) -> tuple:
    """What the launches of a call depend on: shapes, strides, offsets, dtype, options."""
    def describe(value):
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
        return value
    return tuple(map(describe, call[1:]))


# Shapes no registered model launches, checked for the shared-memory bound and for failures
# (their spills are listed, not failures): wide heads, fp32, K=13, 1-D, non-square windows.
EXTRA = [  # label, [B, H, W, heads, d], kernel, dilation, rpb, dtype
    ("2-D K7 hd128", (1, 20, 20, 2, 128), (7, 7), (1, 1), True, "fp32"),
    ("2-D K13 hd128 no rpb", (1, 32, 32, 2, 128), (13, 13), (1, 1), False, "bf16"),
    ("2-D K(3,9) d(2,1) hd48", (1, 24, 40, 2, 48), (3, 9), (2, 1), True, "fp16"),
    ("1-D K13 d4 hd32", (2, 1, 4096, 4, 32), (1, 13), (1, 4), True, "bf16"),
    ("1-D K5 hd128", (2, 1, 512, 2, 128), (1, 5), (1, 1), True, "fp32"),
]


def _load_results(path: Path) -> Dict[str, Result]:
    if not path.exists():
        return {}
    import json
    saved = json.loads(path.read_text())
    if saved.get("triton") != triton.__version__:
        return {}
    return {key: Result(*value) for key, value in saved["results"].items()}


def _save_results(path: Path, results: Dict[str, Result]) -> None:
    import json
    path.write_text(json.dumps({"triton": triton.__version__,
                                "results": {k: list(r) for k, r in results.items()}}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"kernel families, of {', '.join(FAMILIES)}")
    p.add_argument("--models", default=None,
                   help="comma-separated attnzoo models (default: every NAT/DiNAT model)")
    p.add_argument("--arch", default="80,86,89,90", help="compute capabilities, comma-separated")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help=f"of {', '.join(DTYPES)} (tf32: fp32 inputs under "
                        "torch.set_float32_matmul_precision('high'))")
    p.add_argument("--quick", action="store_true",
                   help="nat_tiny's first stage in bf16, default configuration only (and the "
                        "first example of each QnA / SAN op in bf16)")
    p.add_argument("--no-extra", action="store_true", help="only the models' launches")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles in parallel")
    p.add_argument("--dry-run", action="store_true", help="count the distinct compiles only")
    p.add_argument("--results", default=None, metavar="FILE.json",
                   help="keep each compile's figures there and reuse them on the next run")
    p.add_argument("--write", default=None, metavar="BENCHMARKS.md",
                   help="replace the table between the file's markers")
    args = p.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",")]
    unknown = [a for a in archs if a not in SHARED_LIMIT]
    if unknown:
        p.error(f"--arch {unknown}: accepted {', '.join(map(str, SHARED_LIMIT))}")
    families = args.families.split(",")
    if not set(families) <= set(FAMILIES):
        p.error(f"--families {args.families}: accepted {', '.join(FAMILIES)}")
    dtype_names = args.dtypes.split(",")
    if not set(dtype_names) <= set(DTYPES):
        p.error(f"--dtypes {args.dtypes}: accepted {', '.join(DTYPES)}")
    print(f"# triton {triton.__version__}, torch {torch.__version__}; archs {archs}", flush=True)

    # 1. the calls: (row label, dtype name) -> calls; the models using each row
    calls: Dict[Tuple[str, str], List[Call]] = {}
    users: Dict[str, set] = {}
    if "na" not in families:
        pass
    elif args.quick:
        # nat_tiny's first stage at batch 2
        calls[("56x56 K7 d1 hd32", "bf16")] = [
            qkv_call((2, 56, 56, 2, 32), (7, 7), (1, 1), True, torch.bfloat16)]
    else:
        names = (args.models.split(",") if args.models else
                 [m for m in attnzoo.list_models() if m.startswith(("nat_", "dinat_"))])
        for dtype_name in dtype_names:
            for name in names:
                for call in model_calls(name, DTYPES[dtype_name][0]):
                    calls.setdefault((call.stage, dtype_name), []).append(call)
                    users.setdefault(call.stage, set()).add(name)
            print(f"captured {dtype_name}: {len(names)} models", flush=True)
        if not args.no_extra:
            for label, shape, ks, dil, has_rpb, dtype_name in EXTRA:
                calls[(label + " (no model)", dtype_name)] = [
                    qkv_call(shape, ks, dil, has_rpb, DTYPES[dtype_name][0], label)]

    # 2. distinct launches per (row, dtype, kernel, arch): every config of the space
    jobs, rows = {}, {}  # compile key -> job; (row, kernel, arch) -> {dtype: compile keys}
    launched = {}  # (call, config) -> its launches
    # per launch of a model (call, kernel, arch): its configurations' compile keys, the default
    # (what runs untuned: under torch.compile, the interpreter) first
    spaces: Dict[Tuple[str, str, int], List[List[str]]] = {}
    described = {}  # (index in spaces, row, kernel, arch) -> (dtype, its configurations)
    for (label, dtype_name), row_calls in calls.items():
        torch.set_float32_matmul_precision(DTYPES[dtype_name][1])  # read at launch: tf32
        distinct = {_signature(call): call for call in row_calls}.values()
        for call in distinct:
            head_dims = (call.q.shape[-1], call.v.shape[-1])
            for arch in archs:
                for kernel in kn.KERNELS:
                    keys = rows.setdefault((label, kernel, arch), {}).setdefault(dtype_name,
                                                                                 set())
                    space = kn.configs(kernel, tuple(call.q.shape[1:3]), call.kernel_size,
                                       call.dilation, head_dims, call.q.dtype,
                                       SHARED_LIMIT[arch])
                    space_keys = spaces.setdefault((label, kernel, arch), [])
                    space_keys.append([])
                    described[len(space_keys) - 1, label, kernel, arch] = (dtype_name, space)
                    for config in space[:1] if args.quick else space:
                        if (id(call), config) not in launched:
                            launched[(id(call), config)] = call.launches(config)
                        fn, fargs, fkwargs = launched[(id(call), config)][kernel]
                        src, options = specialize(fn, fargs, fkwargs, arch)
                        key = repr((fn.__name__, arch, src.signature, sorted(src.constants.items()),
                                    sorted(src.attrs.items()), sorted(options.__dict__.items())))
                        bound = kn.shared_memory(kernel, config, head_dims, call.q.dtype,
                                                 call.kernel_size)
                        jobs[key] = (fn.__name__, src.signature, src.constants, src.attrs,
                                     options.__dict__, arch, bound, fn.__module__)
                        keys.add(key)
                        space_keys[-1].append(key)
    # QnA's and SAN's launches: one configuration; no shared-memory bound but the arch's
    block_of = {}  # row label -> its BENCHMARKS.md block (NA's rows: "table")
    for family in families:
        ops, block = FAMILIES[family]
        for op in ops:
            for dtype_name in ["bf16"] if args.quick else dtype_names:
                if dtype_name == "tf32":
                    continue  # these kernels multiply without tl.dot: tf32 is fp32
                examples = list(example_launches(op, DTYPES[dtype_name][0]).items())
                for label, launches in examples[:1] if args.quick else examples:
                    block_of[label] = block
                    for fn, fargs, fkwargs in launches:
                        for arch in archs:
                            src, options = specialize(fn, fargs, fkwargs, arch)
                            key = repr((fn.__name__, arch, src.signature,
                                        sorted(src.constants.items()), sorted(src.attrs.items()),
                                        sorted(options.__dict__.items())))
                            jobs[key] = (fn.__name__, src.signature, src.constants, src.attrs,
                                         options.__dict__, arch, SHARED_LIMIT[arch],
                                         fn.__module__)
                            rows.setdefault((label, _short(fn), arch), {}).setdefault(
                                dtype_name, set()).add(key)
    torch.set_float32_matmul_precision("highest")
    print(f"{sum(len(c) for c in calls.values())} calls, {len(jobs)} distinct compiles",
          flush=True)
    if args.dry_run:
        return 0

    # 3. compile (what --results already holds is reused)
    saved = Path(args.results) if args.results else None
    results = _load_results(saved) if saved else {}
    todo = [key for key in jobs if key not in results]
    print(f"{len(jobs) - len(todo)} from {saved}, {len(todo)} to compile", flush=True)
    start = time.perf_counter()
    pool = (concurrent.futures.ProcessPoolExecutor(args.jobs) if args.jobs > 1 else
            contextlib.nullcontext())
    with pool:
        mapped = (pool.map(compile_one, [jobs[key] for key in todo]) if args.jobs > 1 else
                  map(compile_one, [jobs[key] for key in todo]))
        for i, (key, result) in enumerate(zip(todo, mapped), 1):
            results[key] = result
            if result.error or i % 25 == 0 or i == len(todo):
                job = jobs[key]
                print(f"  [{i}/{len(todo)}] {time.perf_counter() - start:6.0f} s "
                      f"{job[0]} sm{job[5]}: "
                      + (f"FAILED {result.error}" if result.error else
                         f"{result.regs} regs, spills {result.spills} B, shared {result.shared} B"),
                      flush=True)
                if saved:
                    _save_results(saved, results)
    if saved:
        _save_results(saved, results)

    # 4. table (per row and kernel, the worst over dtypes and configurations) and verdict
    failures, spilled, skipped, lines = 0, 0, set(), {}
    for (label, kernel, arch), by_dtype in rows.items():
        if arch != archs[0]:
            continue
        cells, n_configs = [], 0
        for arch in archs:
            got = [results[key] for keys in rows[(label, kernel, arch)].values() for key in keys]
            n_configs += len(got)
            errors = [r.error for r in got if r.error]
            over = [r for r in got if r.shared > SHARED_LIMIT[arch] or r.shared > r.bound]
            failures += len(errors) + len(over)
            # What can run: QnA's and SAN's one configuration; for NA the default (untuned:
            # under torch.compile, the interpreter) and what the autotuner picks, which skips
            # spilling configurations unless all spill (those skipped are counted apart).
            runnable, skips = got, 0
            if (label, kernel, arch) in spaces:
                runnable = []
                for i, space in enumerate(spaces[(label, kernel, arch)]):
                    figures = [results[key] for key in space]
                    can_run = figures if all(r.spills for r in figures) else figures[:1]
                    runnable += can_run
                    spilling = {key for key in space[1:] if results[key].spills}
                    skips += len(spilling)
                    if "(no model)" not in label:
                        skipped |= spilling
                    if any(r.spills for r in can_run) and "(no model)" not in label:
                        dtype_name, configs = described[i, label, kernel, arch]
                        print(f"spills: {label} {kernel} sm{arch} {dtype_name}: "
                              + ", ".join(f"{c} {r.spills} B" for c, r in zip(configs, figures)))
            spills = max((r.spills for r in runnable), default=0)
            if "(no model)" not in label:
                spilled += sum(r.spills > 0 for r in runnable)
            if errors:
                cells.append(f"FAILED: {errors[0][:60]}")
                continue
            shared = max(r.shared for r in got)
            cells.append(f"{max(r.regs for r in got)} / {spills} B / {shared / 1024:.0f} KiB "
                         f"({100 * shared / SHARED_LIMIT[arch]:.0f}%)"
                         + (" OVER" if over else "") + (f" ({skips} skipped)" if skips else ""))
        lines.setdefault(block_of.get(label, "table"), []).append(
            f"| {label} | {', '.join(by_dtype)} | {kernel} | {n_configs} | "
            + " | ".join(cells) + " |")
    header = ("| stage shape | dtypes | kernel | launches compiled | "
              + " | ".join(f"sm{a}: regs / spills / shared (of {SHARED_LIMIT[a] // 1024} KiB)"
                           for a in archs) + " |\n|---|---|---|---|" + "---|" * len(archs))
    tables = {block: header + "\n" + "\n".join(rows_) for block, rows_ in lines.items()}
    print("\n\n".join(tables.values()))
    failures += spilled
    verdict = (f"{len(jobs)} distinct compiles: "
               + (f"{'no' if not spilled else spilled} spilling launch(es) of the models "
                  f"({len(skipped)} distinct compiles of other autotune configurations spill: "
                  "the autotuner skips them), "
                  f"{failures - spilled} failed compile(s) or shared memory over its arch's limit "
                  "or kernels.neighborhood.shared_memory's bound"))
    print(verdict)
    if args.write:
        path = Path(args.write)
        text = path.read_text()
        for name, table in tables.items():
            begin, end = markers(name)
            if begin not in text or end not in text:
                p.error(f"{path} has no {begin} ... {end} markers")
            used = ("\n\nModels per stage shape:\n\n" + "\n".join(
                f"- {label}: {', '.join(sorted(names))}" for label, names in users.items())
                if name == "table" else "")
            block = (f"{begin}\nTriton {triton.__version__}, torch {torch.__version__}; "
                     f"`{' '.join(['python scripts/compile_kernels.py'] + (argv or sys.argv[1:]))}`"
                     f": {verdict}.\n\n{table}{used}\n{end}")
            head, rest = text.split(begin, 1)
            text = head + block + rest.split(end, 1)[1]
        path.write_text(text)
        print(f"wrote {path}")
    print("all compiled" if not failures else f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
