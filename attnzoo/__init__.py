"""attnzoo: local and robust attention vision models for timm.

Importing the package registers every model with timm's registry, so that
``timm.create_model("nat_tiny")`` works after ``import attnzoo``.

It checks timm first: a timm older than ``TIMM_FLOOR`` (pyproject.toml's floor) fails here, in
one message naming the timm found and where, instead of an ImportError deep inside. The usual
cause is a timm clone's own ``timm/`` folder, which Python puts first on ``sys.path`` when a
script runs from the clone.
"""
import os
import sys

__version__ = "0.1.0"
TIMM_FLOOR = "1.0.29"


def _import_timm():
    # `python -m attnzoo` (and `torchrun -m attnzoo timm train.py`) runs with the current folder
    # first on sys.path while this package is imported: inside a timm clone, the clone's timm/.
    # The command line takes timm from the installed packages, as `python -P` would.
    cwd_first = sys.argv[:1] == ["-m"] and sys.path[:1] in ([""], [os.getcwd()])
    if cwd_first:
        entry = sys.path.pop(0)
    try:
        import timm
    finally:
        if cwd_first:
            sys.path.insert(0, entry)
    from packaging.version import Version
    if Version(timm.__version__) < Version(TIMM_FLOOR):
        raise ImportError(
            f"attnzoo {__version__} needs timm >= {TIMM_FLOOR}, found timm {timm.__version__} at "
            f"{os.path.dirname(os.path.abspath(timm.__file__))}. Install a newer one "
            f"(pip install -U \"timm>={TIMM_FLOOR}\"); if that folder is a timm clone's own "
            "timm/ (Python puts a script's folder first on sys.path), run the script with "
            "`python -P` or PYTHONSAFEPATH=1, or as `python -m attnzoo timm SCRIPT ...`.")


_import_timm()

from . import backends, ops  # noqa: E402
from .backends import BackendUnsupportedError, get_backend, set_backend, use_backend  # noqa: E402
from . import layers, models  # noqa: F401,E402  (models registers the models with timm)
from .models import list_models  # noqa: E402
from .layers import AttentionMap, attention_maps, record_attention  # noqa: E402

__all__ = ["backends", "ops", "layers", "models", "list_models", "use_backend", "set_backend",
           "get_backend", "BackendUnsupportedError", "AttentionMap", "attention_maps",
           "record_attention", "TIMM_FLOOR", "__version__"]
