"""Shared pytest setup.

Every test starts from a clean backend state (the ``backend_state`` fixture, autouse): no
``use_backend`` block or process default, no ``ATTNZOO_BACKEND``, no cached choices or probes of
optional installs (:func:`attnzoo.backends.reset`), and is left that way.

Test tiers are pytest markers (registered in pyproject.toml); ``pytest_collection_modifyitems``
below adds those that follow from where a test lives.

Registers the plugin that runs timm's own test suite on our models (tests/timm_suite/plugin.py).
Registering it costs nothing: the suite is only fetched when tests/test_timm_suite.py is collected.

Without a GPU, attnzoo's Triton kernels (the ``cuda`` backend) are checked under Triton's
interpreter on CPU tensors. Triton decides interpreted or compiled when a kernel module is
imported (``@triton.jit``), so every kernel module is imported here, first, with
TRITON_INTERPRET=1, and the variable is then restored: the ``cuda`` backend accepts CPU tensors
only while it is set, which the ``backend_state`` fixture does for the tests marked
``interpreter`` only, so no other test sees a different backend behaviour (an explicit ``cuda``
on CPU stays an error). With a GPU the kernels compile and the same tests run them on CUDA
tensors.
"""
import importlib
import os
import pkgutil
import sys
from pathlib import Path

import pytest
import torch


def _import_kernels_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import attnzoo.kernels as kernels
        if kernels.triton_missing() is None:  # else the kernel tests report it
            for info in pkgutil.iter_modules(kernels.__path__):
                importlib.import_module(f"attnzoo.kernels.{info.name}")
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def _keep_registered_builtins_alive() -> None:
    # TorchScript keys its table of builtin functions by id(). torch registers each op it looks
    # up there (torch._ops._get_packet) and drops the op again when a torch.library fragment
    # goes away; a later object can then take the freed id and be scripted as that builtin
    # ("builtin cannot be used as a value" on a Conv2d's padding list, once in CI). Holding a
    # reference to everything registered keeps every id taken.
    from torch.jit import _builtins

    register, kept = _builtins._register_builtin, []

    def register_and_keep(fn, op):
        kept.append(fn)
        register(fn, op)

    _builtins._register_builtin = register_and_keep


def _share_the_cores_between_workers() -> None:
    # pytest-xdist workers would each run torch's default of one thread per core: with -n 2 on
    # 2 cores, 4 OpenMP threads whose barriers wait on descheduled peers. Each worker gets its
    # share instead, and so do the processes tests start (OMP_NUM_THREADS, unless set).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, torch.get_num_threads() // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


_share_the_cores_between_workers()
_keep_registered_builtins_alive()
if not torch.cuda.is_available():
    _import_kernels_interpreted()

from attnzoo import backends, kernels  # noqa: E402  (after the kernel modules, imported first)

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)  # makes `timm_suite` importable under any --import-mode

from timm_suite import families as _timm_suite_families  # noqa: E402
from timm_suite import plugin as _timm_suite_plugin  # noqa: E402


@pytest.fixture(autouse=True)
def backend_state(request, monkeypatch):
    """A clean backend state before and after every test (see the module docstring); in tests
    marked ``interpreter``, on a machine without a GPU, TRITON_INTERPRET=1 too. No autotune
    cache on disk (tests/test_autotune_cache.py names its own). No kernel
    verification record either (neither the package's nor ATTNZOO_VERIFIED_KERNELS'): a test
    that needs one writes it (the ``kernel_records`` fixture), so what ``auto`` picks on a GPU
    does not change with the records the package ships."""
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.delenv(kernels.RECORDS_ENV, raising=False)
    monkeypatch.setenv(kernels.TUNING_CACHE_ENV, "0")  # no autotune choice read or kept on disk
    monkeypatch.setattr(kernels, "RECORDS_FILE", Path(os.devnull))
    if request.node.get_closest_marker("interpreter") and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    backends.reset()
    yield
    backends.reset()


@pytest.fixture
def kernel_records(tmp_path, monkeypatch):
    """``record(*verifications)``: the package's records file holds exactly these lines from
    now on (a file in ``tmp_path``, read as the package's is)."""
    def record(*verifications):
        path = tmp_path / "verified.jsonl"
        path.write_text("".join(v.to_line() + "\n" for v in verifications))
        monkeypatch.setattr(kernels, "RECORDS_FILE", path)
        backends.reset()
        return path
    return record


