"""Which timm models are attnzoo's: the one definition, used by the CLI, the model cards and the
tests."""
from __future__ import annotations

import fnmatch
from typing import Callable, Dict, List, Union

import timm
from timm.models import register_model as _timm_register_model

__all__ = ["register_model", "list_models", "model_family"]

# model name -> family (the model module's short name, e.g. "nat"), in registration order
_FAMILIES: Dict[str, str] = {}


def register_model(fn: Callable) -> Callable:
    """timm's ``register_model``, also recording the model as attnzoo's, of the family named by
    its module (``attnzoo.models.nat`` -> ``nat``). Decorate each variant's entrypoint with it,
    ``@register_model def nat_tiny(pretrained=False, **kwargs) -> NAT``, as timm's do."""
    fn = _timm_register_model(fn)
    _FAMILIES[fn.__name__] = fn.__module__.rsplit(".", 1)[-1]
    return fn


def list_models(filter: Union[str, List[str]] = "", pretrained: bool = False,
                family: str = "") -> List[str]:
    """attnzoo's model names (sorted), or with ``pretrained=True`` their pretrained tags
    (``nat_mini.in1k``); ``filter`` is a wildcard or a list of them, ``family`` a model module
    (``nat``, ``qna_vit``, ``san``, ``quest_vit``)."""
    families = sorted(set(_FAMILIES.values()))
    if family and family not in families:
        raise ValueError(f"family must be one of {', '.join(families)}, got {family!r}")
    names = [n for n, f in _FAMILIES.items() if not family or f == family]
    if pretrained:
        names = timm.list_models(names, pretrained=True) if names else []
    filters = [filter] if isinstance(filter, str) else list(filter)
    if any(filters):  # a tag matches by its own name or its model's, as in timm.list_models
        names = [n for n in names if any(fnmatch.fnmatch(n, f) or fnmatch.fnmatch(
            n.split(".", 1)[0], f) for f in filters if f)]
    return sorted(names)


def model_family(name: str) -> str:
    """The family of an attnzoo model name or tag (``KeyError`` for other models)."""
    return _FAMILIES[name.split(".", 1)[0]]
