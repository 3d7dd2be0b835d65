#!/usr/bin/env python
"""The GPU verdict in one command: attnzoo's Triton kernels verified on the GPU this runs on, the
result recorded as data, and the kernels measured, in stages that fit a lent device's minutes.
Not a test.

    python scripts/gpu_verify.py --out DIR                  # a GPU: stages 1-5 ~6 min, 6 ~4 min
    python scripts/gpu_verify.py --out DIR --stages bench   # a rerun of some stages (merged)
    TRITON_INTERPRET=1 python scripts/gpu_verify.py --dry-run --out DIR   # CPU: tiny shapes

Stages, in order, each in a process of its own under its own time limit (``--limit``): a
compiler abort or a CUDA fault ends that process only, the stage is reported with its signal and
the later stages run; a smoke stage that faults ends the run, with its reason.

1. ``env``: versions, the GPU (name, capability, memory), CPUs, and whether the installed timm and
   pytest-xdist serve (a timm below attnzoo's floor: carry a wheel).
2. ``smoke``: NA forward and backward at nat_tiny's stage-0 shape (batch 8, K 7, rpb), one QnA and
   one SAN call (their models' first stages), in bf16 and fp32, on ``cuda`` against the torch
   reference in float64 (``attnzoo.backends.check_case``).
3. ``tests``: the kernel tests (tests/test_kernels_*.py: the kernels against the reference,
   ``torch.library.opcheck`` of every kernel op, a compiled training step of every family),
   every registered check case on every backend (tests/test_ops_registry.py), determinism,
   QUEST's NA on the kernels and direct launches against Triton's (tests/test_kernels_host.py),
   in pytest-xdist workers (Triton's cache shared between them), beside ``attnzoo check
   --device cuda``: a verdict per family and dtype, every skipped test listed.
4. ``models``: nat_tiny, dinat_tiny, qna_vit_tiny and san10_patchwise at batch 64, one process
   each: logits and parameter gradients in bf16 (autocast) and fp32 on ``cuda`` against
   ``torch`` in exact fp32 (norm-relative errors; the ``torch`` backend's own in bf16 beside),
   each backend run twice and compared bit for bit; and a ``torch.compile(fullgraph=True)``
   training step (Inductor) of nat_mini, dinat_mini, qna_vit_tiny and san10_pairwise on
   ``cuda``, one process each (graphs, graph breaks, first-step time, error against eager; a
   failure fails its kernel family's verdict). The kernels take their default configurations
   here (``ATTNZOO_AUTOTUNE=0``: the compiles fit; stage 3 forces others).
5. ``records``: the verdict per family and dtype, and for each family the line of the records
   file (attnzoo/kernels/verified.jsonl) covering the dtypes that passed stages 2 to 4.
6. ``bench``, as time allows (issue 46; its own device command, ``--stages bench``, with
   ``--limit bench=SECONDS`` for more than 240 s): first, in parallel processes for at most
   45% of its time, the compiles (each NA launch's autotune space, FlexAttention with and
   without rpb, each model's graphs under ``torch.compile`` in its default mode and in
   ``mode="reduce-overhead"``, into Triton's and Inductor's caches) and the first training
   step of nat_tiny and swin_tiny with empty caches of their own (cold; beside the compiles,
   so an upper bound). Then, one process at a time on the GPU, issue 46's targets first: img/s
   of swin_tiny, nat_tiny, dinat_tiny, qna_vit_tiny and san10_patchwise (bf16 autocast,
   training batch 32 with SGD, inference batch 64), eager for every model first, then each
   compiled and with CUDA graphs, with graph breaks, skipped CUDA-graph partitions and whether
   a training step synchronises the host (``torch.cuda.set_sync_debug_mode("error")``); host
   microseconds per call of each family at batch 1 (scripts/bench_host.py ``--device cuda``:
   with attnzoo's direct launches and through Triton's ``JITFunction.run``); the first steps
   again (warm caches); NA at NAT-tiny's and DiNAT's stage shapes (scripts/bench_ops.py part 2:
   bf16, batch 64, fwd and fwd+bwd, cuda+rpb, torch+rpb, compiled FlexAttention with and
   without rpb). Issue 46's targets are marked in the models' table. Its models run on
   ``auto``, which trusts a record only of the kernels as installed: stage 5's records where
   this run made them (its ``records.jsonl``), else those in attnzoo/kernels/verified.jsonl
   (add stage 5's lines there before a bench of its own).

DIR gets ``result.json`` (every stage: status, seconds, findings; the verdict; the records),
``summary.md`` (the same, to read) and ``log.txt`` (every stage's output), rewritten after each
stage, so a killed run leaves every finished stage; ``records.jsonl``, the lines to add, and
``na_bench.png``. ``--dry-run`` runs every stage on CPU under Triton's interpreter at tiny
shapes (benchmarks at toy sizes), with the same result.json; its records name the architecture
``sm_0``, which no GPU has. BENCHMARKS.md "GPU" gives the device call and what to do with DIR.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout's attnzoo, installed or not (a lent GPU: not)
    sys.path.insert(0, str(ROOT))
STAGES = ("env", "smoke", "tests", "models", "records", "bench")
# seconds, from an H200 machine's (16 cores) times with room: tests 139 s, models (nat_mini's
# Inductor compile beside four models) 89 s, bench 172 s; since, the tests stage runs the
# opcheck, compiled-step and determinism tests and the models stage compiles a training step of
# every family (not yet timed on a GPU: more room); stages 1-5 (535 s) within one device command
# (600 s), the bench in a second
LIMITS = {"env": 30, "smoke": 60, "tests": 220, "models": 210, "records": 15, "bench": 240}
# a dry run's limits only catch a hang (CI runs it beside another xdist worker)
DRY_LIMITS = {"env": 60, "smoke": 180, "tests": 300, "models": 300, "records": 60, "bench": 300}
FAMILIES = ("neighborhood", "qna", "san")
DTYPES = ("float32", "float16", "bfloat16")
FAMILY_OF_OP = {"na1d": "neighborhood", "na2d": "neighborhood", "qna2d": "qna",
                "san_aggregation": "san", "san_subtraction": "san", "san_subtraction2": "san"}
# stage 4's models: the kernel families each one runs
MODELS = {"nat_tiny": ("neighborhood",), "dinat_tiny": ("neighborhood",),
          "qna_vit_tiny": ("qna",), "san10_patchwise": ("san",)}
# stage 4's compiled training steps: a model of every family, and the kernel family it runs
# (san10_pairwise: both SAN kernels, the subtraction and the aggregation)
COMPILED = {"nat_mini": "neighborhood", "dinat_mini": "neighborhood", "qna_vit_tiny": "qna",
            "san10_pairwise": "san"}
# stage 4: relative error of `cuda` against `torch` in exact fp32 may be 2x the torch backend's
# own in that dtype, or this floor (fp32 and bf16 differ from exact fp32 by summation order)
FLOOR = {"float32": 1e-4, "bfloat16": 2e-2}
FAULT_ENV = "GPU_VERIFY_FAULT"  # "stage:abort|hang|raise": the script's own test of its reports
ERROR = 3  # a worker's exit status when its code raised (1: it ran and found failures)


# ---------------------------------------------------------------------------------------------
# the parent: stages in processes of their own, result.json and summary.md after each
# ---------------------------------------------------------------------------------------------

def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Exit status 0 when every stage run passed, 1 otherwise; the verdict and the "
               "records are in DIR whatever the status.")
    parser.add_argument("--out", required=True, metavar="DIR", help="where the results go")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, Triton's interpreter, tiny shapes (needs TRITON_INTERPRET=1)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated stages to run, of {', '.join(STAGES)}; a rerun "
                             "of some stages keeps DIR's results of the others")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="parallel processes (pytest-xdist workers, compiles)")
    parser.add_argument("--limit", action="append", default=[], metavar="STAGE=SECONDS",
                        help="a stage's time limit (default: " + ", ".join(
                            f"{k} {v}" for k, v in LIMITS.items()) + ")")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run (default: the sum of the limits); a "
                             "stage gets what is left of it at most")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--arg", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    return _parent(parser, args, argv if argv is not None else sys.argv[1:])


def _parent(parser, args, argv) -> int:
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"--stages: unknown {', '.join(unknown)}; accepted: {', '.join(STAGES)}")
    limits = dict(DRY_LIMITS if args.dry_run else LIMITS)
    for item in args.limit:
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            parser.error(f"--limit {item!r}: expected STAGE=SECONDS")
        if name not in STAGES or seconds <= 0:
            parser.error(f"--limit {item!r}: STAGE is one of {', '.join(STAGES)}, SECONDS > 0")
        limits[name] = seconds
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if args.dry_run != interpreted:
        parser.error("--dry-run runs the kernels under Triton's interpreter: set "
                     "TRITON_INTERPRET=1 (TRITON_INTERPRET=1 python scripts/gpu_verify.py ...)"
                     if args.dry_run else "TRITON_INTERPRET=1 is set: on a GPU, unset it (the "
                     "kernels must compile); on CPU, add --dry-run")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out}: cannot create it ({e.strerror})")
    budget = args.budget or sum(limits[s] for s in stages)
    run = Run(out, args, limits, stages, budget, argv)
    return run.go()


class Run:
    """One run: its stages, what they found, and DIR's files."""

    def __init__(self, out: Path, args, limits, stages, budget, argv):
        self.out, self.args, self.limits, self.stages = out, args, limits, stages
        self.start = time.time()
        self.deadline = self.start + budget
        self.work = Path(tempfile.mkdtemp(prefix="gpu_verify-"))
        command = "python scripts/gpu_verify.py " + " ".join(map(shlex.quote, argv))
        previous = {}
        if set(stages) != set(STAGES) and (out / "result.json").exists():
            previous = json.loads((out / "result.json").read_text()).get("stages", {})
        self.result: Dict[str, Any] = {
            "command": command.strip(), "dry_run": args.dry_run,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "stages": {s: previous.get(s, {"status": "not run", "seconds": 0, "findings": {}})
                       for s in STAGES},
            "verdict": {}, "records": []}
        with open(out / "log.txt", "a") as log:
            log.write(f"\n##### {self.result['command']}, {self.result['started']}\n")

    def go(self) -> int:
        print(f"gpu_verify: stages {', '.join(self.stages)}; results in {self.out}", flush=True)
        for i, name in enumerate(self.stages):
            left = self.deadline - time.time()
            limit = min(self.limits[name], left)
            print(f"[{i + 1}/{len(self.stages)}] {name}: limit {limit:.0f} s", flush=True)
            if limit < min(5, self.limits[name]):  # not even the imports would fit
                entry = {"status": "not run: out of time", "seconds": 0, "findings": {}}
            elif name == "records":
                entry = dict(self._records(), limit=limit)
            else:
                entry = self._stage(name, limit)
            self.result["stages"][name] = entry
            print(f"[{i + 1}/{len(self.stages)}] {name}: {entry['status']} "
                  f"({entry['seconds']:.0f} s)", flush=True)
            self._verdict()  # every stage updates it: a run cut short still has one
            self._write()
            if name == "smoke" and entry["status"].startswith(("died", "error", "timed out")):
                for later in self.stages[i + 1:]:
                    self.result["stages"][later] = {
                        "status": f"not run: the smoke stage {entry['status']}", "seconds": 0,
                        "findings": {}}
                self._write()
                break
        print((self.out / "summary.md").read_text(), flush=True)
        statuses = [self.result["stages"][s]["status"] for s in self.stages]
        return 0 if all(s == "passed" for s in statuses) else 1

    def _stage(self, name: str, limit: float) -> dict:
        """Run stage ``name`` in a process of its own (and its own session: a timeout ends its
        children too), its output into log.txt and ours; its findings from its JSON file."""
        findings_file = self.work / f"{name}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name,
               "--work", str(self.work), "--out", str(self.out), "--jobs", str(self.args.jobs),
               "--deadline", str(time.time() + limit)] + (["--dry-run"] if self.args.dry_run
                                                          else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), PYTHONUNBUFFERED="1")
        if name == "bench" and "records" in self.stages and self.result["stages"]["records"][
                "status"] == "passed":  # what this run verified: auto trusts it in the bench
            from attnzoo.kernels import RECORDS_ENV
            env[RECORDS_ENV] = os.pathsep.join(filter(None, [
                env.get(RECORDS_ENV), str((self.out / "records.jsonl").resolve())]))
        start = time.time()
        with open(self.out / "log.txt", "a") as log:
            log.write(f"\n===== stage {name} =====\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            status = _follow(proc, log, start + limit)
        if status == "timed out":
            status = f"timed out after {limit:.0f} s"
        entry = {"status": status, "seconds": round(time.time() - start, 1), "limit": limit,
                 "findings": {}}
        if findings_file.exists():
            entry["findings"] = json.loads(findings_file.read_text())  # written whole, replaced
        if status == "error" and entry["findings"].get("error"):
            entry["status"] = f"error: {entry['findings']['error']}"
        return entry

    def _records(self) -> dict:
        start = time.time()
        verdict = self._verdict()
        env = self.result["stages"]["env"]["findings"]
        if not (env.get("arch") and env.get("triton")):
            return {"status": "not run: the env stage did not name the GPU and Triton",
                    "seconds": 0, "findings": {}}
        from attnzoo.kernels import Verification, kernels_digest
        date = datetime.date.today().isoformat()
        records = []
        for family in FAMILIES:
            dtypes = tuple(d for d in DTYPES if verdict[family][d] == "passed")
            if dtypes:  # of the kernels as this checkout has them, which the stages ran
                record = Verification(family, env["arch"], dtypes, env["gpu"], date,
                                      env["torch"], env["triton"], kernels_digest(family),
                                      self.result["command"])
                records.append(Verification.from_line(record.to_line()).to_line())
        self.result["records"] = records
        (self.out / "records.jsonl").write_text("".join(line + "\n" for line in records))
        return {"status": "passed", "seconds": round(time.time() - start, 1),
                "findings": {"records": len(records)}}

    def _verdict(self) -> Dict[str, Dict[str, str]]:
        """Per family and dtype: "passed", or why not (a failure, or a stage that did not end)."""
        stages = self.result["stages"]
        verdict = {}
        for family in FAMILIES:
            verdict[family] = {}
            for dtype in DTYPES:
                problems = []
                for stage in ("smoke", "tests", "models"):
                    entry = stages[stage]
                    if dtype == "float16" and stage != "tests":
                        continue  # fp16: the kernel tests and the check cases only
                    if entry["status"] not in ("passed", "failed"):
                        problems.append(f"{stage}: {entry['status']}")
                        continue
                    problems += [f"{stage}: {p}" for p in _problems(
                        stage, entry["findings"], family, dtype)]
                verdict[family][dtype] = "; ".join(problems) or "passed"
        self.result["verdict"] = verdict
        return verdict

    def _write(self) -> None:
        self.result["seconds"] = round(time.time() - self.start, 1)
        text = json.dumps(self.result, indent=1)
        (self.out / "result.json.tmp").write_text(text)
        os.replace(self.out / "result.json.tmp", self.out / "result.json")
        (self.out / "summary.md").write_text(summary(self.result))


def _follow(proc: subprocess.Popen, log, deadline: float) -> str:
    """Copy ``proc``'s output to ``log`` and stdout until it ends or ``deadline`` passes (then
    its whole process group is killed); its status."""
    import threading

    def pump():
        for line in proc.stdout:
            log.write(line)
            log.flush()
            sys.stdout.write("  " + line)
            sys.stdout.flush()
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(deadline - time.time(), 0.1))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        reader.join(timeout=5)
        return "timed out"
    reader.join(timeout=5)
    return _status(rc)


