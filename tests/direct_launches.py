"""Run by tests/test_kernels_launch.py in a process of its own, without TRITON_INTERPRET (the
kernels must compile): attnzoo's direct launches (``attnzoo.kernels.launch_on_device``) against
Triton's ``JITFunction.run``, on a simulated sm90 GPU (scripts/simulated_gpu.py: the kernels
compile, the launcher records). Prints one JSON object of findings."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from simulated_gpu import SimulatedGPU, simulated_gpu  # noqa: E402

from attnzoo import kernels  # noqa: E402
from attnzoo.ops import na2d_qkv, qna2d, san_aggregation, san_subtraction2  # noqa: E402

_run = JITFunction.run
runs = []  # the kernels launched through JITFunction.run


def counted_run(self, *args, **kwargs):
    runs.append(self.fn.__name__)
    return _run(self, *args, **kwargs)


JITFunction.run = counted_run


def described(launch):
    """A launch, its tensors by dtype, shape, strides and alignment (they are new each call)."""
    def arg(a):
        if isinstance(a, torch.Tensor):
            return [str(a.dtype), list(a.shape), list(a.stride()), a.data_ptr() % 16]
        return [type(a).__name__, a]
    return [list(launch.grid), launch.stream, launch.function, id(launch.metadata),
            [arg(a) for a in launch.args]]


def families():
    g = torch.Generator().manual_seed(0)

    def new(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    qkv, rpb = new(1, 7, 7, 3, 2, 16, dtype=torch.bfloat16), new(2, 13, 13)
    logits, v = new(1, 6, 6, 2, 2), new(1, 6, 6, 2, 8)
    qrpb, ws = new(2, 2, 3, 3), new(2, 2, 3, 3)
    x, w = new(1, 8, 6, 6), new(1, 4, 9, 36)
    x1, x2 = new(1, 4, 6, 6), new(1, 4, 6, 6)
    return {
        "na2d_qkv": lambda: na2d_qkv(qkv, kernel_size=7, rpb=rpb, backend="cuda"),
        "qna2d": lambda: qna2d(logits, v, kernel_size=3, rpb=qrpb, window_weights=ws,
                               backend="cuda"),
        "san_aggregation": lambda: san_aggregation(x, w, kernel_size=3, backend="cuda"),
        "san_subtraction2": lambda: san_subtraction2(x1, x2, kernel_size=3, backend="cuda"),
    }


def step(call):
    out = call()
    out.backward(torch.ones_like(out))


def check_families(gpu) -> dict:
    """Per family, a warm forward + backward through JITFunction.run and through the direct
    launches: the launches the launcher got, and the kernels that went through
    JITFunction.run."""
    found = {}
    for name, call in families().items():
        seen = {}
        for direct in (False, True):
            kernels.direct_launches(direct)
            step(call)  # compiles; with direct, makes the direct launchers
            gpu.launches.clear()
            runs.clear()
            step(call)
            seen[direct] = dict(launches=[described(launch) for launch in gpu.launches],
                                runs=list(runs))
        found[name] = seen
    return found


@triton.jit
def _probe(X, n, scale, FLAG: tl.constexpr, B: tl.constexpr):
    i = tl.arange(0, B)
    x = tl.load(X + i, mask=i < n)
    if FLAG:
        x = x * scale
    tl.store(X + i, x, mask=i < n)


def check_specializations(gpu) -> dict:
    """A kernel launched with arguments that Triton specializes apart (an address off 16
    bytes, 1 and multiples of 16 among ints, an int too large for i32, a bool, a dtype): the
    compiled kernel (function handle) each launch got, through JITFunction.run and directly
    (twice: the second from its launcher)."""
    gpu.watch(_probe)
    base = torch.zeros(4096)
    cases = {
        "aligned, n 17": ((base, 17, 0.5, True, 32), {}),
        "address off 16 bytes": ((base[1:], 17, 0.5, True, 32), {}),
        "address off 16 again": ((base[3:], 17, 0.5, True, 32), {}),
        "n 1": ((base, 1, 0.5, True, 32), {}),
        "n 16": ((base, 16, 0.5, True, 32), {}),
        "n 2**33": ((base, 2 ** 33, 0.5, True, 32), {}),
        "n True": ((base, True, 0.5, True, 32), {}),
        "scale 2.0": ((base, 17, 2.0, True, 32), {}),
        "FLAG False": ((base, 17, 0.5, False, 32), {}),
        "float16": ((base.half(), 17, 0.5, True, 32), {}),
        "num_warps 2": ((base, 17, 0.5, True, 32), dict(num_warps=2)),
        "B by name": ((base, 17, 0.5, True), dict(B=32)),
        "FLAG True by name": ((base, 17, 0.5), dict(FLAG=True, B=32)),
        "FLAG 1 by name": ((base, 17, 0.5), dict(FLAG=1, B=32)),
    }
    found = {}
    for label, (args, kwargs) in cases.items():
        functions = []
        for direct in (False, True, True):
            kernels.direct_launches(direct)
            gpu.launches.clear()
            runs.clear()
            kernels.launch_on_device(_probe, (1,), *args, **kwargs)
            launch = gpu.launches[0]
            functions.append(dict(function=launch.function, runs=len(runs),
                                  args=described(launch)[4]))
        found[label] = functions
    return found


@triton.jit
def _copy(X, Y, n, B: tl.constexpr):
    i = tl.arange(0, B)
    tl.store(Y + i, tl.load(X + i, mask=i < n), mask=i < n)


def _launches(gpu, calls, kernel=_probe) -> dict:
    """``calls`` (each ``(args, kwargs)`` for ``kernel``, or a callable run between launches):
    each launch's compiled kernel and whether it went through JITFunction.run."""
    functions, ran = [], []
    for call in calls:
        if callable(call):
            call()
            continue
        gpu.launches.clear()
        runs.clear()
        kernels.launch_on_device(kernel, (1,), *call[0], **call[1])
        functions.append(gpu.launches[0].function)
        ran.append(len(runs))
    return dict(functions=functions, runs=ran)


