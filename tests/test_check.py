"""`attnzoo check`: every registered op on every backend here against the float64 torch reference.

The numbers it prints come from attnzoo.backends.check_case (the registry's check cases); these
tests hold the command to its contract: a row per op, backend and dtype with the reason for what
did not run, exit 0 when every error is within tolerance and exit 1 naming the op, backend and
case when one is not (a deliberately wrong backend: outputs, gradients, NaN, an exception), and
the `cuda` backend's Triton kernels passing under Triton's interpreter in a fresh process.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnzoo import backends, cli, kernels

ROOT = Path(__file__).resolve().parents[1]


def _rows(out: str):
    """The table's rows: (op, backend, dtype) -> the rest of the line."""
    rows = {}
    for line in out.splitlines():
        fields = line.split(None, 3)
        if len(fields) == 4 and fields[0] in backends.registered_ops():
            rows[tuple(fields[:3])] = fields[3]
    return rows


def test_check_on_cpu_passes_and_says_why_each_backend_does_not_run(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the cuda backend cannot run here
    assert cli.main(["check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert set(rows) == {(op, name, "fp32") for op in backends.registered_ops()
                         for name in backends.CONCRETE_BACKENDS}
    for op in backends.registered_ops():
        n = len(backends.op_cases(op, "cpu", torch.float32))
        assert re.match(rf"{n}/{n} +\d\.\de-\d\d +\d\.\de-\d\d +1e-05 .* ok$", rows[op, "torch",
                                                                                  "fp32"])
        cuda = re.fullmatch(rf"0/{n} +- +- +1e-05 +\d+\.\d s +not run \[(\d+)\]",
                            rows[op, "cuda", "fp32"])
        assert cuda, rows[op, "cuda", "fp32"]
        assert re.search(rf"^\[{cuda[1]}\] \S.*", out, re.M)  # the reason, as a note
    assert "TRITON_INTERPRET=1" in out and " here: " not in out
    natten = rows["na2d", "natten", "fp32"]
    assert natten.startswith("0/5 ") and "not run" in natten or re.match(
        r"2/5 fwd only .* ok; 3 not run \[\d+\]$", natten), natten  # no rpb: forward, CPU
    assert re.search(r"^fp32: worst error forward \d\.\de-\d\d \(\w+ on \w+\), backward "
                     r"\d\.\de-\d\d \(\w+ on torch\); tolerance 1e-05$", out, re.M)
    assert out.rstrip().endswith(" case(s) checked, every error within tolerance")


def test_check_takes_the_ops_to_check(capsys):
    assert cli.main(["check", "--device", "cpu", "--backend", "torch", "--op", "na1d",
                     "san_aggregation"]) == 0
    assert set(_rows(capsys.readouterr().out)) == {("na1d", "torch", "fp32"),
                                                   ("san_aggregation", "torch", "fp32")}
    with pytest.raises(SystemExit) as info:
        cli.main(["check", "--op", "na3d"])
    assert info.value.code == 2
    assert "argument --op: invalid choice: 'na3d'" in capsys.readouterr().err


@pytest.fixture
def wrong_cuda(monkeypatch):
    """na2d's `cuda` backend replaced by one supported everywhere that runs the torch reference
    with a fault; ``wrong_cuda(fault)`` sets it (a function of the implementation's args)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # na1d's real cuda backend: not here
    spec = backends._OPS["na2d"]
    reference = spec.backends["torch"].impl
    faults = []
    monkeypatch.setitem(backends._OPS, "na2d", spec._replace(backends=dict(
        spec.backends, cuda=backends.Backend(lambda *args: reference(*faults[-1](*args))))))
    backends.reset()
    yield faults.append
    monkeypatch.undo()
    backends.reset()  # forget the resolutions made with the fake


def _fail(*_):
    raise RuntimeError("an illegal memory access was encountered")


@pytest.mark.parametrize("fault,what", [
    (lambda q, k, v, *rest: (q, k, v * (1 + 1e-3), *rest),
     r"forward 1\.\de-0[34], backward \d\.\de-0\d > 1e-05"),
    (lambda q, k, v, *rest: (q, k, v.detach() + (v - v.detach()) * 0.5, *rest),
     r"backward \d\.\de-0\d > 1e-05"),  # the right output, half of v's gradient
    (lambda q, k, v, *rest: (q * float("nan"), k, v, *rest), r"forward nan, backward nan > 1e-05"),
    (_fail, "RuntimeError: an illegal memory access was encountered"),
], ids=["output", "gradient", "nan", "error"])
def test_check_exits_1_naming_the_op_backend_and_case_a_wrong_backend_fails(
        wrong_cuda, fault, what, capsys):
    wrong_cuda(fault)
    assert cli.main(["check", "--device", "cpu", "--backend", "cuda"]) == 1
    out = capsys.readouterr().out
    rows = _rows(out)
    assert re.match(r"\d/5 .* FAIL$", rows["na2d", "cuda", "fp32"]) or "error" in what
    labels = [case.label for case in backends.op_cases("na2d", "cpu", torch.float32)]
    for label in labels:  # every case is wrong, each named under its row with what is wrong
        assert re.search(rf"^    {re.escape(label)}: {what}", out, re.M), (label, out)
    assert "not run" in rows["san_subtraction2", "cuda", "fp32"]  # the table went on
    failed = out.strip().splitlines()[-1]
    assert failed.startswith("FAILED: 5 case(s) above tolerance or in error: ")
    assert all(f"na2d/cuda/fp32 {label!r}" in failed for label in labels)
    if "nan" in what:  # a NaN is the worst error, not skipped by the comparisons
        assert re.search(r"^fp32: worst error forward nan \(na2d on cuda\)", out, re.M)


def test_check_on_cuda_without_a_gpu_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on CI, on a GPU host too
    with pytest.raises(SystemExit) as info:
        cli.main(["check", "--device", "cuda"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "attnzoo check: error: --device cuda: no CUDA device is available here\n")


@pytest.mark.skipif(bool(kernels.triton_missing()), reason=str(kernels.triton_missing()))
def test_check_passes_the_triton_kernels_under_the_interpreter():
    """What a user without a GPU runs to check the kernels: TRITON_INTERPRET=1 set before
    attnzoo is imported, in a fresh process (a GPU host's GPU hidden from it), here on one op of
    each kernel family: every case of every op on the cuda backend is
    test_ops_registry.py::test_backend_matches_the_float64_reference's, in process."""
    ops = ("na1d", "qna2d", "san_subtraction")
    result = subprocess.run(
        [sys.executable, "-m", "attnzoo", "check", "--device", "cpu", "--backend", "cuda",
         "--op", *ops],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1",
                           CUDA_VISIBLE_DEVICES=""),
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _rows(result.stdout)
    assert {op for op, _, _ in rows} == set(ops), result.stdout
    with_kernels = [op for op in backends.registered_ops()
                    if "cuda" in backends._OPS[op].backends]
    assert {"na1d", "na2d", "qna2d", "san_aggregation", "san_subtraction"} <= set(with_kernels)
    for op in ops:
        n = len(backends.op_cases(op, "cpu", torch.float32))
        assert re.match(rf"{n}/{n} +\d\.\de-\d\d +\d\.\de-\d\d +1e-05 .* ok$",
                        rows[op, "cuda", "fp32"]), result.stdout


def test_check_fails_when_a_backend_asked_for_runs_no_case(monkeypatch, capsys):
    """Named with --backend, a backend that can run nothing here (the cuda kernels on CPU
    outside the interpreter) fails the check: a user verifying it must not read "ok"."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the cuda backend cannot run here
    assert cli.main(["check", "--device", "cpu", "--backend", "cuda", "torch"]) == 1
    out = capsys.readouterr().out
    assert "fp32: worst error forward" in out
    assert out.rstrip().endswith("FAILED: no case ran on cuda here: the notes above say why")