def _status(rc: int) -> str:
    """A stage process's exit status in words (see :func:`_worker`)."""
    if rc == 0:
        return "passed"
    if rc == 1:
        return "failed"
    if rc < 0:
        return f"died ({signal.Signals(-rc).name})"
    return "error" if rc == ERROR else f"error (exit status {rc})"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def interpreter_only(test: dict) -> bool:
    """A test skipped as one of what only Triton's interpreter shows (tests/kernel_checks.py's
    INTERPRETER_ONLY: where the interpreter cannot run on the GPU host): listed, no verdict."""
    return test["outcome"] == "skipped" and "interpreter-only:" in (test.get("reason") or "")


def _problems(stage: str, findings: dict, family: str, dtype: str) -> List[str]:
    """What stage ``stage``'s findings hold against ``family``'s kernels in ``dtype``."""
    if stage == "smoke":
        return [f"{c['label']} {c['dtype']}: {c['problem']}" for c in findings.get("calls", [])
                if c["family"] == family and c["dtype"] == dtype and c.get("problem")]
    if stage == "tests":  # the family's tests, and the reference's (family None) on this GPU
        bad = [f"{t['id']} {t['outcome']}" for t in findings.get("tests", [])
               if t["family"] in (family, None) and t["dtype"] in (dtype, None)
               and t["outcome"] != "passed" and not interpreter_only(t)]
        check = findings.get("check", {})
        bad += [f"attnzoo check: {c['op']}/{c['backend']}/{c['dtype']} {c['label']}"
                for c in check.get("failed", []) if c["dtype"] == dtype and (
                    c["backend"] == "torch" or FAMILY_OF_OP.get(c["op"]) == family)]
        if check.get("error"):
            bad.append(f"attnzoo check: {check['error']}")
        if not findings.get("tests"):
            bad.append("no test result")
        return bad
    problems = [f"{m['model']} {m['dtype']}: {m['problem']}" for m in findings.get("models", [])
                if family in MODELS.get(m["model"], ()) and m["dtype"] == dtype
                and m.get("problem")]
    problems += [f"torch.compile of {c['model']}: {c['problem']}"
                 for c in findings.get("compile", []) if COMPILED.get(c["model"]) == family
                 and c.get("problem")]
    return problems


