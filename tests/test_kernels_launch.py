"""Direct launches (``attnzoo.kernels.launch_on_device``): a warm launch goes to the compiled
kernel's launcher, where Triton's ``JITFunction.run`` would bind and specialize every argument
again, and it launches what ``JITFunction.run`` launches. Checked on a simulated sm90 GPU
(scripts/simulated_gpu.py: the kernels compile with Triton's bundled ptxas, the launcher
records), in processes of their own without TRITON_INTERPRET (this one's kernels are
interpreted): tests/direct_launches.py, and scripts/bench_host.py's columns of Triton's launch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnzoo import kernels

ROOT = Path(__file__).resolve().parents[1]

if kernels.triton_missing():  # an optional dependency; its reason is shown (-ra)
    pytest.skip(kernels.triton_missing(), allow_module_level=True)

import triton  # noqa: E402

TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2])
DIRECT = kernels._DIRECT_TRITON[0] <= TRITON <= kernels._DIRECT_TRITON[1]
FAMILY_KERNELS = {
    "na2d_qkv": ["_na_fwd_kernel", "_na_bwd_dq_kernel", "_na_bwd_dkdv_kernel"],
    "qna2d": ["_qna_fwd_kernel", "_qna_bwd_delta_kernel", "_qna_bwd_keys_kernel"],
    "san_aggregation": ["_aggregation_fwd_kernel", "_aggregation_bwd_weight_kernel",
                        "_aggregation_bwd_input_kernel"],
    "san_subtraction2": ["_subtraction_fwd_kernel", "_subtraction_bwd_kernel"],
}


def _compiled_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    return env


@pytest.fixture(scope="module")
def findings() -> dict:
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "direct_launches.py")],
                            cwd=ROOT, env=_compiled_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("family", sorted(FAMILY_KERNELS))
def test_a_warm_call_launches_what_triton_launches(findings, family):
    """A warm forward + backward: the same launches (compiled kernel, grid, stream, metadata,
    every argument) through JITFunction.run and directly, the direct ones not through it."""
    seen = findings["families"][family]
    triton_run, direct = seen["false"], seen["true"]
    assert triton_run["runs"] == FAMILY_KERNELS[family]
    assert len(direct["launches"]) == len(FAMILY_KERNELS[family])
    assert direct["launches"] == triton_run["launches"]
    assert direct["runs"] == ([] if DIRECT else FAMILY_KERNELS[family])


def test_each_specialization_gets_its_own_compiled_kernel(findings):
    """Arguments that Triton specializes apart (an address off 16 bytes, ints 1 and 16 and
    beyond i32, a bool for an int, a constexpr, a dtype, an option) get the compiled kernel
    JITFunction.run picks for them: the first direct launch of each through it, the second
    from its launcher, with the same arguments."""
    cases = findings["specializations"]
    for label, (by_run, first, second) in cases.items():
        assert by_run["function"] == first["function"] == second["function"], label
        assert by_run["args"] == first["args"] == second["args"], label
        assert by_run["runs"] == 1 and first["runs"] == 1, label
        assert second["runs"] == (0 if DIRECT else 1), label
    function = {label: launches[0]["function"] for label, launches in cases.items()}
    apart = ["address off 16 bytes", "n 1", "n 16", "n 2**33", "n True", "FLAG False",
             "float16", "num_warps 2"]
    assert len({function[label] for label in ["aligned, n 17"] + apart}) == len(apart) + 1
    # what Triton does not specialize on shares the kernel: another float, a misalignment,
    # a constexpr given by name
    assert function["scale 2.0"] == function["B by name"] == function["aligned, n 17"]
    assert function["address off 16 again"] == function["address off 16 bytes"]


def test_what_the_key_leaves_out_goes_through_triton(findings):
    """A tensor given by name goes through JITFunction.run at every launch (its dtype and
    alignment are not keyed: fp32 and a misaligned fp16 get kernels of their own); a kernel
    whose compiled kernels Triton forgot launches through it again, as does a kernel whose
    debug flag was set, until each has a direct launcher of its own."""
    changes = findings["changes"]
    by_name = changes["by_name"]
    assert by_name["runs"] == [1, 1, 1]
    fp32, fp16, again = by_name["functions"]
    assert fp32 != fp16 and again == fp32
    direct = 0 if DIRECT else 1
    cleared = changes["cache cleared"]
    assert cleared["runs"] == [1, direct, 1, direct]
    first, warm, recompiled, warm_again = cleared["functions"]
    assert first == warm != recompiled == warm_again
    debug = changes["kernel debug"]  # the kernel warm: its launches without debug, then with
    assert debug["runs"] == [direct, 1, direct, direct]
    plain, debugged, debugged_again, plain_again = debug["functions"]
    assert plain != debugged == debugged_again and plain_again == plain


def test_a_launch_hook_sends_launches_through_triton(findings):
    """With a launch hook set (a profiler's), a launch that has a direct launcher goes through
    JITFunction.run, which computes the hook's metadata."""
    assert findings["hooks"] == dict(runs=1, launches=2)


def test_direct_launches_are_for_the_tritons_read_and_leave_nothing_behind(findings):
    """Every family's kernels launch directly on a Triton whose launch was read for it
    (kernels._DIRECT_TRITON), none on another; leaving the simulated GPU forgets its
    launchers and restores Triton's driver."""
    launched = set(findings["direct kernels"])
    every = {k for names in FAMILY_KERNELS.values() for k in names} | {"_probe", "_copy"}
    assert launched == (every if DIRECT else set())
    assert findings["left"] == dict(launchers=0, restored=True)


def test_bench_host_measures_tritons_launch_and_the_direct_one():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_host.py"), "--number", "4",
         "--repeat", "1"], cwd=ROOT, env=_compiled_env(), capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| call |"))
    assert "| cuda, cpu, Triton's launch | cuda, cpu, direct launch |" in header
    row = next(line for line in lines
               if line.startswith("| san_aggregation san10 s3 14x14 k7 | fwd+bwd |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[4]) > 0 and float(cells[5]) > 0
