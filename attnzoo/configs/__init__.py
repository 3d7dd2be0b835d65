"""timm ``train.py`` recipes shipped with the package: one YAML per model with a published
ImageNet-1k recipe (each file's header names its sources and the top-1 to expect). A user finds
them from the installed package alone: ``attnzoo configs`` lists them, ``attnzoo configs NAME``
prints one's path for ``train.py --config``."""
import difflib
from pathlib import Path
from typing import List

__all__ = ["recipe_names", "recipe_path"]

_HERE = Path(__file__).resolve().parent


def _folder() -> Path:
    """Where the recipes are: beside this module in an installed wheel (setup.py copies them
    there), else the checkout's top-level ``configs/``, where they are written."""
    return _HERE if any(_HERE.glob("*.yaml")) else _HERE.parents[1] / "configs"


def recipe_names() -> List[str]:
    """Every recipe's name (its file's stem: a model name, with ``_phase1``/``_phase2`` for
    QUEST's two-phase DeiT III recipes), sorted."""
    return sorted(p.stem for p in _folder().glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """The YAML of recipe ``name``; ``ValueError`` naming close ones otherwise."""
    path = _folder() / f"{name}.yaml"
    if not path.is_file():
        close = difflib.get_close_matches(name, recipe_names(), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else "`attnzoo configs` lists them"
        raise ValueError(f"no training recipe named {name!r}; {hint}")
    return path
