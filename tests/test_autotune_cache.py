"""The autotuner's choices persist on disk (attnzoo.kernels.TuningStore): a second process's
first call of a key compiles and times nothing, a choice of another GPU, Triton or attnzoo
version is never used, and a corrupt or foreign file is ignored with one warning."""
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from attnzoo import kernels
from kernel_checks import CPU, fake_tuner

ROOT = Path(__file__).resolve().parents[1]
SCOPE = "Simulated GPU sm_90 triton 3.6.0 attnzoo 0.1.0"
_TIMES = {"a": 2.0, "b": 1.0}  # an autotuner's two configurations: b the faster

# One NA forward on a simulated GPU (Triton's interpreter runs the launches on CPU tensors):
# tuning allowed, the device named by SCOPE, every configuration "compiles" without spills, and
# the timings are TIMES in the order configurations are timed (the second is the fastest). It
# prints how many configurations were timed and which one the call took.
_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    from attnzoo import kernels
    from attnzoo.kernels import neighborhood as kn
    from attnzoo.ops import na2d

    class Compiled:
        n_spills = 0
        def _init_handles(self):
            pass

    launch = kn._run
    kn._run = lambda kernel, grid, *a, warmup=False, **kw: (
        Compiled() if warmup else launch(kernel, grid, *a, **kw))
    kn.can_tune = lambda device: True
    kn.tuning_scope = lambda device: os.environ["SCOPE"]
    timed, chosen = [], []
    times = [3.0, 1.0, 2.0, 4.0]

    def bench(fn):
        fn()
        timed.append(1)
        return times[len(timed) - 1]

    kn._TUNER.bench = bench
    run = kn._run
    kn._run = lambda kernel, grid, *a, warmup=False, **kw: (
        chosen.append(tuple(kernels.launch_arguments(kernel, a, kw)[n] for n in
                            ("TH", "TW", "BN", "num_warps", "num_stages")))
        if not warmup else None, run(kernel, grid, *a, warmup=warmup, **kw))[1]
    q = torch.randn(1, 8, 8, 1, 16)
    na2d(q, q, q, kernel_size=3, backend="cuda")
    print(json.dumps({"timed": len(timed), "config": chosen[-1]}))
""")


def _run(cache: Path) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", SCOPE=SCOPE,
               PYTHONPATH=str(ROOT), **{kernels.TUNING_CACHE_ENV: str(cache)})
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.interpreter
@pytest.mark.skipif(kernels.triton_missing() is not None, reason=str(kernels.triton_missing()))
def test_a_second_process_reuses_the_choice_and_times_nothing(tmp_path):
    cache = tmp_path / "autotune.json"
    first = _run(cache)
    assert first["timed"] >= 2  # it tuned: compiled and timed its space
    stored = json.loads(cache.read_text())
    [(key, index)] = stored["entries"][SCOPE].items()
    assert "'fwd'" in key and index == 1  # the fastest: the second timed
    second = _run(cache)
    assert second == {"timed": 0, "config": first["config"]}  # nothing compiled nor timed


def test_a_choice_holds_for_its_scope_only_and_every_scope_is_kept(tmp_path):
    pytest.importorskip("triton")
    path = tmp_path / "autotune.json"
    for scope, timed in (("gpu A", 2), ("gpu B", 2), ("gpu A", 0)):  # A's reused, B tunes
        tuner, launch, launched = fake_tuner(_TIMES, kernels.TuningStore(lambda: path))
        assert tuner.choose("k", "ab", launch, tune=True, scope=scope, device=CPU) == "b"
        assert len(launched) == timed, scope
    assert json.loads(path.read_text())["entries"] == {"gpu A": {"'k'": 1}, "gpu B": {"'k'": 1}}


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": "another tool 3"}),
                                     json.dumps([1, 2])], ids=["corrupt", "foreign", "list"])
def test_a_corrupt_or_foreign_cache_is_ignored_with_one_warning(tmp_path, caplog, content):
    pytest.importorskip("triton")
    path = tmp_path / "autotune.json"
    path.write_text(content)
    store = kernels.TuningStore(lambda: path)
    tuner, launch, launched = fake_tuner(_TIMES, store)
    with caplog.at_level(logging.WARNING, logger="attnzoo.kernels"):
        assert tuner.choose("k1", "ab", launch, tune=True, scope="gpu", device=CPU) == "b"
        assert tuner.choose("k2", "ab", launch, tune=True, scope="gpu", device=CPU) == "b"
    warnings = [r for r in caplog.records if "ignoring the autotune cache" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage()
    entries = json.loads(path.read_text())["entries"]  # replaced by a valid file
    assert entries == {"gpu": {"'k1'": 1, "'k2'": 1}}


def test_persistence_can_be_turned_off_and_an_unwritable_cache_warns(tmp_path, monkeypatch,
                                                                    caplog):
    pytest.importorskip("triton")
    monkeypatch.setenv(kernels.TUNING_CACHE_ENV, "0")
    assert kernels.tuning_cache_path() is None
    monkeypatch.setenv(kernels.TUNING_CACHE_ENV, str(tmp_path / "mine.json"))
    assert kernels.tuning_cache_path() == tmp_path / "mine.json"
    monkeypatch.delenv(kernels.TUNING_CACHE_ENV)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert kernels.tuning_cache_path() == tmp_path / "triton" / "attnzoo_autotune.json"
    blocker = tmp_path / "file"
    blocker.write_text("")
    tuner, launch, _ = fake_tuner(
        _TIMES, kernels.TuningStore(lambda: blocker / "autotune.json"))
    with caplog.at_level(logging.WARNING, logger="attnzoo.kernels"):
        assert tuner.choose("k", "ab", launch, tune=True, scope="gpu", device=CPU) == "b"
    assert "cannot write the autotune cache" in caplog.text


def test_a_key_tries_a_bounded_number_of_configurations():
    pytest.importorskip("triton")
    tuner, launch, launched = fake_tuner(dict.fromkeys("abcdefgh", 1.0))
    tuner.choose("k", "abcdefgh", launch, tune=True, device=CPU)
    assert launched == list("abcdefgh"[:kernels.MAX_CONFIGS])


def test_threads_writing_one_cache_lose_nothing_and_warn_nothing(tmp_path, caplog):
    """Each write goes through a file of its own writer's (process and thread) before it
    replaces the cache: threads of one process tuning at once never install another's half-
    written file, nor find their file gone."""
    path = tmp_path / "autotune.json"
    store = kernels.TuningStore(lambda: path)
    store.get("gpu", "k")  # read once (empty), as the tuner does first
    start = threading.Barrier(6)

    def tune(t):
        start.wait()
        for i in range(25):
            store.put("gpu", (t, i), i % 3)
    threads = [threading.Thread(target=tune, args=(t,)) for t in range(6)]
    with caplog.at_level(logging.WARNING, logger="attnzoo.kernels"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert "autotune cache" not in caplog.text
    entries = json.loads(path.read_text())["entries"]["gpu"]
    assert entries == {repr((t, i)): i % 3 for t in range(6) for i in range(25)}
