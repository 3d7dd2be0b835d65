"""scripts/gpu_verify.py, the GPU verdict in one command, proven without a GPU.

Its dry run (CPU, Triton's interpreter, tiny shapes) runs every stage and must write the whole
result: every stage's status and findings, a verdict per kernel family and dtype, and records
in the format of the records file that ``auto`` reads (attnzoo/kernels/verified.jsonl). A stage
that dies (a compiler abort, a CUDA fault: here an injected ``abort``), hangs or raises is
reported with its signal, its time limit or its error while the later stages still run, except
after a smoke stage that faults. The verdict's rules are checked on findings written here.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnzoo import kernels

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_verify.py"
_spec = importlib.util.spec_from_file_location("gpu_verify", SCRIPT)
gpu_verify = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_verify)


def _run(out: Path, *args: str, fault: str = "", timeout: int = 600):
    """The script in a fresh process that sees no GPU, under Triton's interpreter."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               **{gpu_verify.FAULT_ENV: fault})
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out),
                           "--jobs", "2", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    result = json.loads((out / "result.json").read_text())
    return proc, result


@pytest.mark.interpreter
def test_the_dry_run_exercises_every_stage_and_writes_the_whole_result(tmp_path):
    proc, result = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    stages = result["stages"]
    assert {name: stages[name]["status"] for name in gpu_verify.STAGES} == dict.fromkeys(
        gpu_verify.STAGES, "passed"), proc.stdout[-6000:]
    assert result["dry_run"] and "--dry-run" in result["command"]
    env = stages["env"]["findings"]
    assert env["arch"] == "sm_0" and env["torch"] == torch.__version__ and env["triton"]

    calls = stages["smoke"]["findings"]["calls"]
    assert {(c["family"], c["dtype"]) for c in calls} == {
        (f, d) for f in gpu_verify.FAMILIES for d in ("bfloat16", "float32")}
    assert all(c["problem"] is None and c["forward"] <= c["tolerance"] for c in calls)

    tests = stages["tests"]["findings"]
    assert len(tests["tests"]) == len(gpu_verify.DRY_TESTS)
    assert {t["outcome"] for t in tests["tests"]} == {"passed"}
    assert {t["family"] for t in tests["tests"]} == set(gpu_verify.FAMILIES)
    assert tests["check"]["returncode"] == 0 and tests["check"]["last_line"].startswith("ok:")

    models = stages["models"]["findings"]
    assert {(m["model"], m["dtype"]) for m in models["models"]} == {  # not dinat: too slow here
        (m, d) for m in gpu_verify.MODELS if m != "dinat_tiny" for d in ("bfloat16", "float32")}
    for m in models["models"]:  # bf16's error is the torch backend's own, about
        assert m["problem"] is None and m["cuda_error"] <= max(
            1.5 * m["torch_error"], gpu_verify.FLOOR[m["dtype"]]), m
        assert m["cuda_bitwise"], m  # the kernels are deterministic: no atomics
    [compiled] = models["compile"]  # nat_mini's training step (on a GPU: every family's)
    assert compiled["model"] == "nat_mini" and compiled["graphs"] == 1
    assert compiled["graph_breaks"] == 0 and compiled["error"] < 1e-4, compiled

    bench = stages["bench"]["findings"]
    assert set(bench["warm"]["items"].values()) == {0}
    assert len(bench["na"]) == 6 and bench["na_status"] == "passed"
    assert bench["host"]["status"] == "passed" and {r["call"].split()[0] for r in bench[
        "host"]["rows"]} == {"na2d_qkv", "qna2d", "san_aggregation", "san_subtraction2",
                            "F.scaled_dot_product_attention", "floor:"}
    # every mode and kind of each model (on a GPU: every family's tiny model), eager first
    assert [(r["model"], r["mode"], r["kind"]) for r in bench["models"]] == [
        (m, mode, kind) for modes in (gpu_verify.MODES[:1], gpu_verify.MODES[1:])
        for m in gpu_verify.DRY_BENCH_MODELS for mode in modes for kind in ("train", "infer")]
    assert all(r["img_s"] > 0 and r["graph_breaks"] == 0 for r in bench["models"])
    assert [(r["model"], r["cache"]) for r in bench["first_steps"]] == [
        ("san10_patchwise", "cold"), ("san10_patchwise", "warm")]
    assert all(r["first_s"] > 0 for r in bench["first_steps"])

    # the verdict, and a record per family in the records file's own format
    assert result["verdict"] == {f: dict.fromkeys(gpu_verify.DTYPES, "passed")
                                 for f in gpu_verify.FAMILIES}
    records = [kernels.Verification.from_line(line) for line in result["records"]]
    assert [r.family for r in records] == list(gpu_verify.FAMILIES)
    assert all(r.arch == "sm_0" and r.dtypes == gpu_verify.DTYPES
               and r.command == result["command"] for r in records)
    assert (tmp_path / "records.jsonl").read_text().splitlines() == result["records"]
    assert str((tmp_path / "records.jsonl").resolve()) in bench["records_files"]  # auto's
    summary = (tmp_path / "summary.md").read_text()
    assert "| neighborhood | passed | passed | passed |" in summary
    for section in ("## Host time per call", "## Models (img/s", "## First training step",
                    "## NA at NAT-tiny's"):
        assert section in summary, section
    assert "san10_patchwise" in summary.split("## Models (img/s")[1]
    assert all(line in summary for line in result["records"])
    log = (tmp_path / "log.txt").read_text()
    assert all(f"===== stage {name} =====" in log for name in gpu_verify.STAGES if
               name != "records")


