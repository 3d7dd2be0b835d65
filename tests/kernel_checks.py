"""What the kernel tests of every family share: a kernel's output and input gradients against the
float64 torch reference on the same (rounded) inputs. The reference itself is checked against the
brute forces of tests/oracles.py by the op tests."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch


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


def check_auto_waits_for_a_verification(monkeypatch, family: str, op: str, call,
                                        trusted) -> None:
    """``family``'s kernels have no record of a validation on a GPU, so on a (simulated) H100
    ``auto`` leaves ``call`` (a call key on ``cuda:0``) of ``op`` to the torch reference and
    ``trusted(call)`` (the backend's answer to auto) says why; a record for sm_90 makes auto
    pick the kernels."""
    from attnzoo import backends, kernels

    assert kernels.VERIFIED[family] == ()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "device_info",
                        lambda device: kernels.DeviceInfo("NVIDIA H100", (9, 0), 227 << 10))
    backends._resolve.cache_clear()
    assert "not been verified on sm_90" in trusted(call)
    assert backends.resolve(op, call) == "torch"
    record = kernels.Verification("sm_90", "NVIDIA H100", "2026-01-01",
                                  f"pytest tests/test_kernels_{family}.py", "simulated")
    monkeypatch.setitem(kernels.VERIFIED, family, (record,))
    backends._resolve.cache_clear()
    assert backends.resolve(op, call) == "cuda"
    backends._resolve.cache_clear()
