"""attnzoo: local and robust attention vision models for timm.

Importing the package registers every model with timm's registry, so that
``timm.create_model("nat_tiny")`` works after ``import attnzoo``.

It checks timm first: a timm older than ``TIMM_FLOOR`` (pyproject.toml's floor) fails here, in
one message naming the timm found and where, instead of an ImportError deep inside. The usual
cause is a timm clone's own ``timm/`` folder, which Python puts first on ``sys.path`` when a
script runs from the clone. A torchvision of another build than torch (PyPI's CUDA torchvision
beside a CPU torch), which stops ``import timm``, is named likewise. From the command line each
is one line and exit status 2.
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
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        _stop(_torchvision_mismatch(e))
    finally:
        if cwd_first:
            sys.path.insert(0, entry)
    from packaging.version import Version
    if Version(timm.__version__) < Version(TIMM_FLOOR):
        _stop(
            f"attnzoo {__version__} needs timm >= {TIMM_FLOOR}, found timm {timm.__version__} at "
            f"{os.path.dirname(os.path.abspath(timm.__file__))}. Install a newer one "
            f"(pip install -U \"timm>={TIMM_FLOOR}\"); if that folder is a timm clone's own "
            "timm/ (Python puts a script's folder first on sys.path), run the script with "
            "`python -P` or PYTHONSAFEPATH=1, or as `python -m attnzoo timm SCRIPT ...`.")


def _torchvision_mismatch(error: BaseException) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        found = f"torchvision {version('torchvision')}"
    except PackageNotFoundError:
        found = "torchvision"
    import torch
    index = ("https://download.pytorch.org/whl/cpu" if "+cpu" in torch.__version__ else
             "the index your torch came from")
    return (f"timm cannot be imported: {found} does not match torch {torch.__version__} "
            f"({str(error).splitlines()[0]}). Install torchvision from the same index as torch: "
            f"pip install torchvision --index-url {index} (README, Install)")


def _stop(message: str) -> None:
    """An install that cannot work: from the command line (``attnzoo ...``, ``python -m
    attnzoo``), one line and exit status 2, as every user mistake; imported, an ImportError."""
    if os.path.basename(sys.argv[0]).startswith("attnzoo") or sys.argv[:1] == ["-m"]:
        print(f"attnzoo: error: {message}", file=sys.stderr)
        raise SystemExit(2)
    raise ImportError(message)


_import_timm()

def _quiet_tracer_warnings() -> None:
    """torch.jit.trace (the TorchScript ONNX exporter's, timm's onnx_export.py's) warns at every
    Python use of a traced size: attnzoo's argument checks and constants of fixed sizes (head
    dims, kernel sizes), where baking the answer in is meant; while exporting, the ops run
    formulas that follow the input's size (backends.exporting), checked at other sizes by the
    export tests. Only the warnings attributed to attnzoo's own modules are left out."""
    import warnings

    import torch
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=r"attnzoo(\.|$)")


_quiet_tracer_warnings()

from . import backends, ops  # noqa: E402
from .backends import BackendUnsupportedError, get_backend, set_backend, use_backend  # noqa: E402
from . import layers, models  # noqa: F401,E402  (models registers the models with timm)
from .models import list_models  # noqa: E402
from .layers import AttentionMap, attention_maps, record_attention  # noqa: E402

__all__ = ["backends", "ops", "layers", "models", "list_models", "use_backend", "set_backend",
           "get_backend", "BackendUnsupportedError", "AttentionMap", "attention_maps",
           "record_attention", "TIMM_FLOOR", "__version__"]