# ---------------------------------------------------------------------------------------------
# summary.md
# ---------------------------------------------------------------------------------------------

def summary(result: dict) -> str:
    stages = result["stages"]
    env = stages["env"]["findings"]
    lines = [f"# attnzoo GPU verification: {env.get('gpu', '?')} ({env.get('arch', '?')})"
             + (" (dry run)" if result["dry_run"] else ""), "",
             f"`{result['command']}`, started {result['started']}, "
             f"{result.get('seconds', 0):.0f} s; torch {env.get('torch', '?')}, Triton "
             f"{env.get('triton', '?')}, "
             f"timm {env.get('timm', '?')}, {env.get('cpus', '?')} CPUs", ""]
    lines += [f"- {w}" for w in env.get("warnings", [])]
    lines += ["", "| stage | status | seconds | limit | found |", "|---|---|---|---|---|"]
    for name in STAGES:
        e = stages[name]
        lines.append(f"| {name} | {e['status']} | {e['seconds']:.0f} | {e.get('limit', 0):.0f} | "
                     f"{_brief(name, e['findings'])} |")
    lines += ["", "## Verdict (per family and dtype)", "", "| family | " + " | ".join(DTYPES)
              + " |", "|---|" + "---|" * len(DTYPES)]
    for family, row in result.get("verdict", {}).items():
        lines.append(f"| {family} | " + " | ".join(_cell(row[d]) for d in DTYPES) + " |")
    lines += ["", "## Records to add to attnzoo/kernels/verified.jsonl", ""]
    lines += (["```"] + result["records"] + ["```"]) if result["records"] else [
        "none" + ("" if stages["records"]["status"] == "passed" else " (stage 5 did not run)")]
    lines += _details(stages)
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return "passed" if text == "passed" else "**no**: " + text.replace("|", "/")[:400]


def _brief(name: str, findings: dict) -> str:
    if findings.get("error"):
        return findings["error"].replace("|", "/")[:200]
    if name == "env":
        return f"{findings.get('gpu', '')}, {findings.get('memory_free_gib', '?')} GiB free"
    if name == "smoke":
        calls = findings.get("calls", [])
        return f"{sum(not c.get('problem') for c in calls)}/{len(calls)} calls within tolerance"
    if name == "tests":
        counts: Dict[str, int] = {}
        for t in findings.get("tests", []):
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        check = findings.get("check", {}).get("last_line", "")
        return (", ".join(f"{n} {o}" for o, n in sorted(counts.items())) + f" in "
                f"{findings.get('workers', 1)} workers; {findings.get('compiles', '?')} Triton "
                f"compiles; attnzoo check: {check}").replace("|", "/")
    if name == "models":
        models = findings.get("models", [])
        return f"{sum(not m.get('problem') for m in models)}/{len(models)} model runs agree"
    if name == "records":
        return f"{findings.get('records', 0)} record(s)"
    if name == "bench":
        models = findings.get("models", [])
        return (f"{len(findings.get('host', {}).get('rows', []))} host rows, "
                f"{sum(bool(r.get('img_s')) for r in models)}/{len(models)} model rows, "
                f"{len(findings.get('first_steps', []))} first steps, "
                f"{len(findings.get('na', []))} NA rows")
    return ""


def _details(stages: dict) -> List[str]:
    lines = []
    calls = stages["smoke"]["findings"].get("calls", [])
    if calls:
        lines += ["", "## Smoke", "", "| call | dtype | forward | backward | tolerance | s | "
                  "result |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {c['label']} | {c['dtype']} | {_e(c.get('forward'))} | "
                  f"{_e(c.get('backward'))} | {c['tolerance']:.0e} | {c['seconds']:.1f} | "
                  f"{c.get('problem') or 'ok'} |" for c in calls]
    tests = stages["tests"]["findings"]
    odd = [t for t in tests.get("tests", []) if t["outcome"] != "passed"]
    if odd:
        lines += ["", "## Tests not passed", ""]
        lines += [f"- `{t['id']}`: {t['outcome']}" + (f": {t['reason']}" if t.get("reason")
                                                      else "") for t in odd]
    models = stages["models"]["findings"]
    if models.get("models"):
        lines += ["", "## Models: cuda against torch in exact fp32 (norm-relative error of "
                      "logits and every parameter gradient, the worst)", "",
                  "| model | dtype | batch | cuda | torch | cuda, 2 runs | torch, 2 runs | "
                  "result |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {m['model']} | {m['dtype']} | {m.get('batch', '')} | "
                  f"{_e(m.get('cuda_error'))} | {_e(m.get('torch_error'))} | "
                  f"{_same(m.get('cuda_bitwise'))} | {_same(m.get('torch_bitwise'))} | "
                  f"{m.get('problem') or 'ok'} |" for m in models["models"]]
    if models.get("compile"):
        lines += ["", "## A compiled training step on cuda (torch.compile(fullgraph=True), "
                      "logits and every parameter gradient against eager on cuda)", "",
                  "| model | batch | graphs | breaks | first step, s | error | result |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {c['model']} | {c.get('batch', '')} | {c.get('graphs', '?')} | "
                  f"{c.get('graph_breaks', '?')} | {c.get('compile_seconds', '-')} | "
                  f"{_e(c.get('error'))} | {(c.get('problem') or 'ok').replace('|', '/')} |"
                  for c in models["compile"]]
    bench = stages["bench"]["findings"]
    if bench.get("host", {}).get("table"):
        lines += ["", "## Host time per call", "", bench["host"]["table"]]
    if bench.get("models_table"):
        lines += ["", "## Models (img/s; bf16 autocast, training batch 32 with SGD, inference "
                      "batch 64; x: over swin_tiny's in the same column)", "",
                  bench["models_table"]]
    if bench.get("first_table"):
        lines += ["", "## First training step (eager, batch 32), caches cold then warm", "",
                  bench["first_table"]]
    if bench.get("na_table"):
        lines += ["", "## NA at NAT-tiny's and DiNAT's stage shapes", "", bench["na_table"]]
    return lines


