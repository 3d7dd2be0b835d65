"""The documentation runs: every ```python and ```bash / ```sh / ```shell block of README.md and
docs/*.md, offline (HF_HUB_OFFLINE=1) in a temporary folder, and every relative link points to a
file that exists.

A block that cannot run here (installs, downloads, training, GPUs, minutes of work) has
``<!-- not run: REASON -->`` on the line just before its fence, with a reason; the README's CI
command has its ``<!-- test command: ... -->`` marker there instead (``.ci/run`` runs it). Such a
block is listed as not run by these tests, not skipped by pytest.

The Python blocks run in one subprocess, each in a fresh namespace and a folder of its own, so
that the imports of torch and timm are paid once; a shell block runs on its own with
``bash -euo pipefail``. Each block is a test named by its page and line."""
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
NOT_RUN = re.compile(r"^\s*<!-- not run:(?P<reason>.*?)-->\s*$")
TEST_COMMAND = re.compile(r"^\s*<!-- test command:.*-->\s*$")
TIMEOUT = 120


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str  # "python" or "bash"
    code: str
    not_run: str | None  # the reason, where the block is marked

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").split("\n")
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, start = len(fence["indent"]), i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        body = "\n".join(line[indent:] if line[:indent].strip() == "" else line
                         for line in lines[start + 1:i]) + "\n"
        i += 1
        lang = LANGUAGES.get(fence["lang"])
        if lang is None:
            continue
        before = lines[start - 1] if start else ""
        marker = NOT_RUN.match(before)
        reason = marker["reason"].strip() if marker else None
        if reason is None and TEST_COMMAND.match(before):
            reason = "the CI command: .ci/run runs it"
        found.append(Block(page, start + 1, lang, body, reason))
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page)]
RUN = [block for block in BLOCKS if block.not_run is None]

# Runs in the subprocess: each of the page's Python blocks in a fresh namespace and folder.
_RUNNER = r"""
import json, os, sys, traceback
blocks, results = json.load(open(sys.argv[1])), {}
for name, code, folder in blocks:
    os.makedirs(folder)
    os.chdir(folder)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()
print("\n" + json.dumps(results))
"""


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    # `python` and `attnzoo` in a shell block: this interpreter's
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


class _Runs:
    """The subprocesses of the runnable blocks: every Python block in one (torch and timm are
    imported once), each shell block in its own. Without xdist they all start together at the
    first block test, so that they share the machine's cores; under xdist, each on demand."""

    def __init__(self):
        self.procs: dict = {}
        self.folder = Path(tempfile.mkdtemp(prefix="attnzoo-docs-"))

    def start(self, key):
        if key in self.procs:
            return
        if key == "python":
            todo = [(b.name, b.code, str(self.folder / f"py{i}"))
                    for i, b in enumerate(RUN) if b.lang == "python"]
            (self.folder / "blocks.json").write_text(json.dumps(todo))
            proc = subprocess.Popen([sys.executable, "-c", _RUNNER, "blocks.json"],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, cwd=self.folder,
                                    env=_env())
        else:
            cwd = self.folder / f"sh{RUN.index(key)}"
            cwd.mkdir()
            proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", key.code], cwd=cwd,
                                    env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        self.procs[key] = proc

    def result(self, key) -> tuple[int, str]:
        if not self.procs and "PYTEST_XDIST_WORKER" not in os.environ:
            self.start("python")
            for block in RUN:
                if block.lang == "bash":
                    self.start(block)
        self.start(key)
        proc = self.procs[key]
        if not isinstance(proc, tuple):
            try:
                out, _ = proc.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                out = proc.communicate()[0] + f"\n(killed after {TIMEOUT} s)"
            self.procs[key] = (proc.returncode, out)
        return self.procs[key]


