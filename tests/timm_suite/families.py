"""Per-family metadata for running timm's suite on attnzoo's models, and the suite's tiers.

Tiers (``ATTNZOO_TIMM_SUITE``):

- default: every model gets the core contract (``CORE_TESTS``: forward, backward, default cfg,
  features, torchscript, pretrained loading, wherever timm's suite runs them); every other case of
  the suite (FX, intermediates, the prune contract, ...) runs on the smallest model of each
  family; models matching ``SIZE_EXCLUDE`` (the patterns timm's own CI excludes for its biggest
  models) are left out as timm leaves out its own. Pretrained loading of a tag in the project's
  Hub namespace (``attnzoo/*``: timm-native files that ``attnzoo publish`` writes, no layout
  converted on load; tests/test_hub.py checks them per family) runs on the smallest model of
  each family too.
- ``full``: every case on every model.

Families: every attnzoo model family (``attnzoo.models.model_family``) must be listed in
``FAMILIES``; a new family without an entry fails loudly instead of being tested with another
family's assumptions. Input sizes come from each model's pretrained cfg (``input_size``,
``min_input_size``), which timm's suite itself reads.
"""
from __future__ import annotations

import fnmatch
import functools
import os
from dataclasses import dataclass
from typing import Dict, List

TIER_ENV = "ATTNZOO_TIMM_SUITE"


@dataclass(frozen=True)
class Family:
    # ViT-like token output ([B, N, C]): timm's suite must treat these models as non-spatial,
    # i.e. match them with its NON_STD_FILTERS as it matches vit_* / deit*.
    token_output: bool = False


FAMILIES: Dict[str, Family] = {
    "nat": Family(),
    "qna_vit": Family(),
    "san": Family(),
    "quest_vit": Family(token_output=True),
}

# The suite cases every model runs in the default tier.
CORE_TESTS = frozenset({
    "test_model_forward", "test_model_backward", "test_model_default_cfgs",
    "test_model_default_cfgs_non_std", "test_model_forward_features",
    "test_model_forward_torchscript", "test_model_load_pretrained",
})

# The smallest NAT and DiNAT models: timm's suite on them is in the `floor` test tier (CI runs it
# on the lowest torch and timm admitted, .ci/floor; tests/conftest.py marks the cases).
FLOOR_MODELS = ("nat_mini", "dinat_mini")

# timm's own CI leaves its biggest models out of the suite by these name patterns
# (test_models.py, under GITHUB_ACTIONS); ours get the same treatment in the default tier.
SIZE_EXCLUDE = ("*huge*", "*giant*", "*gigantic*", "*enormous*", "*_1b_*", "*_3b_*", "*_5b_*",
                "*_7b_*")


def full_run() -> bool:
    return os.environ.get(TIER_ENV, "").strip().lower() == "full"


def family(model_name: str) -> Family:
    from attnzoo.models import model_family

    name = model_family(model_name)
    if name not in FAMILIES:
        raise RuntimeError(f"attnzoo family {name!r} has no entry in tests/timm_suite/families.py "
                           "FAMILIES: say how timm's suite must treat its models")
    return FAMILIES[name]


def token_models() -> List[str]:
    """Our models with token output, for timm's non-spatial filters."""
    import attnzoo

    return [m for m in attnzoo.list_models() if family(m).token_output]


@functools.lru_cache(maxsize=None)
def smallest_per_family() -> Dict[str, str]:
    """Family -> its model with the fewest parameters (built on the meta device)."""
    import timm

    import attnzoo
    from attnzoo.models import model_family

    best: Dict[str, tuple] = {}
    for name in attnzoo.list_models():
        params = sum(p.numel() for p in timm.create_model(name, device="meta").parameters())
        fam = model_family(name)
        if fam not in best or (params, name) < best[fam]:
            best[fam] = (params, name)
    return {fam: name for fam, (_, name) in best.items()}


def _in_project_namespace(model_name: str) -> bool:
    import timm

    from attnzoo.models._helpers import HUB_ORG

    cfg = timm.get_pretrained_cfg(model_name)
    return bool(cfg and cfg.hf_hub_id and cfg.hf_hub_id.startswith(f"{HUB_ORG}/"))


def tier_reason(test_name: str, model_name: str) -> str | None:
    """Why the default tier leaves this case out (None: it runs)."""
    if full_run():
        return None
    arch = model_name.split(".", 1)[0]
    if any(fnmatch.fnmatch(arch, p) for p in SIZE_EXCLUDE):
        return "size exclusion, as timm's CI excludes its own biggest models"
    if test_name in CORE_TESTS and not (test_name == "test_model_load_pretrained"
                                        and _in_project_namespace(model_name)):
        return None
    from attnzoo.models import model_family

    if smallest_per_family()[model_family(arch)] != arch:
        return "heavy case, run on the smallest model of the family"
    return None
