"""Which timm models are attnzoo's: the one definition, used by the CLI, the model cards and the
tests."""
from __future__ import annotations

import fnmatch
from typing import Any, Callable, Dict, List, Mapping, Tuple, Union

import timm
from timm.models import register_model as _timm_register_model

__all__ = ["register_model", "register_variants", "list_models"]

# model name -> family (the model module's short name, e.g. "nat"), in registration order
_FAMILIES: Dict[str, str] = {}


def register_model(fn: Callable) -> Callable:
    """timm's ``register_model``, also recording the model as attnzoo's (and its family)."""
    fn = _timm_register_model(fn)
    _FAMILIES[fn.__name__] = fn.__module__.rsplit(".", 1)[-1]
    return fn


def register_variants(namespace: Dict[str, Any], create: Callable[..., Any],
                      variants: Mapping[str, Tuple[str, Dict[str, Any]]]) -> None:
    """Register one timm entrypoint per variant, ``name(pretrained=False, **kwargs)`` returning
    ``create(name, pretrained, **config, **kwargs)`` (the caller's kwargs override the config),
    defined in ``namespace`` (the family module's ``globals()``) so that
    ``from attnzoo.models.nat import nat_tiny`` works. ``variants``: name -> (docstring, config)."""
    def make(name: str, doc: str, config: Dict[str, Any]) -> Callable:
        def entrypoint(pretrained: bool = False, **kwargs):
            return create(name, pretrained, **dict(config, **kwargs))
        entrypoint.__name__ = entrypoint.__qualname__ = name
        entrypoint.__doc__ = doc
        entrypoint.__module__ = namespace["__name__"]
        return entrypoint

    for name, (doc, config) in variants.items():
        namespace[name] = register_model(make(name, doc, config))


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
    if any(filters):
        names = [n for n in names if any(fnmatch.fnmatch(n, f) for f in filters if f)]
    return sorted(names)


def model_family(name: str) -> str:
    """The family of an attnzoo model name or tag (``KeyError`` for other models)."""
    return _FAMILIES[name.split(".", 1)[0]]
