"""What the kernel tests of every family share: a kernel's output and input gradients against the
float64 torch reference on the same (rounded) inputs (the reference itself is checked against the
brute forces of tests/oracles.py by the op tests); the layouts models hand the custom ops,
torch.library's checks of an op on them, and the ATen ops a call dispatches."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Iterable, Optional, Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOps(TorchDispatchMode):
    """Within it, ``names``: every ATen op dispatched, as ``str(op)`` (``aten.stack.default``)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def weighted_grads(out: torch.Tensor, inputs: Sequence[torch.Tensor], dtype: torch.dtype,
                   seed: int = 1):
    """Gradients of a fixed random weighting of ``out``, the weights rounded to ``dtype`` (the
    kernel's) whatever ``out``'s dtype, so kernel and reference see the same ones."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype).to(out)
    return torch.autograd.grad((out * w).sum(), inputs)


def assert_matches_reference(out: torch.Tensor, grads: Sequence[torch.Tensor], ref: torch.Tensor,
                             ref_grads: Sequence[torch.Tensor], dtype: torch.dtype, tol: float,
                             grad_tol: Optional[float] = None, names: Iterable[str] = None,
                             relative: Optional[Iterable[str]] = None) -> None:
    """``out`` and ``grads`` (the kernel's, in ``dtype``) equal the float64 reference's within
    ``tol`` forward and ``grad_tol`` (default ``tol``) backward, atol = rtol, with the same dtype
    and shapes. The gradients named in ``relative`` (every one when ``None``) are divided first
    by their largest reference entry where that is over 1: the gradients of a bias or weight
    that every output shares are sums over the outputs."""
    names = list(names) if names is not None else [f"input {i}" for i in range(len(grads))]
    grad_tol = tol if grad_tol is None else grad_tol
    assert out.dtype == dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    torch.testing.assert_close(out.double().cpu(), ref.detach().double(), atol=tol, rtol=tol)
    assert len(grads) == len(ref_grads) == len(names)
    for name, got, exp in zip(names, grads, ref_grads):
        assert got.dtype == dtype and got.shape == exp.shape, (name, got.dtype, got.shape)
        scaled = relative is None or name in relative
        norm = max(1.0, exp.abs().max().item()) if scaled else 1.0
        torch.testing.assert_close(got.double().cpu() / norm, exp.double() / norm, atol=grad_tol,
                                   rtol=grad_tol, msg=lambda m: f"grad {name}: {m}")


H100 = ("NVIDIA H100 80GB HBM3", (9, 0), 227 << 10)  # name, capability, shared memory per block


def simulate_gpu(monkeypatch, gpu=H100, triton="3.6.0") -> None:
    """Every CUDA device is ``gpu`` (compiled kernels, not the interpreter's), with Triton
    ``triton`` installed: what ``auto`` reads to decide on the kernels (and NATTEN, where it is
    installed, on the device's capability)."""
    from attnzoo import backends, kernels
    from attnzoo.kernels import tiling
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu[1])
    monkeypatch.setattr(tiling, "INTERPRETED", False)
    monkeypatch.setattr(kernels, "device_info", lambda device: kernels.DeviceInfo(*gpu))
    monkeypatch.setattr(kernels, "triton_version", lambda: triton)
    backends.reset()


def verification(family: str, dtypes=("bfloat16",), arch="sm_90", triton="3.6.0",
                 digest=None):
    """A record of ``family``'s kernels as installed (``digest``: of other kernels)."""
    from attnzoo import kernels
    return kernels.Verification(family, arch, tuple(dtypes), H100[0], "2026-11-26", "2.11.0",
                                triton, digest or (kernels.kernels_digest(family) if family
                                                   in kernels.FAMILIES else "0" * 12),
                                "python scripts/gpu_verify.py --out gpu_verify")


def check_auto_waits_for_a_verification(monkeypatch, kernel_records, family: str, op: str,
                                        call, trusted) -> None:
    """On a (simulated) H100 with Triton 3.6, ``auto`` leaves ``call`` (a call key of ``op`` on
    ``cuda:0`` in bf16) to the torch reference until the records file holds a verification of
    ``family``'s kernels as installed on sm_90 in bf16 with a Triton 3.6.x, and
    ``trusted(call)`` (the backend's answer to auto) says why; a record for another dtype,
    architecture, Triton minor or version of the kernels does not do."""
    from attnzoo import backends

    assert call.dtype == torch.bfloat16
    simulate_gpu(monkeypatch)
    assert "not been verified on sm_90 (NVIDIA H100 80GB HBM3) in bfloat16 with Triton 3.6" \
        in trusted(call)
    assert backends.resolve(op, call) == "torch"
    kernel_records(verification(family, digest="0123456789ab"))  # of the kernels before a change
    assert backends.resolve(op, call) == "torch"
    assert "the records for sm_90 are of other versions of them (0123456789ab)" in trusted(call)
    kernel_records(verification(family, ("float32", "float16")), verification(family, arch="sm_80"),
                   verification(family, triton="3.7.0"))
    assert backends.resolve(op, call) == "torch"
    assert "(only with Triton 3.6.0 in float32, float16; Triton 3.7.0 in bfloat16)" \
        in trusted(call)
    kernel_records(verification(family, ("float32", "bfloat16"), triton="3.6.1"))
    assert trusted(call) is None
    assert backends.resolve(op, call) == "cuda"
    assert backends.resolve(op, call._replace(dtype=torch.float16)) == "torch"
    simulate_gpu(monkeypatch, triton="3.7.0")  # a user with another Triton minor: not trusted
    assert backends.resolve(op, call) == "torch"
    simulate_gpu(monkeypatch, triton="3.6.2")
    assert backends.resolve(op, call) == "cuda"


# A skip reason that starts so is no verdict on a GPU: such a test checks what only Triton's
# interpreter shows (scripts/gpu_verify.py lists it and counts it against no family).
INTERPRETER_ONLY = "interpreter-only:"
INTERPRETER_BUG = "only 0-dimensional arrays can be converted to Python scalars"


def rerun_without_a_gpu(request) -> bool:
    """On a GPU host, run the calling test again in a process that sees no GPU (its kernels then
    interpreted, as on CI) and assert it passes; ``True`` when it did, and the caller returns.
    For tests of what only the interpreter shows (its memory accesses, its calls)."""
    if not torch.cuda.is_available():
        return False
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
        cwd=request.config.rootpath, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        capture_output=True, text=True, timeout=900)
    if result.returncode and INTERPRETER_BUG in result.stdout:
        import numpy
        import triton
        pytest.skip(f"{INTERPRETER_ONLY} Triton {triton.__version__}'s interpreter cannot run "
                    f"with NumPy {numpy.__version__} (its loops call int() on 1-element arrays, "
                    "which NumPy >= 2.4 refuses; Triton 3.8 does not); CI runs it")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-2000:]
    return True