@pytest.fixture
def legacy_natten(monkeypatch):
    """NATTEN 0.17's API (tests/na_inputs.fake_legacy_natten) as the installed ``natten``;
    returns the list of its functions called, in order."""
    from attnzoo.ops import neighborhood
    from na_inputs import fake_legacy_natten
    natten, functional, calls = fake_legacy_natten()
    monkeypatch.setitem(sys.modules, "natten", natten)
    monkeypatch.setitem(sys.modules, "natten.functional", functional)
    assert neighborhood._natten()[1] == "legacy"
    return calls


@pytest.fixture
def bounds_checked(monkeypatch):
    """Under the interpreter, every load and store of an attnzoo kernel launch (any family) must
    fall inside the elements of one of the tensors the launch was given (the interpreter reads
    raw memory: a stray pointer reads whatever lies there and passes unnoticed). On a GPU the
    kernels are compiled and this check does nothing: the same tests run on CUDA tensors there,
    and the interpreter's check of their accesses is CI's (every test using it runs there)."""
    if torch.cuda.is_available():
        yield
        return
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder

    from attnzoo.kernels import neighborhood, qna, san
    extents = []

    def checked(run):
        def checked_run(kernel, grid, *args, **kwargs):
            extents[:] = [(t.data_ptr(), t.data_ptr() + t.element_size() * (1 + sum(
                (n - 1) * stride for n, stride in zip(t.shape, t.stride()))))
                for t in args if isinstance(t, torch.Tensor) and t.numel()]
            return run(kernel, grid, *args, **kwargs)
        return checked_run

    def check(ptrs, mask, what):
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        address = np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].astype(np.int64)
        inside = np.zeros(address.shape, bool)
        for start, end in extents:
            inside |= (address >= start) & (address + size <= end)
        assert inside.all(), f"{what} outside every argument tensor: {address[~inside][:4]}"

    # NA launches through its _run (the capture seam); QnA and SAN through launch_on_device
    monkeypatch.setattr(neighborhood, "_run", checked(neighborhood._run))
    for module in (qna, san):
        monkeypatch.setattr(module, "launch_on_device", checked(module.launch_on_device))
    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", lambda self, ptrs, mask, *a: (
        check(ptrs, mask, "load"), load(self, ptrs, mask, *a))[1])
    monkeypatch.setattr(InterpreterBuilder, "create_masked_store", lambda self, ptrs, v, mask, *a: (
        check(ptrs, mask, "store"), store(self, ptrs, v, mask, *a))[1])
    yield


def pytest_configure(config):
    if not config.pluginmanager.is_registered(_timm_suite_plugin):
        config.pluginmanager.register(_timm_suite_plugin, "attnzoo-timm-suite")


# The modules whose fixture runs a harness in a process of its own for a minute or more on CI:
# each on one pytest-xdist worker, which runs it once (each worker given one of their tests would)
HARNESS_MODULES = ("tests/test_kernels_inductor.py", "tests/test_kernels_launch.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's ``load`` scheduling (``-n 2``) of single tests, but each of the
    :data:`HARNESS_MODULES` as one unit (they go out first, as the biggest units)."""
    if config.getoption("dist") != "load":
        return None  # (another --dist, as asked)
    from xdist.scheduler import LoadScopeScheduling

    class HarnessModulesWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in HARNESS_MODULES else nodeid
    return HarnessModulesWhole(config, log)


# Tests of half a minute or more on CI (its --durations), by node id prefix: run first, so
# that pytest-xdist's workers start them early instead of one of them finishing alone with one.
LONG_FIRST = ("tests/test_gpu_verify.py::", "tests/test_train_launch.py::",
              "tests/test_kernels_neighborhood.py::test_kernels_compile_for_sm80_and_sm90")


@pytest.hookimpl(tryfirst=True)  # before -m selects by these markers (it keeps the order)
def pytest_collection_modifyitems(items):
    """timm's suite cases on ``families.FLOOR_MODELS`` are in the ``floor`` tier (every suite
    case is ``timm_suite``: tests/test_timm_suite.py); the :data:`LONG_FIRST` tests first."""
    items.sort(key=lambda item: not item.nodeid.startswith(LONG_FIRST))  # a stable sort
    for item in items:
        if _timm_suite_plugin.is_suite_item(item):
            model = getattr(getattr(item, "callspec", None), "params", {}).get("model_name")
            if isinstance(model, str) and model.split(".", 1)[0] in \
                    _timm_suite_families.FLOOR_MODELS:
                item.add_marker(pytest.mark.floor)