def _e(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def _same(x) -> str:
    return "-" if x is None else "equal" if x else "differ"


# ---------------------------------------------------------------------------------------------
# the workers: one stage each (``--worker NAME``), findings into WORK/NAME.json
# ---------------------------------------------------------------------------------------------

class Stage:
    """What a worker knows: the device, the dry run, its deadline; ``save`` writes findings."""

    def __init__(self, args):
        self.name, self.work, self.dry = args.worker, Path(args.work), args.dry_run
        self.out, self.jobs, self.deadline, self.arg = Path(args.out), args.jobs, \
            args.deadline, args.arg
        self.device = "cpu" if self.dry else "cuda"
        self.findings: Dict[str, Any] = {}

    def left(self) -> float:
        return (self.deadline or math.inf) - time.time()

    def save(self) -> None:
        path = self.work / f"{self.arg or self.name}.json"
        path.with_suffix(".tmp").write_text(json.dumps(self.findings, indent=1))
        os.replace(path.with_suffix(".tmp"), path)


def _worker(args) -> int:
    """Run one stage's (or one part's) code; exit status 0 passed, 1 found failures, ERROR its
    code raised (the traceback printed, its first line saved as the finding ``error``)."""
    import traceback
    stage = Stage(args)
    try:
        _inject_fault(stage.arg or stage.name)
        if stage.device == "cuda" and not _cuda_available():
            raise RuntimeError("no CUDA device here (--dry-run runs on CPU)")
        WORKERS[args.worker](stage)
    except Exception as e:  # noqa: BLE001 - any error of a stage is its finding
        traceback.print_exc()
        stage.findings["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        stage.save()
        return ERROR
    stage.save()
    return 1 if stage.findings.get("failed") else 0


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def _inject_fault(name: str) -> None:
    for item in os.environ.get(FAULT_ENV, "").split(","):
        stage, _, fault = item.partition(":")
        if stage == name:
            if fault == "abort":
                os.abort()
            if fault == "hang":
                time.sleep(3600)
            raise RuntimeError(f"{FAULT_ENV} asked stage {name} to fail")


def _versions() -> Dict[str, Optional[str]]:
    import importlib.metadata as md
    found = {}
    for name in ("torch", "triton", "timm", "pytest", "pytest-xdist", "natten", "numpy"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    return found


def stage_env(stage: Stage) -> None:
    import platform

    import torch
    from packaging.version import Version

    import attnzoo
    from attnzoo import kernels
    v = _versions()
    f = stage.findings
    f.update(python=platform.python_version(), torch=torch.__version__,
             triton=v["triton"], timm=v["timm"], pytest=v["pytest"], xdist=v["pytest-xdist"],
             natten=v["natten"], attnzoo=attnzoo.__version__, cpus=os.cpu_count(),
             cuda=torch.version.cuda, git=_git_commit(), warnings=[])
    if stage.dry:
        f.update(gpu="none (dry run: Triton's interpreter on CPU)", arch="sm_0", capability=None)
    else:
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        f.update(gpu=props.name, capability=[props.major, props.minor],
                 arch=f"sm_{props.major}{props.minor}", sms=props.multi_processor_count,
                 memory_total_gib=round(total / 2 ** 30, 1),
                 memory_free_gib=round(free / 2 ** 30, 1),
                 shared_memory_per_block_kib=getattr(props, "shared_memory_per_block_optin",
                                                     0) // 1024)
    missing = kernels.triton_missing()
    if missing:
        f["warnings"].append(missing)
        f["failed"] = True
    if v["timm"] and Version(v["timm"]) < Version(attnzoo.TIMM_FLOOR):
        f["warnings"].append(f"timm {v['timm']} is below attnzoo's floor {attnzoo.TIMM_FLOOR}: "
                             "carry a timm wheel (BENCHMARKS.md, GPU)")
    if not v["pytest-xdist"]:
        f["warnings"].append("pytest-xdist is not installed: stage 3 runs in one process")
    for key in ("python", "torch", "triton", "timm", "gpu", "arch", "memory_free_gib", "cpus"):
        print(f"{key}: {f.get(key)}", flush=True)


def _git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# --- stage 2 ---------------------------------------------------------------------------------

def smoke_cases(device: str, dtype, dry: bool):
    """(family, label, Case): nat_tiny's stage-0 NA at batch 8 and one QnA and one SAN call at
    their models' first stages (tiny in a dry run), for attnzoo.backends.check_case."""
    from attnzoo import backends
    from attnzoo.ops import na2d, qna2d, san_aggregation
    B, S = (1, 9) if dry else (8, 56)
    heads, d, K = (2, 8, 3) if dry else (2, 32, 7)
    na = ([(B, S, S, heads, d)] * 3 + [(heads, 2 * K - 1, 2 * K - 1)])
    L, qh, qd = 2, (2 if dry else 8), 8   # qna_vit_tiny stage 0: 2 learned queries, 8 heads
    qna = [(B, S, S, L, qh), (B, S, S, qh, qd), (L, qh, 3, 3), (L, qh, 3, 3)]
    C, Cw, Ss = (4, 2, 8) if dry else (16, 2, 112)  # san10 stage 0: 16 channels, Cw 2
    san = [(B, C, Ss, Ss), (B, Cw, 9, Ss * Ss)]
    return [
        ("neighborhood", f"na2d {'x'.join(map(str, na[0]))} k{K} rpb",
         backends.Case("na", backends.case_inputs(na, device, dtype), lambda q, k, v, rpb, *,
                       backend: na2d(q, k, v, kernel_size=K, rpb=rpb, backend=backend))),
        ("qna", f"qna2d {'x'.join(map(str, qna[0]))} k3",
         backends.Case("qna", backends.case_inputs(qna, device, dtype), lambda lg, v, rpb, ws, *,
                       backend: qna2d(lg, v, kernel_size=3, rpb=rpb, window_weights=ws,
                                      backend=backend))),
        ("san", f"san_aggregation {'x'.join(map(str, san[0]))} k3",
         backends.Case("san", backends.case_inputs(san, device, dtype), lambda x, w, *,
                       backend: san_aggregation(x, w, kernel_size=3, backend=backend))),
    ]


def stage_smoke(stage: Stage) -> None:
    import torch

    from attnzoo import backends
    calls = stage.findings["calls"] = []
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype)[6:]
        for family, label, case in smoke_cases(stage.device, dtype, stage.dry):
            start = time.time()
            result = backends.check_case(case, "cuda")  # an exception: the stage's error
            if stage.device == "cuda":
                torch.cuda.synchronize()
            tolerance = backends.TOLERANCE[dtype]
            worst = max(result.forward, result.backward)
            calls.append(dict(family=family, label=label, dtype=name, forward=result.forward,
                              backward=result.backward, tolerance=tolerance,
                              seconds=round(time.time() - start, 2),
                              problem=None if worst <= tolerance else
                              f"error {worst:.1e} > {tolerance:.0e}"))
            print(f"{label} {name}: forward {result.forward:.1e}, backward "
                  f"{result.backward:.1e} ({calls[-1]['problem'] or 'ok'})", flush=True)
            stage.save()
    stage.findings["failed"] = any(c["problem"] for c in calls)


# --- stage 3 ---------------------------------------------------------------------------------

# tests run on a GPU: the kernels' (against the reference, opcheck, compiled training steps),
# the registry's cases on every backend (the torch reference on CUDA too: what the kernels are
# checked against), determinism, and QUEST's NA on the kernels
TESTS = ["tests/test_kernels_neighborhood.py", "tests/test_kernels_qna.py",
         "tests/test_kernels_san.py", "tests/test_kernels_opcheck.py",
         "tests/test_kernels_compile.py", "tests/test_ops_registry.py",
         "tests/test_determinism.py", "tests/test_quest_vit.py::test_nat_quest_on_the_cuda_backend",
         "tests/test_kernels_host.py::test_direct_launches_give_what_tritons_launches_give"]
# the dry run: one of each kind, small
DRY_TESTS = ["tests/test_kernels_neighborhood.py::test_inference_under_no_grad",
             "tests/test_kernels_neighborhood.py::test_kernel_low_precision[1d-bf16]",
             "tests/test_kernels_qna.py::test_defaults_without_rpb_or_window_weights",
             "tests/test_kernels_san.py::test_interleaved_weight_sharing",
             "tests/test_ops_registry.py::test_backend_matches_the_float64_reference"
             "[na1d-cuda-float32-12 k3 d4=map rpb]"]


def stage_tests(stage: Stage) -> None:
    """pytest (xdist workers where installed) and ``attnzoo check`` side by side."""
    f = stage.findings
    xml = stage.work / "tests.xml"
    # the check process beside them; a dry run takes 2 workers, to prove the parallel path
    workers = (2 if stage.dry else max(1, stage.jobs - 1)) if _versions()["pytest-xdist"] else 1
    selection = DRY_TESTS if stage.dry else TESTS
    # on a GPU the `slow` tier too: slow only under the interpreter
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                  f"--junitxml={xml}", "-o", "junit_logging=no", *selection] + (
                      [] if stage.dry else ["-m", "slow or not slow"])
    if workers > 1:
        pytest_cmd += ["-n", str(workers)]
    check_cmd = [sys.executable, "-m", "attnzoo", "check", "--device", stage.device]
    check_cmd += ["--backend", "cuda", "--op", "na1d"] if stage.dry else [
        "--backend", "cuda", "torch"]
    f.update(workers=workers, pytest=" ".join(pytest_cmd[1:]), check=" ".join(check_cmd[1:]))
    before = _triton_compiles()
    print(f"pytest in {workers} process(es) beside `attnzoo check`", flush=True)
    check_log = open(stage.work / "check.txt", "w")
    # its tuning is timed beside the tests' kernels: not written to the autotune cache that a
    # later bench reads (pytest's conftest keeps the tests' choices out of it too)
    check = subprocess.Popen(check_cmd, cwd=ROOT, stdout=check_log, stderr=subprocess.STDOUT,
                             text=True, env=dict(os.environ, ATTNZOO_AUTOTUNE_CACHE="0"))
    tests = subprocess.Popen(pytest_cmd, cwd=ROOT)
    _wait(tests, stage.left() - 5)
    _wait(check, stage.left() - 3)
    check_log.close()
    check_out = (stage.work / "check.txt").read_text()
    print(check_out[-3000:], flush=True)
    last = check_out.strip().splitlines()[-1] if check_out.strip() else "no output"
    failed = [dict(op=op, backend=backend, dtype=_DTYPE_TOKENS[dtype], label=label)
              for op, backend, dtype, label in re.findall(r"(\w+)/(\w+)/(\w+) '([^']*)'", last)]
    f["check"] = {"returncode": check.returncode, "last_line": last[:300], "failed": failed}
    if check.returncode != 0 and not failed:
        f["check"]["error"] = f"exit status {check.returncode}: {last[:200]}"
    f["tests"] = _junit(xml) if xml.exists() else []
    f["compiles"] = _triton_compiles() - before
    if tests.returncode not in (0, 1):
        f["pytest_status"] = f"exit status {tests.returncode}"
    f["failed"] = (tests.returncode != 0 or check.returncode != 0
                   or any(t["outcome"] != "passed" and not interpreter_only(t)
                          for t in f["tests"]))


def _wait(proc: subprocess.Popen, seconds: float) -> None:
    try:
        proc.wait(timeout=max(seconds, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _junit(path: Path) -> List[dict]:
    """Every test of a JUnit XML report: its id, outcome (passed, failed, error, skipped),
    the skip's or failure's first line, and the family and dtype it checks."""
    found = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        test_id = f"{module}::{case.get('name')}"
        outcome, reason = "passed", None
        for kind in ("failure", "error", "skipped"):
            node = case.find(kind)
            if node is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                reason = (node.get("message") or "").splitlines()[0][:300] if node.get(
                    "message") else None
                break
        family, dtype = classify(test_id)
        found.append(dict(id=test_id, outcome=outcome, reason=reason, family=family,
                          dtype=dtype))
    return found


_DTYPE_TOKENS = {"fp32": "float32", "float32": "float32", "fp16": "float16",
                 "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16",
                 "float64": "float64"}


def classify(test_id: str):
    """(kernel family or None, dtype or None: every dtype) a test id checks."""
    module, _, name = test_id.partition("::")
    params = name.partition("[")[2].rstrip("]")
    tokens = re.split(r"[-\[\]]", params)
    dtype = next((_DTYPE_TOKENS[t] for t in tokens if t in _DTYPE_TOKENS), None)
    if module == "test_ops_registry":
        op, backend = (tokens + ["", ""])[:2]
        return (FAMILY_OF_OP.get(op) if backend == "cuda" else None), dtype
    if module == "test_kernels_compile":  # per model family, or a QnA test by its name
        return (_COMPILED_FAMILY.get(params.split("_")[0]) if params else
                "qna" if "qna" in name else None), dtype
    if module == "test_kernels_opcheck":  # test_<op>: the op's family
        return next((f for prefix, f in (("test_na_", "neighborhood"), ("test_qna_", "qna"),
                                         ("test_san_", "san")) if name.startswith(prefix)),
                    None), dtype
    if module == "test_kernels_host":  # [op]
        return FAMILY_OF_OP.get(params.replace("_qkv", "")), dtype
    if module == "test_determinism":  # [dtype-op]: the op's family; the others: every family's
        return next((FAMILY_OF_OP[t] for t in tokens if t in FAMILY_OF_OP), None), dtype
    family = {"test_kernels_neighborhood": "neighborhood", "test_kernels_qna": "qna",
              "test_kernels_san": "san", "test_quest_vit": "neighborhood"}.get(module)
    return family, dtype


_COMPILED_FAMILY = {"nat": "neighborhood", "dinat": "neighborhood", "qna": "qna", "san": "san"}


def _triton_compiles() -> int:
    """Kernels compiled into Triton's cache so far (one cubin each; none when interpreted)."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for _ in root.rglob("*.cubin")) if root.exists() else 0


# --- stage 4 ---------------------------------------------------------------------------------

def stage_models(stage: Stage) -> None:
    """One process per model and per compiled training step, in parallel: their compiles
    overlap."""
    # a dry run leaves out DiNAT (its dilation groups multiply the interpreter's launches) and
    # compiles nat_mini only (tests/test_kernels_compile.py compiles every family there)
    names = [m for m in MODELS if not (stage.dry and m.startswith("dinat"))]
    names += [f"compile:{m}" for m in (["nat_mini"] if stage.dry else COMPILED)]
    env = dict(os.environ, ATTNZOO_AUTOTUNE="0")
    procs = {}
    for name in names:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "model",
               "--arg", name, "--work", str(stage.work), "--out", str(stage.out),
               "--deadline", str(stage.deadline)] + (["--dry-run"] if stage.dry else [])
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env)
    models, compiled, statuses = [], [], {}
    for name, proc in procs.items():
        _wait(proc, stage.left() - 2)
        rc = proc.returncode
        statuses[name] = _status(rc)
        path = stage.work / f"{name}.json"
        part = json.loads(path.read_text()) if path.exists() else {}
        if name.startswith("compile:"):
            compiled.append(compile_finding(name.partition(":")[2], statuses[name], part))
        else:
            runs = part.get("models", [])
            done = {r["dtype"] for r in runs}
            runs += [{"model": name, "dtype": d, "problem": f"{statuses[name]}: "
                      f"{part.get('error', 'no result')}"} for d in FLOOR if d not in done]
            models += runs
    stage.findings.update(models=models, compile=compiled, processes=statuses)
    stage.findings["failed"] = any(m.get("problem") for m in models + compiled)


def compile_finding(model: str, status: str, part: dict) -> dict:
    """The compile check's finding from what its worker saved (``part``) and how the worker
    ended (``status``): one that did not finish (its worker raised, crashed or was stopped
    after it began) is a problem, with the worker's error."""
    found = dict(part.get("compile") or {"model": model, "problem": "no result"})
    if found.get("problem") in ("no result", UNFINISHED):
        found["problem"] += f" ({status}: {part.get('error', 'no error message')})"
    return found


def _relative(a, b) -> float:
    """Norm-relative error of ``a`` against ``b`` (float64)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _model_run(model, x, backend: str, autocast_dtype):
    """Logits and every parameter gradient (one flat vector) of a training step on
    ``backend``, as computed (for bit-for-bit comparison)."""
    import torch

    import attnzoo
    params = [p for p in model.parameters() if p.requires_grad]
    with attnzoo.use_backend(backend), torch.autocast(
            x.device.type, dtype=autocast_dtype or torch.float32,
            enabled=autocast_dtype is not None):
        out = model(x)
    grads = torch.autograd.grad(out.float().square().mean(), params)
    return out.detach().float(), torch.cat([g.reshape(-1) for g in grads]).float()


def tiny_kwargs(name: str) -> dict:
    """A dry run's cut-down config of a model (Triton's interpreter takes a second or more per
    launch): one or two stages, narrow, for 32 px inputs."""
    if name.startswith("swin"):  # the bench stage's timm baseline
        return dict(img_size=32, embed_dim=16, depths=(1, 1), num_heads=(1, 2), window_size=4)
    if name.startswith(("nat", "dinat")):
        return dict(depths=(1,), embed_dim=16, num_heads=(1,), mlp_ratio=1.,
                    dilations=((2,),) if name.startswith("dinat") else None)
    if name.startswith("qna"):
        return dict(embed_dim=16, qna_depths=(1, 0), lsa_depths=(0, 1), qna_heads=(2, 4),
                    lsa_heads=(1, 2), kernel_size=(3, 3), window_sizes=(7, 7))
    return dict(depths=(1, 1), widths=(16, 16), kernel_sizes=(3, 3), stem_width=8,
                share_planes=2, padding_mode="zeros")


def worker_model(stage: Stage) -> None:
    """Stage 4 for one model (``--arg NAME``), or a compiled training step of one
    (``--arg compile:NAME``)."""
    import timm
    import torch

    import attnzoo  # noqa: F401  (registers the models)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    name = stage.arg
    if name.startswith("compile:"):
        return _compile_check(stage, name.partition(":")[2])
    batch, size = (1, 32) if stage.dry else (64, 224)
    kwargs = dict(drop_path_rate=0.0, **(tiny_kwargs(name) if stage.dry else {}))
    torch.manual_seed(0)  # the same weights every run: bf16's errors depend on them
    model = timm.create_model(name, **kwargs).to(stage.device).train()
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)).to(
        stage.device)
    while True:  # four models share the GPU: one that runs out of memory halves its batch
        stage.findings["models"] = []
        try:
            _compare_backends(stage, model, x[:batch], name)
            break
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            batch //= 2
            torch.cuda.empty_cache()
            print(f"{name}: out of GPU memory, again at batch {batch}", flush=True)
    stage.findings["failed"] = any(r["problem"] for r in stage.findings["models"])


def _compare_backends(stage: Stage, model, x, name: str) -> None:
    import torch

    from attnzoo import backends
    runs = stage.findings["models"]
    with backends.exact_fp32():
        reference = _model_run(model, x, "torch", None)
        for dtype, autocast in (("bfloat16", torch.bfloat16), ("float32", None)):
            start = time.time()
            got = {b: [_model_run(model, x, b, autocast) for _ in range(2)]
                   for b in ("cuda", "torch")}
            errors = {b: max(_relative(r[0][0], reference[0]), _relative(r[0][1], reference[1]))
                      for b, r in got.items()}
            bitwise = {b: all(torch.equal(p, q) for p, q in zip(*r)) for b, r in got.items()}
            bound = max(2 * errors["torch"], FLOOR[dtype])
            problem = None
            if not errors["cuda"] <= bound:
                problem = f"cuda's error {errors['cuda']:.1e} > {bound:.1e}"
            elif not bitwise["cuda"] and bitwise["torch"]:
                problem = "two cuda runs differ (two torch runs do not)"
            runs.append(dict(model=name, dtype=dtype, batch=len(x), cuda_error=errors["cuda"],
                             torch_error=errors["torch"], cuda_bitwise=bitwise["cuda"],
                             torch_bitwise=bitwise["torch"], problem=problem,
                             seconds=round(time.time() - start, 1)))
            print(f"{name} {dtype}: cuda {errors['cuda']:.1e}, torch {errors['torch']:.1e}; "
                  f"bitwise cuda {bitwise['cuda']}, torch {bitwise['torch']}: "
                  f"{problem or 'ok'}", flush=True)
            stage.save()


UNFINISHED = "did not finish"


def _compile_check(stage: Stage, name: str) -> None:
    """torch.compile(fullgraph=True) of a training step of model ``name`` on the cuda backend
    (Inductor; a dry run: AOT autograd with Inductor's decompositions, no code generation, every
    custom op's output checked against its fake): its graphs, first-step time, and logits and
    gradients against eager; where it fails, the graph breaks Dynamo's explain finds."""
    import timm
    import torch
    import torch._dynamo

    import attnzoo
    from attnzoo import backends
    batch, size = (1, 32) if stage.dry else (8, 224)
    kwargs = dict(drop_path_rate=0.0, **(tiny_kwargs(name) if stage.dry else {}))
    model = timm.create_model(name, **kwargs).to(stage.device).train()
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)).to(
        stage.device)
    # a problem until it ends (a raise below leaves it so: stage_models adds the error)
    f = stage.findings["compile"] = {"model": name, "batch": batch, "problem": UNFINISHED}
    graphs = []

    def counting(gm, example_inputs):  # Dynamo's graphs, then the real compiler
        graphs.append(gm)
        if stage.dry:
            return torch._dynamo.lookup_backend("aot_eager_decomp_partition_crossref")(
                gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    with attnzoo.use_backend("cuda"), backends.exact_fp32():
        eager = _model_run(model, x, "cuda", None)
        start = time.time()
        try:
            got = _model_run(torch.compile(model, fullgraph=True, backend=counting), x, "cuda",
                             None)
        except Exception as e:  # noqa: BLE001 - a graph break (fullgraph) or a compile error
            torch._dynamo.reset()
            explanation = torch._dynamo.explain(model)(x)
            breaks = "; ".join(str(r.reason)[:200] for r in explanation.break_reasons[:5])
            f.update(graphs=explanation.graph_count, graph_breaks=explanation.graph_break_count,
                     problem=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}; breaks: "
                             f"{breaks}")
            stage.findings["failed"] = True
            print(f"torch.compile({name}, fullgraph=True) training step on cuda: "
                  f"{f['problem']}", flush=True)
            return
        f["compile_seconds"] = round(time.time() - start, 1)
    f.update(graphs=len(graphs), graph_breaks=0,
             error=max(_relative(got[0], eager[0]), _relative(got[1], eager[1])))
    f["problem"] = None if f["error"] <= FLOOR["float32"] else (
        f"error against eager {f['error']:.1e} > {FLOOR['float32']:.0e}")
    print(f"torch.compile({name}, fullgraph=True) training step on cuda: {f['graphs']} "
          f"graph(s), {f['compile_seconds']} s, error against eager {f['error']:.1e}",
          flush=True)
    stage.findings["failed"] = bool(f["problem"])


# --- stage 6 ---------------------------------------------------------------------------------

SWIN = "swin_tiny_patch4_window7_224"
BENCH_MODELS = (SWIN, "nat_tiny", "dinat_tiny", "qna_vit_tiny", "san10_patchwise")
DRY_BENCH_MODELS = (SWIN, "san10_patchwise")  # the interpreter is slow
MODES = ("eager", "compiled", "reduce-overhead")  # torch.compile's default mode, CUDA graphs
# issue 46's targets: img/s over swin_tiny's in the same run, eager and compiled (and with CUDA
# graphs, nat_tiny's own), training and inference
TARGETS = {"nat_tiny": 1.0, "dinat_tiny": 0.9, "qna_vit_tiny": 1.0, "san10_patchwise": 1.0}
RO_TARGETS = {"nat_tiny": 1.2}
FIRST_STEP = ("nat_tiny", SWIN)  # first training step, cold caches then warm
WARM_SHARE = 0.45  # of the bench stage's time, at most, for the parallel compiles
WARM_JOBS = 6  # processes at a time: each holds a model's training step in GPU memory


def stage_bench(stage: Stage) -> None:
    """Compile in parallel first (Triton's and Inductor's caches: the kernels' configurations,
    FlexAttention, each model's compiled graphs; and the cold first steps), then time, one
    process at a time on the GPU, issue 46's targets first where time runs short: each
    model's img/s in every mode, host time per call, the warm first steps, bench_ops.py
    part 2."""
    from attnzoo.kernels import record_files
    f = stage.findings
    # the records files auto reads here besides the package's (Run._stage: stage 5's)
    f["records_files"] = [str(p) for p in record_files()[1:]]
    start = time.time()
    models = DRY_BENCH_MODELS if stage.dry else BENCH_MODELS
    items = ([f"first:{m}" for m in FIRST_STEP]  # the longest first
             + [f"compile:{m}:{mode}" for m in models for mode in MODES[1:]]
             + [f"na:{i}" for i in range(6)] + [f"model:{m}" for m in models[1:]])
    if stage.dry:
        items = ["first:san10_patchwise", "na:0", "model:san10_patchwise"]
    until = start + WARM_SHARE * stage.left()  # the timings get the rest
    jobs = max(1, min(stage.jobs, WARM_JOBS))
    running, statuses = [], {}
    for item in items:
        while len(running) >= jobs:
            _reap(running, statuses, until)
        if time.time() < until:
            running.append((item, _warm_process(stage, item)))
        else:
            statuses[item] = "not started: out of time"
    while running:
        _reap(running, statuses, until)
    f["warm"] = {"seconds": round(time.time() - start, 1), "items": statuses}
    print(f"compiled in parallel: {time.time() - start:.0f} s", flush=True)
    f["first_steps"] = [dict(_findings(stage, item), cache="cold") for item in items
                        if item.startswith("first:")]
    stage.save()

    f["models"] = []  # every model eager first, then each one compiled
    for name, modes in [(m, MODES[:1]) for m in models] + [(m, MODES[1:]) for m in models]:
        f["models"] += _bench_model(stage, name, modes)
        stage.save()
    f["host"] = _bench_host(stage)
    stage.save()
    for item in [i for i in items if i.startswith("first:")]:
        if stage.left() > 60:
            (stage.work / f"{item}.json").unlink(missing_ok=True)  # the cold run's
            _wait(_warm_process(stage, item), stage.left() - 30)
            f["first_steps"].append(dict(_findings(stage, item), cache="warm"))
    stage.save()
    _bench_na(stage)
    f["models_table"] = models_table(f["models"])
    f["first_table"] = first_table(f["first_steps"])
    print(f["models_table"], f["first_table"], sep="\n\n", flush=True)
    f["failed"] = f["na_status"] != "passed" or f["host"].get("status") != "passed" or any(
        r.get("problem") for r in f["models"])


def _warm_process(stage: Stage, item: str) -> subprocess.Popen:
    """A process of worker ``warm`` for ``item``; a first step's gets caches of its own
    (Triton's, the autotuner's, Inductor's), empty on its first run (cold), kept for its second
    (warm)."""
    env = dict(os.environ)
    if item.startswith("first:"):
        caches = stage.work / item.replace(":", "-")
        env.update(TRITON_CACHE_DIR=str(caches / "triton"), TORCHINDUCTOR_CACHE_DIR=str(
            caches / "inductor"), ATTNZOO_AUTOTUNE_CACHE=str(caches / "autotune.json"))
    elif item.startswith("compile:"):
        # compiles only: no kernel timed beside others' compiles. Its graphs hold the untuned
        # choices: Inductor's cache keys by the launches' constants, so the bench's compile
        # after tuning reuses the graphs only where they agree; the autograd cache keys by the
        # kernels' source alone, and would hand the bench the untuned graphs: not written
        env.update(ATTNZOO_AUTOTUNE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "warm", "--arg", item,
           "--work", str(stage.work), "--out", str(stage.out),
           "--deadline", str(stage.deadline)] + (["--dry-run"] if stage.dry else [])
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def _findings(stage: Stage, item: str) -> dict:
    """What worker ``item`` saved; a first step's names its model even without a result."""
    path = stage.work / f"{item}.json"
    found = json.loads(path.read_text()) if path.exists() else {"problem": "no result"}
    if item.startswith("first:"):
        found.setdefault("model", item.partition(":")[2])
    return found


def _reap(running, statuses, until: float) -> None:
    """Wait for any of ``running`` (item, process) to end, and take it out; at ``until``, end
    them all."""
    while time.time() < until:
        for i, (item, proc) in enumerate(running):
            if proc.poll() is not None:
                del running[i]
                statuses[item] = proc.returncode
                return
        time.sleep(0.2)
    for item, proc in running:
        _wait(proc, 0)
        statuses[item] = f"ended at the compile phase's limit ({_status(proc.returncode)})"
    running.clear()


def _bench_host(stage: Stage) -> dict:
    """scripts/bench_host.py: each family's call at batch 1, whole, on the GPU (host-bound),
    with attnzoo's direct launches and through Triton's JITFunction.run; a dry run: its CPU
    table, launches captured, few calls."""
    out = stage.work / "host.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_host.py"), "--json", str(out)] + (
        ["--number", "4", "--repeat", "1", "--no-simulated-gpu"] if stage.dry else
        ["--device", "cuda", "--number", "40", "--repeat", "3"])
    result = dict(command=" ".join(["python", "scripts/bench_host.py"] + cmd[2:]))
    try:
        proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True,
                              timeout=max(min(stage.left() - 30, 90), 5))
        print(proc.stdout[-4000:], proc.stderr[-2000:], flush=True)
        result["status"] = _status(proc.returncode)
        at = proc.stdout.find("Host microseconds")
        result["table"] = proc.stdout[at:].strip() if at >= 0 else ""
    except subprocess.TimeoutExpired:
        result["status"] = "timed out"
    result["rows"] = json.loads(out.read_text())["calls"] if out.exists() else []
    return result


