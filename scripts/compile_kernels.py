#!/usr/bin/env python
"""Compile attnzoo's Triton kernels for real GPUs (sm80, sm90) without one. Not a test.

The Triton interpreter (how CI checks the kernels' numbers on CPU) accepts programs that the
compiler rejects (dot operands under 16, non-power-of-two blocks, unsupported layouts). This
script runs the kernels' host code on meta tensors, captures every launch (kernel, arguments,
block shapes) and compiles it with Triton's NVIDIA backend down to a cubin (ptxas ships with
Triton), printing registers, spills (stack) and shared memory per kernel, and failing where the
shared memory exceeds what an A100 / H100 block can have. No GPU or CUDA driver needed.

    python scripts/compile_kernels.py                 # every case below, sm80 and sm90
    python scripts/compile_kernels.py --quick         # one 2-D case (what the test suite runs)
    python scripts/compile_kernels.py --arch 90 --cases fp32

Exit status 1 if any compile fails. Must run without TRITON_INTERPRET (it unsets it).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compiled kernels

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from attnzoo.kernels import neighborhood as kn  # noqa: E402
from attnzoo.profiling import first_line  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# name, [B, H, W, heads, d], kernel, dilation, rpb, dtype
CASES = [
    ("nat s0 bf16 k7 hd32", (2, 56, 56, 2, 32), (7, 7), (1, 1), True, torch.bfloat16),
    ("dinat s0 fp16 k7 dil8", (2, 56, 56, 2, 32), (7, 7), (8, 8), True, torch.float16),
    ("nat fp32 k7 hd64", (2, 28, 28, 4, 64), (7, 7), (1, 1), True, torch.float32),
    ("2d bf16 k13 hd128 norpb", (1, 32, 32, 2, 128), (13, 13), (1, 1), False, torch.bfloat16),
    ("2d fp16 k(3,9) dil(2,1) hd48", (1, 24, 40, 2, 48), (3, 9), (2, 1), True, torch.float16),
    ("1d bf16 k13 dil4", (2, 1, 4096, 4, 32), (1, 13), (1, 4), True, torch.bfloat16),
    ("1d fp32 k5 hd128", (2, 1, 512, 2, 128), (1, 5), (1, 1), True, torch.float32),
    ("2d fp32 k7 hd128", (1, 20, 20, 2, 128), (7, 7), (1, 1), True, torch.float32),
]

# Shared memory one block may use: A100 (sm80) 163 KiB, H100 (sm90) 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


def capture_launches(shape, kernel_size, dilation, has_rpb, dtype):
    """Run forward and backward host code on meta tensors; return the launches as (kernel, args,
    kwargs)."""
    q, k, v = (torch.empty(shape, device="meta", dtype=dtype, requires_grad=True)
               for _ in range(3))
    rpb = (torch.empty((shape[3], 2 * kernel_size[0] - 1, 2 * kernel_size[1] - 1),
                       device="meta", dtype=dtype, requires_grad=True) if has_rpb else None)
    with kn.capture_launches() as launches:
        o = kn.NeighborhoodAttention.apply(q, k, v, rpb, kernel_size, dilation,
                                           shape[-1] ** -0.5)
        o.backward(torch.empty_like(o))
    return [(kernel, args, kwargs) for kernel, _, args, kwargs in launches]


def to_source(kernel, args, kwargs):
    """ASTSource with the signature the runtime would derive from these arguments."""
    names = kernel.arg_names
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    values = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
    signature, constexprs = {}, {}
    for name in names:
        value = values[name]
        if name in constexpr_names:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if abs(value) < 2 ** 31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(value)}")
    options = {k: v for k, v in kwargs.items() if k not in names}
    return ASTSource(kernel, signature, constexprs), options


def resources(cubin: bytes, arch: int) -> str:
    """Registers / spills from cuobjdump (bundled with Triton)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                                 text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return "resources n/a"
    reg = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    return (f"regs {reg.group(1) if reg else '?'}, stack {stack.group(1) if stack else '?'} B, "
            f"local {local.group(1) if local else '?'} B")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="80,90", help="compute capabilities, comma-separated")
    p.add_argument("--quick", action="store_true", help="only the first case")
    p.add_argument("--cases", default=None, help="substring selecting cases by name")
    args = p.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",")]
    cases = CASES[:1] if args.quick else CASES
    if args.cases:
        cases = [c for c in cases if args.cases in c[0]]
    print(f"# triton {triton.__version__}, torch {torch.__version__}; archs {archs}", flush=True)
    failures = 0
    for name, shape, ks, dil, has_rpb, dtype in cases:
        print(f"[{name}] shape {shape} kernel {ks} dilation {dil} rpb {has_rpb}", flush=True)
        for kernel, kargs, kwargs in capture_launches(shape, ks, dil, has_rpb, dtype):
            src, options = to_source(kernel, kargs, kwargs)
            blocks = {k: src.constants[(kernel.arg_names.index(k),)] for k in
                      ("TH", "TW", "ROWS", "COLS")}
            for arch in archs:
                start = time.perf_counter()
                try:
                    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                              options=options)
                except Exception as e:  # report and go on: the point is to list every failure
                    failures += 1
                    print(f"  sm{arch} {kernel.__name__:22s} FAILED: {first_line(e)[:300]}",
                          flush=True)
                    continue
                shared = compiled.metadata.shared
                over = shared > SHARED_LIMIT.get(arch, shared)
                failures += over
                status = "TOO MUCH SHARED MEMORY" if over else "ok"
                print(f"  sm{arch} {kernel.__name__:22s} {status} "
                      f"{time.perf_counter() - start:5.1f} s {blocks} shared {shared} B, "
                      f"{resources(compiled.asm['cubin'], arch)}", flush=True)
    print("all compiled" if not failures else f"{failures} compile failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