def test_a_stage_that_dies_hangs_or_raises_is_reported_and_the_later_stages_run(tmp_path):
    proc, result = _run(tmp_path, "--stages", "env,tests,models,records", "--limit", "tests=4",
                        fault="tests:hang,models:abort")
    assert proc.returncode == 1
    stages = result["stages"]
    assert stages["env"]["status"] == "passed"
    assert stages["tests"]["status"] == "timed out after 4 s"
    assert stages["models"]["status"] == "died (SIGABRT)"
    assert stages["records"]["status"] == "passed" and result["records"] == []
    assert stages["smoke"]["status"] == "not run"
    for family in gpu_verify.FAMILIES:
        assert "tests: timed out after 4 s" in result["verdict"][family]["float16"]
        assert "models: died (SIGABRT)" in result["verdict"][family]["float32"]
    # a rerun of one stage keeps the others' results
    proc, result = _run(tmp_path, "--stages", "smoke,tests", fault="smoke:raise")
    stages = result["stages"]
    assert stages["env"]["status"] == "passed" and stages["models"]["status"] == \
        "died (SIGABRT)"
    assert stages["smoke"]["status"] == ("error: RuntimeError: GPU_VERIFY_FAULT asked stage "
                                         "smoke to fail")
    # a smoke stage that faults ends the run
    assert stages["tests"]["status"].startswith("not run: the smoke stage error")
    assert "Traceback" in (tmp_path / "log.txt").read_text()


def test_a_wrong_invocation_is_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    for args, message in [(["--dry-run"], "set TRITON_INTERPRET=1"),
                          (["--stages", "smoke,speed"], "--stages: unknown speed"),
                          (["--limit", "tests=soon"], "expected STAGE=SECONDS")]:
        proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("test_id,expected", [
    ("test_kernels_qna::test_qna_kernel_low_precision[fp16-1-True]", ("qna", "float16")),
    ("test_kernels_neighborhood::test_interior_tiles_match_the_reference[d1-bf16]",
     ("neighborhood", "bfloat16")),
    ("test_kernels_san::test_unsupported_calls_name_every_reason", ("san", None)),
    ("test_ops_registry::test_backend_matches_the_float64_reference[na2d-cuda-bfloat16-7x10 k(5,3)"
     " d(1,3)]", ("neighborhood", "bfloat16")),
    ("test_ops_registry::test_backend_matches_the_float64_reference[qna2d-torch-float16-x]",
     (None, "float16")),
    ("test_kernels_compile::test_a_compiled_training_step_on_the_kernels_equals_eager[dinat]",
     ("neighborhood", None)),
    ("test_kernels_compile::test_the_issue_45_qna_vit_snippet_compiles_its_backward",
     ("qna", None)),
    ("test_kernels_opcheck::test_qna_fused_backward[kv_views-bf16-stride2-bias]",
     ("qna", "bfloat16")),
    ("test_kernels_opcheck::test_san_subtraction_fused[contiguous-fp32-reflect-one_input]",
     ("san", "float32")),
    ("test_determinism::test_every_kernel_runs_deterministically[bf16-na2d]",
     ("neighborhood", "bfloat16")),
    ("test_quest_vit::test_nat_quest_on_the_cuda_backend", ("neighborhood", None)),
    ("test_kernels_host::test_direct_launches_give_what_tritons_launches_give[na2d_qkv]",
     ("neighborhood", None)),
    ("test_kernels_host::test_direct_launches_give_what_tritons_launches_give[san_aggregation]",
     ("san", None)),
])
def test_each_test_counts_for_the_family_and_dtype_it_checks(test_id, expected):
    assert gpu_verify.classify(test_id) == expected