def _bench_model(stage: Stage, name: str, modes) -> List[dict]:
    """One process of worker ``bench_model`` for model ``name`` in ``modes``."""
    item = f"bench:{name}:{','.join(modes)}"
    proc = None
    if stage.left() > 45:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "bench_model",
               "--arg", item, "--work", str(stage.work), "--out", str(stage.out),
               "--deadline", str(time.time() + min(stage.left() - 30, 150))] + (
            ["--dry-run"] if stage.dry else [])
        proc = subprocess.Popen(cmd, cwd=ROOT)
        _wait(proc, min(stage.left() - 20, 170))
    found = _findings(stage, item) if proc else {"problem": "out of time"}
    saved = {(r["mode"], r["kind"]): r for r in found.get("rows", [])}
    rows = [saved.get((m, k), dict(model=name, mode=m, kind=k)) for m in modes
            for k in ("train", "infer")]  # every pair, those the worker did not reach too
    for row in rows:
        if not row.get("img_s") and not row.get("problem"):
            row["problem"] = found.get("error") or found.get("problem") or _status(
                proc.returncode)
    return rows


def _bench_na(stage: Stage) -> None:
    f = stage.findings
    na_json = stage.work / "na_bench.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_ops.py"), "--part", "2",
           "--json", str(na_json), "--plot", str(stage.out / "na_bench.png")]
    cmd += (["--device", "cpu", "--dtype", "fp32", "--batch", "1", "--no-flex", "--repeats",
             "1", "--warmup", "0"] if stage.dry else
            ["--device", "cuda", "--dtype", "bf16", "--batch", "64"])
    f["na_command"] = " ".join(["python", "scripts/bench_ops.py"] + cmd[2:])
    if stage.left() < 20:
        f["na_status"], f["na"], f["na_table"] = "not run: out of time", [], ""
        return
    try:
        na = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True,
                            timeout=max(stage.left() - 10, 5))
        na_out, f["na_status"] = na.stdout, _status(na.returncode)
        print(na.stdout[-6000:], na.stderr[-2000:], flush=True)
    except subprocess.TimeoutExpired as e:  # what it printed by then (str, or bytes)
        na_out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (
            e.stdout or "")
        f["na_status"] = "timed out"
    f["na"] = json.loads(na_json.read_text())["rows"] if na_json.exists() else []
    f["na_table"] = na_out[na_out.rfind("\nNA case"):].strip() if "\nNA case" in na_out else ""
    stage.save()


