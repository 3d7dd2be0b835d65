"""timm ``train.py`` recipes shipped with the package: one YAML per model with a published
ImageNet-1k recipe (each file's header names its sources and the top-1 to expect). A user finds
them from the installed package alone: ``attnzoo configs`` lists them, ``attnzoo configs NAME``
prints one's path for ``train.py --config``."""
import difflib
from pathlib import Path
from typing import List

__all__ = ["recipe_names", "recipe_path", "short_job", "SHORT_JOB"]

_HERE = Path(__file__).resolve().parent


def _folder() -> Path:
    """Where the recipes are: beside this module in an installed wheel (setup.py copies them
    there), else the checkout's top-level ``configs/``, where they are written."""
    return _HERE if any(_HERE.glob("*.yaml")) else _HERE.parents[1] / "configs"


def recipe_names() -> List[str]:
    """Every recipe's name (its file's stem: a model name, with ``_phase1``/``_phase2`` for
    QUEST's two-phase DeiT III recipes), sorted."""
    return sorted(p.stem for p in _folder().glob("*.yaml"))


# models whose paper's recipe starts from ImageNet-22k pre-training that was never published
_UNPUBLISHED = ("dinat_large", "dinat_large_384", "dinat_large_11x11_384")


def recipe_path(name: str) -> Path:
    """The YAML of recipe ``name``; ``ValueError`` naming close ones otherwise."""
    path = _folder() / f"{name}.yaml"
    if not path.is_file() and name in _UNPUBLISHED:
        raise ValueError(f"no training recipe for {name}: its ImageNet-22k pre-training recipe "
                         "is unpublished (docs/training.md)")
    if not path.is_file():
        close = difflib.get_close_matches(name, recipe_names(), n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}?" if close else "`attnzoo configs` lists them"
        raise ValueError(f"no training recipe named {name!r}; {hint}")
    return path


# A short CPU job from a recipe, as train.py takes it (``attnzoo configs NAME --short``): one
# epoch without warm-up or cooldown (the cosine's floor would otherwise come after the job), fp32
# (a recipe's fp16 AMP runs some 20x slower on a CPU), a small batch, the CPU, progress every
# step. The lr is the recipe's own peak at its reference batch (``lr_base``): the linear rule at
# a small batch would put it below the recipe's ``min_lr``, and the cosine would then raise it.
SHORT_JOB = dict(epochs=1, warmup_epochs=0, cooldown_epochs=0, amp=False, device="cpu",
                 batch_size=8, validation_batch_size=8, workers=2, log_interval=1,
                 checkpoint_hist=1, aug_repeats=0)


def short_job(name: str, num_classes: int) -> str:
    """Recipe ``name`` as a short CPU job on a dataset of ``num_classes`` classes
    (:data:`SHORT_JOB`), a YAML text for ``train.py --config`` with a header saying so."""
    import yaml
    config = yaml.safe_load(recipe_path(name).read_text(encoding="utf-8"))
    overrides = dict(SHORT_JOB, num_classes=num_classes)
    if "lr" not in config and "lr_base" in config:
        overrides["lr"] = config["lr_base"]  # the peak at the recipe's reference batch
    config.update(overrides)
    header = (f"# A short CPU job from attnzoo's {name} recipe (`attnzoo configs {name} --short "
              f"--num-classes {num_classes}`): the recipe, with\n#   " + ", ".join(
                  f"{k}={v!r}" for k, v in overrides.items()) + "\n# Not the paper's recipe: "
              f"`attnzoo configs {name}` is.\n")
    return header + yaml.safe_dump(config, sort_keys=False)

