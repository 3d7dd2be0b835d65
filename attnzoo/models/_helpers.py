"""What every attnzoo model family shares: building through timm with an honest pretrained
policy, checkpoint unwrapping and checking, input checks, drop-path schedules."""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from timm.models import build_model_with_cfg, register_notrace_function
from timm.models._pretrained import PretrainedCfg
from timm.models._registry import get_pretrained_cfg

__all__ = ["build_model", "unwrap_checkpoint", "rename_key", "replace_prefix",
           "check_state_dict", "check_image_input", "per_stage"]


def _resolved_cfg(variant: str, kwargs: Dict[str, Any]) -> PretrainedCfg:
    """The pretrained cfg ``build_model_with_cfg`` will use, overlays included."""
    cfg = kwargs.get("pretrained_cfg")
    if isinstance(cfg, str):
        cfg = get_pretrained_cfg(cfg)
    elif isinstance(cfg, dict):
        cfg = PretrainedCfg(**cfg)
    if cfg is None:
        cfg = get_pretrained_cfg(variant) or PretrainedCfg()
    overlay = kwargs.get("pretrained_cfg_overlay") or {}
    return PretrainedCfg(**{**cfg.to_dict(), **overlay}) if overlay else cfg


def build_model(model_cls: type, variant: str, pretrained: bool, *,
                filter_fn: Callable[[Dict[str, Any], nn.Module], Dict[str, Any]],
                feature_cfg: Optional[Dict[str, Any]] = None, no_weights_hint: str = "",
                **kwargs) -> nn.Module:
    """``timm.models.build_model_with_cfg`` with attnzoo's pretrained policy: a tag whose
    weights are not downloadable (no ``hf_hub_id``, ``url`` or ``file``) raises instead of
    silently returning a randomly initialised model, and says where the official weights are
    and how to load them (``no_weights_hint``, where given, replaces that advice: for a family
    that has no official weights at all)."""
    if pretrained:
        cfg = _resolved_cfg(variant, kwargs)
        if not (cfg.hf_hub_id or cfg.url or cfg.file or cfg.state_dict):
            if no_weights_hint:
                raise ValueError(no_weights_hint)
            tag = f"{variant}.{cfg.tag}" if cfg.tag else variant
            origin = f" from {cfg.origin_url}" if cfg.origin_url else ""
            raise ValueError(
                f"{tag}: no downloadable weights; pretrained=True would give a randomly "
                f"initialised model. Download the official checkpoint{origin}, convert it with "
                f"`attnzoo convert {variant} CHECKPOINT {variant}.safetensors`, then load it "
                f"with timm.create_model('{tag}', pretrained=True, "
                f"pretrained_cfg_overlay=dict(file='{variant}.safetensors')).")
    return build_model_with_cfg(model_cls, variant, pretrained, pretrained_filter_fn=filter_fn,
                                feature_cfg=feature_cfg, **kwargs)


def unwrap_checkpoint(checkpoint: Dict[str, Any]) -> Dict[str, Any]:
    """The state dict inside a training checkpoint: ``{'state_dict' | 'model' | 'model_state' |
    'state_dict_ema': ...}`` wrappers are opened and DDP's ``module.`` prefixes dropped."""
    for wrapper in ("state_dict", "model", "model_state"):
        if isinstance(checkpoint.get(wrapper), dict):
            checkpoint = checkpoint[wrapper]
    return {k[len("module."):] if k.startswith("module.") else k: v
            for k, v in checkpoint.items()}


def rename_key(key: str, rules: Sequence[Tuple[str, str]]) -> str:
    """``key`` rewritten by the first ``(pattern, replacement)`` regex rule that matches it
    (unchanged where none does): how a converter maps an official layout's names to ours."""
    for pattern, replacement in rules:
        new, n = re.subn(pattern, replacement, key)
        if n:
            return new
    return key


def replace_prefix(key: str, prefixes: Sequence[Tuple[str, str]]) -> str:
    """``key`` with the first of the ``(old, new)`` prefixes it starts with replaced."""
    for old, new in prefixes:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def check_state_dict(state_dict: Dict[str, Any], model: nn.Module,
                     adaptable: Iterable[str] = (), first_conv: str = "") -> Dict[str, Any]:
    """Raise one ``ValueError`` listing every key of ``state_dict`` that is missing from, not
    in, or shaped unlike ``model``'s state dict. Keys starting with an ``adaptable`` prefix
    (the classifier, which timm adapts to ``num_classes``) are not checked, nor the input
    channels of ``first_conv`` (timm adapts them to ``in_chans``)."""
    adaptable = tuple(adaptable)
    skip = (lambda k: k.startswith(adaptable)) if adaptable else (lambda k: False)
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in state_dict and not skip(k))
    unexpected = sorted(k for k in state_dict if k not in expected and not skip(k))
    mismatched = []
    for k, v in state_dict.items():
        if k not in expected or skip(k):
            continue
        want, have = tuple(expected[k].shape), tuple(getattr(v, "shape", ()))
        if have == want:
            continue
        if first_conv and k == first_conv + ".weight" and len(have) == 4 \
                and have[:1] + have[2:] == want[:1] + want[2:]:
            continue
        mismatched.append(f"{k}: checkpoint {have} vs model {want}")
    if missing or unexpected or mismatched:
        lines = []
        if missing:
            lines.append(f"missing from the checkpoint ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"not in the model ({len(unexpected)}): {', '.join(unexpected)}")
        if mismatched:
            lines.append(f"shape mismatch ({len(mismatched)}): {'; '.join(mismatched)}")
        raise ValueError(f"checkpoint does not match {type(model).__name__} "
                         "(wrong variant, kernel size or depth?):\n  " + "\n  ".join(lines))
    return state_dict


@register_notrace_function
def check_image_input(x: torch.Tensor, in_chans: int, min_size: int = 1) -> torch.Tensor:
    """Reject non-image input, wrong channels and images below the architecture's minimum with
    a clear ``ValueError`` (a plain function: FX keeps it as a leaf)."""
    if x.dim() != 4:
        raise ValueError(f"expected a 4-D NCHW image batch [B, in_chans, H, W], got a "
                         f"{x.dim()}-D tensor of shape {list(x.shape)}")
    if x.shape[1] != in_chans:
        raise ValueError(f"the model was built with in_chans={in_chans} but the input has "
                         f"{x.shape[1]} channels (shape {list(x.shape)}); pass in_chans= "
                         f"to create_model to change it")
    if x.shape[2] < min_size or x.shape[3] < min_size:
        raise ValueError(f"input images must be at least {min_size}x{min_size} pixels for this "
                         f"architecture, got {x.shape[2]}x{x.shape[3]}")
    return x


def per_stage(value: Any, num_stages: int, name: str) -> list:
    """``value`` repeated per stage, or checked to have one entry per stage."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_stages:
            raise ValueError(f"{name} needs one entry per stage ({num_stages}), got {value!r}")
        return list(value)
    return [value] * num_stages