def models_table(rows: List[dict]) -> str:
    """img/s per model (rows) and kind and mode (columns), with the ratio to swin_tiny's in
    the same column and issue 46's target where one applies."""
    from attnzoo.profiling import table
    columns = [(k, m) for k in ("train", "infer") for m in MODES]
    cell = {(r["model"], r["kind"], r["mode"]): r for r in rows}
    swin = {c: cell.get((SWIN, *c), {}).get("img_s") for c in columns}
    body = []
    for name in dict.fromkeys(r["model"] for r in rows):
        line = [name]
        for c in columns:
            r = cell.get((name, *c), {})
            if not r.get("img_s"):
                line.append((r.get("problem") or "-").replace("|", "/")[:60])
                continue
            text = f"{r['img_s']:.0f}"
            if swin[c] and name != SWIN:
                ratio = r["img_s"] / swin[c]
                target = (RO_TARGETS if c[1] == "reduce-overhead" else {}).get(
                    name, TARGETS.get(name))
                text += f" ({ratio:.2f}x" + ("" if target is None else
                                             ", met" if ratio >= target else
                                             f", < {target}x") + ")"
            line.append(text)
        body.append(line)
    flags = ("graph_breaks", "cudagraph_skips", "cudagraph_partitions", "sync")
    notes = [f"- {r['model']} {r['kind']} {r['mode']}: " + "; ".join(
        f"{k.replace('_', ' ')} {r[k]}" for k in flags if r.get(k) not in (None, 0, "ok"))
        for r in rows if any(r.get(k) not in (None, 0, "ok") for k in flags)]
    return "\n".join([table(["model"] + [f"{k} {m}" for k, m in columns], body), ""] + notes)