_RUNS = _Runs()


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_docs_block_runs(block):
    if block.lang == "python":
        _, output = _RUNS.result("python")
        last = output.rstrip().rsplit("\n", 1)[-1]
        try:
            results = json.loads(last)
        except json.JSONDecodeError:
            results = {}
        assert block.name in results, f"{block.name}: the runner did not finish\n{output}"
        assert results[block.name] is None, f"{block.name} failed:\n{results[block.name]}"
    else:
        status, output = _RUNS.result(block)
        assert status == 0, f"{block.name} failed (status {status}):\n{block.code}\n{output}"


def test_docs_not_run_markers_have_reasons_and_precede_a_block():
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").split("\n")
        for n, line in enumerate(lines, 1):
            if not line.lstrip().startswith("<!-- not run"):
                continue
            marker = NOT_RUN.match(line)
            where = f"{page.relative_to(ROOT)}:{n}"
            assert marker and marker["reason"].strip(), f"{where}: '<!-- not run: REASON -->'"
            fence = FENCE.match(lines[n]) if n < len(lines) else None
            assert fence and fence["lang"] in LANGUAGES, f"{where}: no code block right after it"


def test_docs_blocks_are_found_and_most_run():
    assert len(RUN) >= 8, [b.name for b in RUN]
    # the documented signatures run, so they cannot drift from the code
    running = "".join(b.code for b in RUN)
    for call in ("count_macs(model, (1, 3, 224, 224))", "forward_intermediates(",
                 "features_only=True", "attention_maps(", "na2d_qk(", "use_backend("):
        assert call in running, call


def test_readme_keeps_the_ci_test_command():
    """.ci/run runs the line after the line after the marker (awk: getline; getline)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").split("\n")
    at = next(n for n, line in enumerate(lines) if "<!-- test command" in line)
    assert lines[at + 1].strip() == "```bash"
    assert "python -m pytest" in lines[at + 2] and "pip install" in lines[at + 2]


LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_relative_links_point_to_files(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for link in LINK.finditer(text):
        target = link["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on the same page
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


def _fake_wheel(folder: Path, name: str, version: str, requires=()) -> None:
    """An empty wheel of ``name`` ``version`` (its metadata only): what pip resolves with."""
    import zipfile
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": "",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
                 name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def test_readme_cpu_install_puts_cpu_torch_and_torchvision_in_the_venv_first(tmp_path):
    """The README's CPU install, offline: its venv made first, then torch and torchvision from
    one CPU index into it (here stand-in wheels of a local folder), then attnzoo: pip's plan for
    attnzoo (``--dry-run``) keeps them, installing no torch, torchvision, triton or CUDA
    package (the README once installed CPU torch outside the venv: 17 CUDA packages and 5.5 GB
    came with attnzoo)."""
    [block] = [b for b in blocks_of(ROOT / "README.md") if "whl/cpu" in b.code]
    lines = [line.strip() for line in block.code.splitlines() if line.strip()]
    venv, cpu, attnzoo_line = (next(i for i, line in enumerate(lines) if key in line)
                               for key in ("-m venv", "whl/cpu", "install -e ."))
    assert venv < cpu < attnzoo_line, lines
    cpu_line = lines[cpu]
    assert re.fullmatch(r"pip install torch torchvision --index-url "
                        r"https://download\.pytorch\.org/whl/cpu", cpu_line), cpu_line
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _fake_wheel(wheels, "torch", "2.14.1+cpu")
    _fake_wheel(wheels, "torchvision", "0.29.1+cpu", ["torch==2.14.1"])
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    pip = [str(tmp_path / "venv" / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    offline = cpu_line.replace("--index-url https://download.pytorch.org/whl/cpu",
                               f"--no-index --find-links {wheels}").split()[2:]
    subprocess.run(pip + ["install", "-q"] + offline, check=True)
    report = tmp_path / "report.json"
    result = subprocess.run(pip + ["install", "--dry-run", "-q", "--report", str(report), "-e",
                                   str(ROOT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    planned = [item["metadata"]["name"].lower() for item in json.loads(report.read_text())[
        "install"]]
    assert "attnzoo" in planned and "timm" in planned, planned
    heavy = [n for n in planned if n in ("torch", "torchvision", "triton")
             or n.startswith(("nvidia", "cuda"))]
    assert not heavy, heavy
