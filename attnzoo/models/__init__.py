"""Model families; importing a module registers its models with timm."""
from . import nat  # noqa: F401