def laid_out(t: torch.Tensor, layout: str, grad: bool = False) -> torch.Tensor:
    """``t``'s values in ``layout``, as a model hands them to an op:

    * ``contiguous``;
    * ``projection``: a strided view of one of the three parts of a fused projection (the
      qkv / kv linear's output ``[..., 3, heads, d]`` unbound), on the heads dim's left;
    * ``permuted``: dense but not contiguous: a 4-D map channels_last, a 5-D or 6-D heads-last
      map stored heads-major (dims 1 and -2 swapped in memory);
    * ``batch_slice``: the last ``B`` samples of a batch of ``B + 1`` (an offset into storage).

    ``grad``: a leaf that requires grad (opcheck then checks the backward too)."""
    if layout == "projection":
        t = torch.stack([torch.zeros_like(t), t, torch.zeros_like(t)], dim=-3).select(-3, 1)
    elif layout == "permuted" and t.dim() == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    elif layout == "permuted":
        order = list(range(t.dim()))
        order[1], order[-2] = order[-2], order[1]
        t = t.permute(order).contiguous().permute(order)
    elif layout == "batch_slice":
        t = torch.cat([torch.zeros_like(t[:1]), t]).narrow(0, 1, t.shape[0])
    elif layout != "contiguous":
        raise ValueError(f"unknown layout {layout!r}")
    return t.detach().requires_grad_() if grad else t


def opcheck(op, args, backward_op: bool = False) -> None:
    """torch.library.opcheck's checks of ``op`` on ``args``: schema, autograd registration, fake
    tensor (every output's sizes, strides and dtype against the real one's) and, for a forward
    op, AOT dispatch with dynamic shapes (forward, and backward where inputs require grad: the
    backward op traced). A ``backward_op`` is never differentiated: its AOT dispatch would
    repeat the fake tensor check."""
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op, args, test_utils=checks + (
        () if backward_op else ("test_aot_dispatch_dynamic",)))


CPU = torch.device("cpu")  # the device a fake tuner's choices are for


def fake_tuner(times, store=None):
    """An autotuner whose configurations (the keys of ``times``) all "compile" without spills
    and time as ``times`` says: ``(tuner, launch, launched)``, ``launched`` the configurations
    launched (timed) so far."""
    from attnzoo import kernels
    launched = []

    class Compiled:  # what the autotuner reads of a compiled Triton kernel
        n_spills = 0

        def _init_handles(self):
            pass

    def launch(config, warmup=False):
        if warmup:
            return Compiled()
        launched.append(config)

    def bench(fn):
        fn()
        return times[launched[-1]]
    return kernels.Autotuner(bench, store=store), launch, launched