def first_table(rows: List[dict]) -> str:
    from attnzoo.profiling import table
    return table(["model", "caches", "first training step, s", "second step, s"], [
        [r.get("model", "?"), r.get("cache", "?"), f"{r['first_s']:.2f}" if r.get("first_s")
         else r.get("problem") or r.get("error") or "-",  # (a worker that raised: its error)
         f"{r['second_s']:.2f}" if r.get("second_s") else "-"] for r in rows])


def _bench_setup(stage: Stage, name: str):
    """A model (fp32 parameters) and a step maker ``step(fn, kind)`` for training (batch 32,
    SGD) or inference (batch 64), under bf16 autocast on a GPU; a dry run's: tiny, fp32, batch
    1 at 32 px."""
    import timm
    import torch
    model = timm.create_model(name, **(tiny_kwargs(name) if stage.dry else {})).to(
        stage.device)
    size = 32 if stage.dry else 224
    batch = {"train": 1 if stage.dry else 32, "infer": 1 if stage.dry else 64}
    inputs = {k: torch.randn(b, 3, size, size, device=stage.device) for k, b in batch.items()}
    target = torch.zeros(batch["train"], dtype=torch.long, device=stage.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(fn, kind):
        def infer():
            with torch.no_grad(), torch.autocast(stage.device, torch.bfloat16,
                                                 enabled=not stage.dry):
                fn(inputs["infer"])

        def train():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(stage.device, torch.bfloat16, enabled=not stage.dry):
                loss = torch.nn.functional.cross_entropy(fn(inputs["train"]).float(), target)
            loss.backward()
            optimizer.step()
        return infer if kind == "infer" else train
    return model, step, batch


def _compiled(model, mode: str, dry: bool):
    import torch
    if mode == "eager":
        return model
    if dry:  # Inductor's CPU code takes minutes; CUDA graphs need a GPU
        return torch.compile(model, backend="aot_eager")
    return torch.compile(model, mode=None if mode == "compiled" else mode)


def worker_bench_model(stage: Stage) -> None:
    """One model's img/s, training and inference, eager, compiled and with CUDA graphs (its
    graphs from the caches the parallel compiles filled), in this one process; for the CUDA
    graphs' training step also Dynamo's graph breaks, Inductor's skipped CUDA-graph partitions,
    and whether a step synchronises the host (``torch.cuda.set_sync_debug_mode("error")``)."""
    import torch
    import torch._dynamo

    import attnzoo
    from attnzoo.profiling import synchronize, time_steps
    _, name, modes = stage.arg.split(":")
    model, step, batch = _bench_setup(stage, name)
    rows = stage.findings["rows"] = []
    counters = torch._dynamo.utils.counters
    for mode in modes.split(","):
        fn = _compiled(model, mode, stage.dry)
        for kind in ("train", "infer"):
            row = dict(model=name, mode=mode, kind=kind, batch=batch[kind])
            rows.append(row)
            if stage.left() < 20:
                row["problem"] = "out of time"
                continue
            counters.clear()
            run = step(fn, kind)
            with attnzoo.use_backend("auto"):
                try:
                    start = time.time()
                    run()
                    synchronize(stage.device)
                    row["first_s"] = round(time.time() - start, 2)
                    times = time_steps(run, stage.device, warmup=0 if stage.dry else 3,
                                       repeats=1 if stage.dry else 10)
                    row["img_s"] = batch[kind] / statistics.median(times)
                    row["graph_breaks"] = sum(counters["graph_break"].values())
                    row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"]
                    # (a graph cut around what a CUDA graph cannot capture, which runs eagerly
                    # without a skip counted: the partitions of the graphs cut, else 0)
                    row["cudagraph_partitions"] = counters["inductor"]["cudagraph_partitions"]
                    if kind == "train" and not stage.dry:
                        torch.cuda.set_sync_debug_mode("error")
                        try:
                            run()
                            row["sync"] = "ok"
                        except RuntimeError as e:
                            row["sync"] = f"synchronises: {str(e).splitlines()[0][:120]}"
                        finally:
                            torch.cuda.set_sync_debug_mode(0)
                except Exception as e:  # noqa: BLE001 - a mode that fails is its row's finding
                    row["problem"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"{name} {mode} {kind} b{batch[kind]}: "
                  f"{row.get('img_s', 0):.1f} img/s {row.get('problem', '')}", flush=True)
            stage.save()
        torch._dynamo.reset()


def worker_warm(stage: Stage) -> None:
    """Stage 6's compiles for one item, into Triton's (and Inductor's) cache: every autotune
    configuration of its launches compiled, none timed; FlexAttention's graphs, with and
    without rpb; a model's compiled graphs in one mode; or a first training step, timed."""
    import torch

    import attnzoo
    from attnzoo.kernels import neighborhood as kn
    from attnzoo.ops import na2d
    kind, _, what = stage.arg.partition(":")
    if kind == "first":
        from attnzoo.profiling import time_steps
        model, step, _ = _bench_setup(stage, what)
        with attnzoo.use_backend("auto"):
            first, second = time_steps(step(model, "train"), stage.device, warmup=0, repeats=2)
        stage.findings.update(model=what, first_s=round(first, 3), second_s=round(second, 3))
        return
    if kind == "compile":
        name, mode = what.split(":")
        model, step, _ = _bench_setup(stage, name)
        fn = _compiled(model, mode, stage.dry)
        for k in ("train", "infer"):
            for _ in range(2):  # (CUDA graphs record on the second call)
                step(fn, k)()
        return
    kn._TUNER.bench = lambda fn: 0.0  # compile every configuration, time none
    kn._TUNER.store = None  # and keep no such untimed choice on disk
    dtype = torch.float32 if stage.dry else torch.bfloat16
    if kind == "na":
        i = int(what)
        B = 1 if stage.dry else 64
        shape, K, d = ([(B, 56 >> i, 56 >> i, 2 << i, 32), 7, 1] if i < 4 else
                       [(B, 56, 56, 2, 32), 7, 8] if i == 4 else [(B, 28, 28, 4, 32), 7, 4])
        if stage.dry:
            shape = (1, 9, 9, 2, 8)
        q, k, v = (torch.randn(shape, device=stage.device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        rpb = torch.zeros(shape[3], 2 * K - 1, 2 * K - 1, device=stage.device,
                          requires_grad=True)  # fp32, as bench_ops.py and NAT under autocast
        for bias in (rpb, None):
            na2d(q, k, v, kernel_size=K, dilation=d, rpb=bias, backend="cuda").sum().backward()
        if not stage.dry:
            sys.path.insert(0, str(ROOT / "scripts"))
            import bench_ops  # (it unsets TRITON_INTERPRET: not in a dry run)
            flex = bench_ops.flex_na(shape, K, d, stage.device, compile_=True)
            for bias in (rpb, None):
                flex(q, k, v, bias).sum().backward()
                with torch.no_grad():
                    flex(q, k, v, bias)
    else:  # as the bench runs it: fp32 parameters under bf16 autocast (the kernels' dtypes)
        model, step, _ = _bench_setup(stage, what)
        with attnzoo.use_backend("cuda"):
            step(model, "infer")()
            step(model, "train")()
    print(f"warm {stage.arg}: done", flush=True)


WORKERS: Dict[str, Callable[[Stage], None]] = {
    "env": stage_env, "smoke": stage_smoke, "tests": stage_tests, "models": stage_models,
    "bench": stage_bench, "model": worker_model, "warm": worker_warm,
    "bench_model": worker_bench_model}


if __name__ == "__main__":
    sys.exit(main())
