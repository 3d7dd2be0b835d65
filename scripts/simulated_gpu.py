"""A simulated CUDA GPU for Triton, on a machine without one: the kernels compile for a real
architecture (Triton's bundled ptxas, as scripts/compile_kernels.py does) and their launches
reach a recorder instead of a device, so that the whole host path of a kernel call, Triton's own
launch included (``JITFunction.run``: binding, specialization, its cache), runs on CPU tensors.

Only the device is simulated: Triton's driver (current device and stream, target, the loading
of a compiled binary, the launcher that would call ``cuLaunchKernelEx``). Everything above the
launcher is Triton's and attnzoo's own code. The launcher records each launch as Triton's
``JITFunction.run`` hands it over (:class:`Launch`), or counts it (``record=False``, which keeps
no tensor alive: scripts/bench_host.py).

Used by scripts/bench_host.py (its columns of Triton's launch) and tests/direct_launches.py;
run without ``TRITON_INTERPRET`` (the kernels must be compiled functions, not interpreted
ones). For the Tritons attnzoo's kernels admit (3.4 to 3.8 checked: ``load_binary``'s five
values, the driver held as ``active`` or ``_active``).
"""
from __future__ import annotations

import contextlib
import gc
import itertools
from typing import Any, Iterator, List, NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver


class Launch(NamedTuple):
    """A launch as the launcher received it."""
    grid: tuple      # (x, y, z)
    stream: int
    function: int    # the loaded kernel (one per compiled binary)
    metadata: Any    # the compiled kernel's packed metadata
    args: tuple      # every argument, constexprs too, in the kernel's order


class _Utils:
    """The driver's C utilities that a launch path calls: loading a binary (a new function
    handle per binary) and the device's properties (an H100's)."""

    def __init__(self):
        self._functions = itertools.count(1)

    def load_binary(self, name, kernel, shared, device):
        return 1, next(self._functions), 32, 0, 1024  # module, function, regs, spills, threads

    def unload_module(self, module):
        pass

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536,
                "warpSize": 32, "sm_clock_rate": 1980000, "mem_clock_rate": 2619000,
                "mem_bus_width": 5120}


class SimulatedGPU:
    """Triton's active driver while in use (``with SimulatedGPU(arch=90) as gpu``): device 0 of
    ``arch``, stream 0; ``gpu.launches`` lists what reached the launcher, ``gpu.count`` counts
    it. On leaving, Triton's driver and the compiled kernels of every ``triton.jit`` function
    launched meanwhile are forgotten (they hold this device's launchers), and so are attnzoo's
    direct launchers."""

    def __init__(self, arch: int = 90, record: bool = True):
        self.target = GPUTarget("cuda", arch, 32)
        self.record = record
        self.launches: List[Launch] = []
        self.count = 0
        self.utils = _Utils()
        gpu = self

        class Launcher:
            def __init__(self, src, metadata):
                pass

            def __call__(self, x, y, z, stream, function, metadata, launch_metadata, enter,
                         exit_, *args):
                gpu.count += 1
                if gpu.record:
                    gpu.launches.append(Launch((x, y, z), stream, function, metadata, args))

        self.launcher_cls = Launcher
        self._kernels: List[Any] = []

    # the driver's interface, as Triton's JITFunction.run and CompiledKernel call it
    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def watch(self, *kernels) -> None:
        """``kernels`` (``triton.jit`` functions) forget their compiled kernels on leaving."""
        self._kernels.extend(kernels)

    def __enter__(self) -> "SimulatedGPU":
        from attnzoo import kernels
        # what driver.active reads, as it is (Triton >= 3.5 creates its driver on first use)
        self._slot = "_active" if "_active" in vars(driver) else "active"
        self._previous = vars(driver)[self._slot]
        driver.set_active(self)
        kernels._launchers.clear()
        return self

    def __exit__(self, *exc) -> None:
        from attnzoo import kernels
        kernels._launchers.clear()
        for kernel in self._kernels:
            kernel.device_caches.clear()  # per device, its compiled kernels
        gc.collect()  # the compiled kernels unload through this driver
        vars(driver)[self._slot] = self._previous


def attnzoo_kernels() -> List[Any]:
    """Every ``triton.jit`` function of attnzoo's kernel modules."""
    from attnzoo.kernels import neighborhood, qna, san, tiling
    return [value for module in (neighborhood, qna, san, tiling)
            for value in vars(module).values() if isinstance(value, triton.runtime.JITFunction)]


@contextlib.contextmanager
def simulated_gpu(arch: int = 90, record: bool = True) -> Iterator[SimulatedGPU]:
    """A :class:`SimulatedGPU` watching attnzoo's kernels, their support checks told yes (CPU
    tensors are not CUDA tensors; the launches never run)."""
    from attnzoo import kernels
    gpu = SimulatedGPU(arch, record)
    gpu.watch(*attnzoo_kernels())
    with kernels.supported_anywhere(), gpu:
        yield gpu
