"""pytest plugin that runs timm's own ``tests/test_models.py`` against attnzoo's models only.

Registered by ``tests/conftest.py``; the suite itself is collected through ``tests/test_timm_suite.py``
(``load_suite()`` below), so ``pytest tests/test_x.py`` never fetches it.

What it does, and why:

1. ``import attnzoo`` before the suite is imported: ``test_models.py`` parametrizes its tests at
   import time from ``timm.list_models(...)``, so our models must already be registered.
2. While the suite is imported, ``timm.list_models(module=[...])`` also returns our models. The
   suite picks the models for ``test_model_forward_intermediates``,
   ``test_model_forward_intermediates_features`` and ``test_prune_intermediate_layers_contract``
   by timm *module name* from a hard-coded list of module names (models with
   ``forward_intermediates()`` / ``prune_intermediate_layers()`` and FeatureGetterNet
   ``features_only`` support). Every attnzoo model implements that contract (architecture spec), but
   our modules (``attnzoo.models.nat`` -> module key ``nat``) are not in timm's list. The patch is
   limited to the import of the suite (``timm.list_models`` is restored right after) and is
   checked: if the suite stops selecting our models for those tests, loading fails loudly.
2b. Also while it is imported, timm's non-spatial filter list (``NON_STD_FILTERS``: ``vit_*``,
   ``deit*``, ...) matches our token-output models (``families.FAMILIES``), so the suite checks
   them as the ViTs they are, wherever it includes or excludes by that list.
3. ``GITHUB_ACTIONS`` is hidden from the suite (at import and while its tests run): with it set the
   suite drops its pretrained-loading and fx+torchscript tests and skips big models; we want every
   test on every model wherever CI runs.
4. ``pytest_collection_modifyitems`` deselects every suite case whose
   ``callspec.params["model_name"]`` is not one of ours (``model_entrypoint(arch).__module__``
   starts with ``attnzoo.``), and every suite test that has no ``model_name`` (those test timm's
   own models). Tests of our own unit-test modules are never touched. It then applies the tiers
   of ``families.py``: the core contract on every model, the heavy cases on the smallest model of
   each family, timm's own size exclusions; ``ATTNZOO_TIMM_SUITE=full`` runs everything.
5. Every suite test runs with ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` pointing at a per-run
   offline Hugging Face cache; for the two pretrained-loading tests the cache entry of the
   model's ``hf_hub_id`` is generated on demand (``hf_cache.py``: random weights of the right
   architecture, in the layout the real Hub repo has), once per run, shared by xdist workers.
"""
from __future__ import annotations

import contextlib
import fnmatch
import importlib
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from . import families, fetch

SKIP_ENV = "ATTNZOO_SKIP_TIMM_SUITE"
RUN_DIR_ENV = "ATTNZOO_TIMM_SUITE_RUN_DIR"  # per-run scratch dir (offline HF cache), shared with xdist workers
SUITE_MODULE = f"{fetch.PACKAGE_NAME}.test_models"
OUR_PACKAGE = "attnzoo"

# The suite tests that load pretrained weights (through the Hugging Face cache).
PRETRAINED_TESTS = ("test_model_load_pretrained", "test_model_features_pretrained")

# Suite tests that select their models by timm module name (see 2. above); checked after import.
MODULE_SELECTED_TESTS = ("test_model_forward_intermediates", "test_model_forward_intermediates_features",
                         "test_prune_intermediate_layers_contract")

# Markers the suite uses (timm registers them in its own pyproject.toml).
SUITE_MARKERS = {
    "base": "timm suite: model tests using the basic setup",
    "forward": "timm suite: per-model forward tests",
    "backward": "timm suite: per-model backward tests",
    "cfg": "timm suite: model config tests",
    "cfg_nonstd": "timm suite: non-standard model config tests (also marked cfg)",
    "torchscript": "timm suite: model tests using torchscript",
    "features": "timm suite: feature extraction tests",
    "fxforward": "timm suite: torch fx forward tests",
    "fxbackward": "timm suite: torch fx backward tests",
}

# Suite tests that genuinely cannot apply to a model family: {(test name, model fnmatch): reason}.
# Deselected with the reason printed at the end of collection. Never use this to hide a missing
# feature of ours. Empty: every test of the suite applies to every attnzoo model.
DESELECT: dict[tuple[str, str], str] = {}


