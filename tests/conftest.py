"""Shared pytest setup.

Registers the plugin that runs timm's own test suite on our models (tests/timm_suite/plugin.py).
Registering it costs nothing: the suite is only fetched when tests/test_timm_suite.py is collected.

Without a GPU, attnzoo's Triton kernels (the ``cuda`` backend) are checked under Triton's
interpreter on CPU tensors. Triton decides interpreted or compiled when a kernel module is
imported (``@triton.jit``), so every kernel module is imported here, first, with
TRITON_INTERPRET=1, and the variable is then restored: the ``cuda`` backend accepts CPU tensors
only while it is set, which the kernel tests do for themselves (tests/test_kernels_*.py), so no
other test sees a different backend behaviour (an explicit ``cuda`` on CPU stays an error).
With a GPU the kernels compile and the same tests run them on CUDA tensors.
"""
import importlib
import os
import pkgutil
import sys
from pathlib import Path

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


if not torch.cuda.is_available():
    _import_kernels_interpreted()

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)  # makes `timm_suite` importable under any --import-mode

from timm_suite import plugin as _timm_suite_plugin  # noqa: E402


def pytest_configure(config):
    if not config.pluginmanager.is_registered(_timm_suite_plugin):
        config.pluginmanager.register(_timm_suite_plugin, "attnzoo-timm-suite")