def check_changes(gpu) -> dict:
    """Direct launches, where what a key does not hold changes: a tensor given by name (the
    second of another dtype and alignment), the kernel's compiled kernels forgotten (Triton's
    cache cleared, as an updated source or a changed compile option clears it), the kernel's
    own debug flag set."""
    kernels.direct_launches(True)
    gpu.watch(_copy)
    base = torch.zeros(256)
    found = dict(by_name=_launches(gpu, [
        ((base,), dict(Y=y, n=17, B=16)) for y in (base, base.half()[1:], base)], _copy))
    args = ((base, 17, 0.5, True, 64), {})
    found["cache cleared"] = _launches(gpu, [args, args, _probe.device_caches.clear, args, args])

    def debug(flag):
        return lambda: setattr(_probe, "debug", flag)
    flag = _probe.debug
    try:
        found["kernel debug"] = _launches(gpu, [args, debug(True), args, args, debug(flag),
                                                args])
    finally:
        _probe.debug = flag
    return found


def check_hooks(gpu) -> dict:
    """A launch hook set (a profiler's): every launch goes through JITFunction.run, which
    hands the hook its metadata."""
    from triton import knobs
    kernels.direct_launches(True)
    base = torch.zeros(64)
    kernels.launch_on_device(_probe, (1,), base, 17, 0.5, True, 32)  # a direct launcher
    hooked = []
    hook = knobs.runtime.launch_enter_hook
    chained = hasattr(hook, "add")
    if chained:
        hook.add(hooked.append)
    else:
        knobs.runtime.launch_enter_hook = hooked.append
    try:
        runs.clear()
        kernels.launch_on_device(_probe, (1,), base, 17, 0.5, True, 32)
    finally:
        if chained:
            hook.remove(hooked.append)
        else:
            knobs.runtime.launch_enter_hook = None
    return dict(runs=len(runs), launches=len(gpu.launches))


def main() -> None:
    findings = {}
    with simulated_gpu() as gpu:
        findings["families"] = check_families(gpu)
        findings["specializations"] = check_specializations(gpu)
        findings["changes"] = check_changes(gpu)
        gpu.launches.clear()
        findings["hooks"] = check_hooks(gpu)
        findings["direct kernels"] = sorted(
            k[0].fn.__name__ for k in kernels._direct_kernels.values() if k[1])
    active = vars(driver).get("_active", vars(driver).get("active"))  # as Triton keeps it
    findings["left"] = dict(launchers=len(kernels._launchers),
                            restored=not isinstance(active, SimulatedGPU))
    print(json.dumps(findings))


if __name__ == "__main__":
    main()