def skip_requested() -> bool:
    return os.environ.get(SKIP_ENV, "").strip().lower() not in ("", "0", "false", "no")


# ---------------------------------------------------------------------------------------------------
# which models are ours

def is_ours(model_name: str) -> bool:
    """True for ``arch`` or ``arch.tag`` of an attnzoo model (``attnzoo.list_models``)."""
    import attnzoo

    return model_name.split(".", 1)[0] in _our_names(attnzoo)


def _our_names(attnzoo) -> frozenset:
    return frozenset(attnzoo.list_models())


def our_models() -> list[str]:
    import attnzoo

    return attnzoo.list_models()


def our_modules() -> list[str]:
    """timm's module keys of our models (timm keys a model by the last part of its module name)."""
    import timm.models

    return sorted({timm.models.model_entrypoint(m).__module__.rsplit(".", 1)[-1] for m in our_models()})


# ---------------------------------------------------------------------------------------------------
# loading the suite

@contextlib.contextmanager
def _suite_import_patches():
    import timm

    orig_list_models = timm.list_models
    ours = our_modules()
    tokens = [f"{m}*" for m in families.token_models()]  # the tags too

    def with_tokens(filters):
        # See 2b. in the module docstring: timm's non-spatial filter list (it holds 'vit_*' and
        # 'deit*') also matches our token-output models.
        if isinstance(filters, (list, tuple)) and "vit_*" in filters and "deit*" in filters:
            return list(filters) + tokens
        return filters

    def list_models(filter="", module="", pretrained=False, exclude_filters="", *args, **kwargs):
        # See 2. in the module docstring: a selection by timm module name also takes our modules.
        if module:
            mods = [module] if isinstance(module, str) else list(module)
            module = mods + [m for m in ours if m not in mods]
        return orig_list_models(with_tokens(filter), module, pretrained,
                                with_tokens(exclude_filters), *args, **kwargs)

    gha = os.environ.pop("GITHUB_ACTIONS", None)  # see 3. in the module docstring
    timm.list_models = list_models  # the suite does `from timm import list_models` at import
    try:
        yield
    finally:
        timm.list_models = orig_list_models
        if gha is not None:
            os.environ["GITHUB_ACTIONS"] = gha


def _parametrized_models(func) -> list[str]:
    for mark in getattr(func, "pytestmark", []):
        if mark.name == "parametrize" and mark.args and mark.args[0] == "model_name":
            return list(mark.args[1])
    return []


def load_suite():
    """Fetch (if needed) and import timm's test_models.py with our models registered. Returns the module."""
    if SUITE_MODULE in sys.modules:
        return sys.modules[SUITE_MODULE]
    import attnzoo  # noqa: F401  (must come before the suite's import-time parametrization)

    ours = our_models()
    if not ours:
        raise RuntimeError("attnzoo registered no models with timm: nothing for timm's suite to test")
    root = fetch.ensure_suite()
    pytest.register_assert_rewrite(fetch.PACKAGE_NAME)  # detailed assertion messages in the suite
    sys.path.insert(0, str(root))
    try:
        with _suite_import_patches():
            suite = importlib.import_module(SUITE_MODULE)
    finally:
        sys.path.remove(str(root))

    for name in MODULE_SELECTED_TESTS:
        func = getattr(suite, name, None)
        if func is None:
            continue  # gone from this timm version
        # timm leaves its biggest sizes out of some of these by name (e.g. '*huge*' from the
        # prune contract); those are size-excluded in every tier but full anyway.
        missing = sorted(m for m in set(ours) - set(_parametrized_models(func))
                         if not any(fnmatch.fnmatch(m, p) for p in families.SIZE_EXCLUDE))
        if missing:
            raise RuntimeError(
                f"timm's suite does not select {missing} for {name}: its model selection changed "
                f"(see tests/timm_suite/plugin.py, _suite_import_patches)")
    return suite


def exported_names(suite) -> dict:
    """What the entry module re-exports so pytest collects it: the suite's tests and fixtures."""
    return {k: v for k, v in vars(suite).items() if not k.startswith("__")}


def is_suite_item(item) -> bool:
    func = getattr(item, "function", None)
    return func is not None and getattr(func, "__module__", None) == SUITE_MODULE


# ---------------------------------------------------------------------------------------------------
# pytest hooks

