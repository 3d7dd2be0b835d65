"""Shared pytest setup.

Registers the plugin that runs timm's own test suite on our models (tests/timm_suite/plugin.py).
Registering it costs nothing: the suite is only fetched when tests/test_timm_suite.py is collected.
"""
import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)  # makes `timm_suite` importable under any --import-mode

from timm_suite import plugin as _timm_suite_plugin  # noqa: E402


def pytest_configure(config):
    if not config.pluginmanager.is_registered(_timm_suite_plugin):
        config.pluginmanager.register(_timm_suite_plugin, "attnzoo-timm-suite")
