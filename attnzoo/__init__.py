"""attnzoo: local and robust attention vision models for timm.

Importing the package registers every model with timm's registry, so that
``timm.create_model("nat_tiny")`` works after ``import attnzoo``.
"""
from . import backends, ops
from .backends import BackendUnsupportedError, get_backend, set_backend, use_backend
from . import layers, models  # noqa: F401  (models registers the models with timm)
from .models import list_models

__version__ = "0.1.0"

__all__ = ["backends", "ops", "layers", "models", "list_models", "use_backend", "set_backend",
           "get_backend", "BackendUnsupportedError", "__version__"]