def pytest_configure(config):
    for name, doc in SUITE_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    if not config.pluginmanager.hasplugin("timeout"):
        # The suite's @pytest.mark.timeout marks then do nothing; install pytest-timeout (dev extra).
        config.addinivalue_line("markers", "timeout(seconds): per-test timeout (needs pytest-timeout)")
    if not os.environ.get(RUN_DIR_ENV):
        # Decided here (before xdist starts its workers, which inherit the environment); created
        # only when a pretrained test needs it, removed at the end by the process that chose it.
        run_dir = Path(tempfile.gettempdir()) / f"attnzoo-timm-suite-{uuid.uuid4().hex[:12]}"
        os.environ[RUN_DIR_ENV] = str(run_dir)
        config._attnzoo_timm_suite_run_dir = run_dir


def pytest_unconfigure(config):
    run_dir = getattr(config, "_attnzoo_timm_suite_run_dir", None)
    if run_dir is not None:
        shutil.rmtree(run_dir, ignore_errors=True)
        if os.environ.get(RUN_DIR_ENV) == str(run_dir):
            del os.environ[RUN_DIR_ENV]


def _deselect_reason(item, model_name: str) -> str | None:
    test = getattr(item, "originalname", item.name)
    for (test_pat, model_pat), reason in DESELECT.items():
        if fnmatch.fnmatch(test, test_pat) and fnmatch.fnmatch(model_name, model_pat):
            return reason
    return None


@pytest.hookimpl(trylast=True)  # after -k / -m, so the counts below are what runs
def pytest_collection_modifyitems(session, config, items):
    keep, drop, documented, tiered = [], [], {}, {}
    for item in items:
        if not is_suite_item(item):
            keep.append(item)
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        model_name = params.get("model_name")
        if not isinstance(model_name, str) or not is_ours(model_name):
            drop.append(item)
            continue
        reason = _deselect_reason(item, model_name)
        if reason:
            drop.append(item)
            documented.setdefault(reason, []).append(item.name)
            continue
        reason = families.tier_reason(getattr(item, "originalname", item.name), model_name)
        if reason:
            drop.append(item)
            tiered.setdefault(reason, []).append(item.name)
            continue
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    config._attnzoo_timm_suite_documented = documented
    config._attnzoo_timm_suite_tiered = tiered
    n_suite = sum(1 for it in keep if is_suite_item(it))
    n_other = len(drop) - sum(map(len, documented.values())) - sum(map(len, tiered.values()))
    config._attnzoo_timm_suite_summary = (n_suite, n_other)


def pytest_report_collectionfinish(config, start_path, items):
    summary = getattr(config, "_attnzoo_timm_suite_summary", None)
    if not summary or not any(summary):
        return None
    lines = [f"timm suite: {summary[0]} cases on attnzoo models selected, "
             f"{summary[1]} cases on other models deselected"]
    for reason, names in getattr(config, "_attnzoo_timm_suite_documented", {}).items():
        lines.append(f"timm suite: deselected {len(names)} (does not apply: {reason}): {', '.join(names)}")
    for reason, names in getattr(config, "_attnzoo_timm_suite_tiered", {}).items():
        lines.append(f"timm suite: default tier leaves out {len(names)} ({reason}; "
                     f"{families.TIER_ENV}=full runs them)")
    return lines


@pytest.fixture(autouse=True)
def _attnzoo_timm_suite_env(request, monkeypatch):
    """Offline Hugging Face cache (and no GITHUB_ACTIONS) for every test of timm's suite."""
    if not is_suite_item(request.node):
        yield
        return
    from . import hf_cache

    import torch

    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    run_dir = Path(os.environ[RUN_DIR_ENV])
    # weights given by url are read from torch.hub's checkpoint cache, here the run's own
    previous_hub_dir = torch.hub.get_dir()
    torch.hub.set_dir(str(run_dir / "torch-hub"))
    request.addfinalizer(lambda: torch.hub.set_dir(previous_hub_dir))
    with hf_cache.offline_hf_cache(hf_cache.hub_dir(run_dir)) as hub_dir:
        weights = None
        if request.node.originalname in PRETRAINED_TESTS:
            weights = hf_cache.ensure_pretrained(request.node.callspec.params["model_name"], hub_dir)
        yield
        # One checkpoint on disk at a time; with xdist another worker may be reading it.
        if weights is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
            hf_cache.release_pretrained(weights, hub_dir)