def test_the_verdict_holds_each_finding_against_its_family_and_dtype():
    tests = {"tests": [
        dict(id="a", outcome="failed", family="qna", dtype="float16"),
        dict(id="b", outcome="skipped", family="san", dtype=None),
        dict(id="c", outcome="failed", family=None, dtype="bfloat16"),  # the reference
        dict(id="d", outcome="passed", family="neighborhood", dtype=None),
        dict(id="e", outcome="skipped", family="qna", dtype=None,  # kernel_checks.INTERPRETER_ONLY
             reason="Skipped: interpreter-only: Triton 3.6's interpreter cannot run here")],
        "check": {"failed": [dict(op="na2d", backend="cuda", dtype="float32", label="x")]}}
    problems = {(f, d): gpu_verify._problems("tests", tests, f, d)
                for f in gpu_verify.FAMILIES for d in gpu_verify.DTYPES}
    assert problems["qna", "float16"] == ["a failed"]
    assert problems["qna", "float32"] == []  # e: listed in the summary, no verdict
    assert problems["san", "float32"] == ["b skipped"]  # a skip is no pass
    assert problems["neighborhood", "bfloat16"] == ["c failed"]  # everyone's reference
    assert problems["neighborhood", "float32"] == ["attnzoo check: na2d/cuda/float32 x"]
    models = {"models": [dict(model="dinat_tiny", dtype="bfloat16", problem="cuda's error"),
                         dict(model="san10_patchwise", dtype="float32", problem=None)],
              "compile": [{"model": "nat_mini", "problem": "1 graph break(s)"},
                          {"model": "qna_vit_tiny", "problem": None},
                          {"model": "san10_pairwise", "problem": "no result (timed out)"}]}
    assert gpu_verify._problems("models", models, "neighborhood", "bfloat16") == [
        "dinat_tiny bfloat16: cuda's error", "torch.compile of nat_mini: 1 graph break(s)"]
    assert gpu_verify._problems("models", models, "qna", "float32") == []
    assert gpu_verify._problems("models", models, "san", "float32") == [
        "torch.compile of san10_pairwise: no result (timed out)"]
    assert gpu_verify._problems("tests", {}, "san", "float32") == ["no test result"]


def test_a_compile_check_that_did_not_finish_fails_its_family():
    """A compile check whose worker raised after the check began (its eager step out of
    memory, say: the finding saved then has no result) is a problem with the worker's error,
    as is one that saved nothing; a finished one is kept as it is."""
    began = {"compile": {"model": "san10_pairwise", "batch": 8,
                         "problem": gpu_verify.UNFINISHED},
             "error": "OutOfMemoryError: CUDA out of memory."}
    found = gpu_verify.compile_finding("san10_pairwise", "error", began)
    assert found["problem"] == "did not finish (error: OutOfMemoryError: CUDA out of memory.)"
    assert gpu_verify._problems("models", {"compile": [found]}, "san", "float32") == [
        f"torch.compile of san10_pairwise: {found['problem']}"]
    assert gpu_verify.compile_finding("nat_mini", "killed by SIGKILL", {}) == {
        "model": "nat_mini", "problem": "no result (killed by SIGKILL: no error message)"}
    done = {"compile": {"model": "nat_mini", "graphs": 1, "error": 1e-7, "problem": None}}
    assert gpu_verify.compile_finding("nat_mini", "passed", done) == done["compile"]


def test_a_first_step_that_raised_shows_its_error():
    text = gpu_verify.first_table([
        {"model": "nat_tiny", "cache": "cold", "error": "RuntimeError: no configuration fits"},
        {"model": "swin_tiny", "cache": "cold", "first_s": 1.5, "second_s": 0.1}])
    assert "RuntimeError: no configuration fits" in text and "1.50" in text


def test_the_models_table_marks_issue_46s_targets_against_swin_in_the_same_column():
    rows = [dict(model=gpu_verify.SWIN, mode=m, kind=k, img_s=100.0)
            for m in gpu_verify.MODES for k in ("train", "infer")]
    rows += [dict(model="nat_tiny", mode="eager", kind="train", img_s=48.0),
             dict(model="nat_tiny", mode="reduce-overhead", kind="train", img_s=125.0,
                  sync="synchronises: x", cudagraph_skips=1, cudagraph_partitions=3),
             dict(model="nat_tiny", mode="compiled", kind="infer", problem="out of time")]
    text = gpu_verify.models_table(rows)
    nat = next(line for line in text.splitlines() if line.startswith("nat_tiny"))
    assert "48 (0.48x, < 1.0x)" in nat and "125 (1.25x, met)" in nat and "out of time" in nat
    assert ("- nat_tiny train reduce-overhead: cudagraph skips 1; cudagraph partitions 3; "
            "sync synchronises: x") in text


def test_the_benchs_flex_attention_baseline_is_na_with_nats_rpb():
    """bench_ops.flex_na (the bench's FlexAttention baseline, eager here: CPU) computes the
    torch reference's NA, with the rpb through its score_mod and without, dilated too."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    spec = importlib.util.spec_from_file_location("bench_ops", ROOT / "scripts" / "bench_ops.py")
    bench_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_ops)
    from attnzoo.ops import na2d
    for shape, K, d in [((1, 9, 10, 2, 8), 3, 2), ((2, 8, 8, 1, 8), 5, 1)]:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
        rpb = torch.randn(shape[3], 2 * K - 1, 2 * K - 1, generator=g)
        flex = bench_ops.flex_na(shape, K, d, "cpu", compile_=False)
        for bias in (rpb, None):
            torch.testing.assert_close(flex(q, k, v, bias), na2d(
                q, k, v, kernel_size=K, dilation=d, rpb=bias, backend="torch"),
                atol=1e-5, rtol=1e-5)
