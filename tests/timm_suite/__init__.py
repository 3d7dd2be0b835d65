"""Run timm's own ``tests/test_models.py`` (from the installed timm version's sdist) on attnzoo's models.

- ``fetch.py``: downloads the sdist with pip into a cache outside the repo, extracts ``tests/``.
- ``plugin.py``: the pytest plugin (registered by ``tests/conftest.py``): imports attnzoo before the
  suite parametrizes itself, patches the suite's module-based model selection to include ours,
  deselects every case that is not about one of our models, runs the suite offline against a
  generated Hugging Face cache.
- ``hf_cache.py``: lays out that offline cache with random weights in each hf_hub_id's real layout.
- ``tests/test_timm_suite.py``: the entry module that pytest collects.
"""
