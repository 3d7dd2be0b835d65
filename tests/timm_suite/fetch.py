"""Fetch timm's own test suite (``tests/`` of the timm sdist) for the INSTALLED timm version.

timm's ``tests/test_models.py`` ships in the sdist on the package index, not in the wheel. We
download that sdist with pip (``pip download --no-deps --no-binary :all: timm==<version>``) into a
cache directory outside the repository and extract only its ``tests/`` folder. Nothing of it is
ever copied into the repository.

Cache: ``$ATTNZOO_CACHE`` or ``$XDG_CACHE_HOME/attnzoo`` or ``~/.cache/attnzoo``, in
``timm-suite/timm-<version>/``. The extracted folder is renamed to the package
``timm_upstream_tests`` (it has an ``__init__.py``) so it can never clash with our own ``tests``.
The cache is filled once per timm version; concurrent processes (pytest-xdist workers) serialize
on a file lock, the extraction is atomic.

Usable as a script: ``python tests/timm_suite/fetch.py`` prints the path of the extracted suite.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

PACKAGE_NAME = "timm_upstream_tests"  # the name timm's tests/ package is extracted under
_COMPLETE = ".complete"


class SuiteFetchError(RuntimeError):
    pass


def _log(msg: str) -> None:
    print(f"[attnzoo timm-suite] {msg}", file=sys.__stderr__, flush=True)


def cache_root() -> Path:
    env = os.environ.get("ATTNZOO_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "attnzoo"


def installed_timm_version() -> str:
    import timm

    return timm.__version__


@contextlib.contextmanager
def file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _download_sdist(version: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--progress-bar", "off",
           "-d", str(dest), f"timm=={version}"]
    _log(f"downloading the timm {version} sdist from the package index: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        raise SuiteFetchError(f"`pip download timm=={version}` did not finish in {e.timeout}s") from e
    if proc.returncode != 0:
        raise SuiteFetchError(
            f"could not download the sdist of timm=={version} from the package index "
            f"(pip exit code {proc.returncode}). timm's own test suite is taken from that sdist; "
            "check that the package index is reachable (pip's index settings / network), or set "
            "ATTNZOO_SKIP_TIMM_SUITE=1 to run without timm's suite.\n"
            f"--- pip output (tail) ---\n{(proc.stdout + proc.stderr)[-3000:]}")
    sdists = sorted(dest.glob(f"timm-{version}.tar.gz")) or sorted(dest.glob("timm-*.tar.gz"))
    if not sdists:
        raise SuiteFetchError(f"pip download succeeded but no timm sdist is in {dest}: {os.listdir(dest)}")
    _log(f"downloaded {sdists[0].name} ({sdists[0].stat().st_size / 1e6:.1f} MB) in {time.monotonic() - t0:.1f}s")
    return sdists[0]


def _extract_tests(sdist: Path, out_dir: Path) -> None:
    """Extract only ``<top>/tests/*`` of the sdist into ``out_dir`` (flattened to its contents)."""
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if len(parts) >= 3 and parts[1] == "tests" and (m.isfile() or m.isdir()):
                m.name = str(Path(*parts[2:]))
                members.append(m)
        if not any(m.name == "test_models.py" for m in members):
            raise SuiteFetchError(f"{sdist.name} has no tests/test_models.py")
        out_dir.mkdir(parents=True)
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(out_dir, members=members, **kwargs)


def ensure_suite(version: str | None = None) -> Path:
    """Return the folder that holds the package ``timm_upstream_tests`` (timm's tests/) for ``version``."""
    version = version or installed_timm_version()
    root = cache_root() / "timm-suite" / f"timm-{version}"
    pkg = root / PACKAGE_NAME
    if (root / _COMPLETE).exists() and (pkg / "test_models.py").exists():
        return root
    with file_lock(cache_root() / "timm-suite" / ".lock"):
        if (root / _COMPLETE).exists() and (pkg / "test_models.py").exists():
            return root  # another process filled it while we waited
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=".tmp-") as tmp:
            tmp = Path(tmp)
            sdist = _download_sdist(version, tmp / "dl")
            shutil.copy2(sdist, root / sdist.name)  # keep the sdist itself (2-3 MB) for reference
            _extract_tests(sdist, tmp / PACKAGE_NAME)
            if pkg.exists():
                shutil.rmtree(pkg)
            os.replace(tmp / PACKAGE_NAME, pkg)
        (root / _COMPLETE).write_text(version + "\n")
        _log(f"timm {version} test suite extracted to {pkg}")
    return root


if __name__ == "__main__":
    try:
        print(ensure_suite(sys.argv[1] if len(sys.argv) > 1 else None) / PACKAGE_NAME)
    except SuiteFetchError as e:
        sys.exit(f"error: {e}")
