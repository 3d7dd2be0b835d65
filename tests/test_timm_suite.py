"""timm's own tests/test_models.py, run against every attnzoo model.

The suite is NOT in this repository: it is taken from the sdist of the installed timm version on the
package index (downloaded once into ~/.cache/attnzoo or $ATTNZOO_CACHE, see tests/timm_suite/fetch.py)
when this module is collected. Its tests are re-exported here so pytest collects them under this
module; tests/timm_suite/plugin.py (registered by tests/conftest.py) deselects every case that is
not about one of our models and runs the rest offline. See tests/timm_suite/plugin.py for details.

Every case is in the ``timm_suite`` test tier (``-m "not timm_suite"`` leaves the suite out once
collected; ATTNZOO_SKIP_TIMM_SUITE=1 does not even fetch it, for quick local runs). CI runs
everything.
"""
import pytest

from timm_suite import plugin

if plugin.skip_requested():
    pytest.skip(f"{plugin.SKIP_ENV} is set: timm's own test suite not run", allow_module_level=True)

globals().update(plugin.exported_names(plugin.load_suite()))
pytestmark = pytest.mark.timm_suite  # timm's test_models.py sets no module marks of its own
