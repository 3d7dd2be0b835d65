"""What every attnzoo model family shares: building through timm with an honest pretrained
policy (the project's Hub namespace, a clear error where weights cannot be had), checkpoint
unwrapping and checking, input checks, drop-path schedules."""
from __future__ import annotations

import argparse
import numbers
import os
import re
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from timm.models import build_model_with_cfg, register_notrace_function
from timm.models._builder import _resolve_pretrained_source
from timm.models._hub import HF_WEIGHTS_NAME, _get_safe_alternatives, hf_split
from timm.models._pretrained import PretrainedCfg
from timm.models._registry import get_pretrained_cfg

from ..layers._checks import check_sizes
from ._weights import HUB_ORG, hub_repo, pending_repo

__all__ = ["HUB_ORG", "hub_repo", "checkpoint_kind", "build_model", "unwrap_checkpoint",
           "rename_key", "replace_prefix", "check_state_dict", "check_image_input", "per_stage",
           "check_indices"]


def checkpoint_kind(path) -> Optional[str]:
    """``'torch'`` or ``'safetensors'`` by the file's first bytes, else None (e.g. an official
    Flax checkpoint, which needs ``attnzoo convert`` first)."""
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04" or (len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return "torch"  # torch.save: a zip archive, or a pickle (PROTO opcode, protocol 2-5)
    # safetensors: little-endian u64 header length, then the JSON header
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") > 1:
        return "safetensors"
    return None


def _resolved_cfg(variant: str, kwargs: Dict[str, Any]) -> PretrainedCfg:
    """The pretrained cfg ``build_model_with_cfg`` will use, overlays included."""
    cfg = kwargs.get("pretrained_cfg")
    if isinstance(cfg, str):  # a tag (timm's create_model splits "name.tag"): an unknown one
        cfg = get_pretrained_cfg(f"{variant}.{cfg}")  # raises timm's "Invalid pretrained tag"
    elif isinstance(cfg, dict):
        cfg = PretrainedCfg(**cfg)
    if cfg is None:
        cfg = get_pretrained_cfg(variant) or PretrainedCfg()
    overlay = kwargs.get("pretrained_cfg_overlay") or {}
    return PretrainedCfg(**{**cfg.to_dict(), **overlay}) if overlay else cfg


def _local_copy_advice(tag: str, variant: str, where: str) -> str:
    return (f"Download {where}, convert it with `attnzoo convert {variant} CHECKPOINT "
            f"{variant}.safetensors`, then load it with timm.create_model('{tag}', "
            f"pretrained=True, pretrained_cfg_overlay=dict(file='{variant}.safetensors')).")


def _hub_problem(repo: str, filenames: Sequence[str]) -> Optional[str]:
    """Why none of ``filenames`` can be fetched from Hub repo ``repo`` (``ORG/NAME[@rev]``)
    now, or None when one is cached or reachable: one request, no retries (the client retries
    a missing file's lookup for about a minute before it gives up)."""
    import huggingface_hub as hf
    from huggingface_hub import constants
    from huggingface_hub.utils import (EntryNotFoundError, GatedRepoError,
                                       RepositoryNotFoundError, RevisionNotFoundError)
    repo_id, revision = hf_split(repo)
    if any(isinstance(hf.try_to_load_from_cache(repo_id, f, revision=revision), str)
           for f in filenames):
        return None
    if constants.HF_HUB_OFFLINE:
        return "offline: HF_HUB_OFFLINE is set and the local Hugging Face cache has no copy"
    for filename in filenames:
        try:
            hf.get_hf_file_metadata(hf.hf_hub_url(repo_id, filename, revision=revision))
            return None
        except GatedRepoError:
            return ("the repo is gated: accept its conditions on the Hub and log in "
                    "(`huggingface-cli login` or HF_TOKEN)")
        except RepositoryNotFoundError:
            return ("not found: the repo does not exist (yet), or it is private and no valid "
                    "token was given (`huggingface-cli login` or HF_TOKEN)")
        except RevisionNotFoundError:
            return f"the repo has no revision {revision!r}"
        except EntryNotFoundError:
            continue
        except Exception as e:  # noqa: BLE001 - network errors differ per client version
            detail = ' '.join(str(e).split())[:200]
            return f"the Hub cannot be reached ({type(e).__name__}: {detail})"
    return f"the repo has none of {', '.join(filenames)}"


def _check_hub_weights(tag: str, variant: str, cfg: PretrainedCfg) -> None:
    """Raise one clear ``OSError`` when timm would fetch the weights from the Hub and cannot:
    the repo, why (offline, not found, no token, unreachable) and how to load a local copy."""
    load_from, location = _resolve_pretrained_source(cfg.to_dict())
    if load_from != 'hf-hub':
        return
    repo, filename = location if isinstance(location, tuple) else (location, HF_WEIGHTS_NAME)
    filenames = [filename] if filename.endswith('.safetensors') else [
        *_get_safe_alternatives(filename), filename]
    why = _hub_problem(repo, filenames)
    if why is None:
        return
    where = f"{' or '.join(filenames)} from https://huggingface.co/{hf_split(repo)[0]}"
    if cfg.origin_url and 'huggingface.co' not in cfg.origin_url:
        where += f" (or the official checkpoint from {cfg.origin_url})"
    raise OSError(f"{tag}: cannot load its weights from the Hugging Face Hub repo {repo}: "
                  f"{why}. " + _local_copy_advice(tag, variant, where + " where it is reachable"))


def _check_local_file(tag: str, variant: str, path, source: Optional[str] = None) -> None:
    """A ``file=`` overlay that timm cannot load (missing, a folder, or not a torch /
    safetensors file: an unconverted official checkpoint) raises here, naming the file and the
    fix, instead of an error from deep inside ``torch.load``. (timm's ``local-dir:`` passes its
    folder as the file, with ``source='local-dir'``: its own.)"""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{tag}: pretrained_cfg_overlay file {path!r} does not exist")
    if os.path.isdir(path) and source != "local-dir":
        raise IsADirectoryError(
            f"{tag}: pretrained_cfg_overlay file {path!r} is a folder; give its checkpoint "
            f"file, or load a published model's folder as timm.create_model('local-dir:{path}')")
    if os.path.isfile(path) and not path.endswith(".safetensors") \
            and checkpoint_kind(path) is None:
        raise ValueError(
            f"{tag}: pretrained_cfg_overlay file {path!r} is not a torch or safetensors "
            f"checkpoint (an official checkpoint in another format?); convert it first with "
            f"`attnzoo convert {variant} {path} {variant}.safetensors` and pass "
            f"file='{variant}.safetensors'")


def _classifier_rows(path: str, name: str) -> Optional[int]:
    """Rows of tensor ``name`` in checkpoint ``path`` (a plain state dict, or ``train.py``'s
    with its ``state_dict``), read without its data; None where it has none or cannot be read
    here (timm's own load then says why)."""
    try:
        if path.endswith(".safetensors") or checkpoint_kind(path) == "safetensors":
            from safetensors import safe_open
            with safe_open(path, "pt") as f:
                return f.get_slice(name).get_shape()[0] if name in f.keys() else None
        torch.serialization.add_safe_globals([argparse.Namespace])  # train.py's args
        checkpoint = torch.load(path, map_location="meta", weights_only=True)
    except Exception:  # noqa: BLE001 - not ours to report
        return None
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), dict):
        checkpoint = checkpoint["state_dict"]
    weight = checkpoint.get(name) if isinstance(checkpoint, dict) else None
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() else None


def _keep_a_trained_head(kwargs: Dict[str, Any], cfg: PretrainedCfg) -> None:
    """timm drops a checkpoint's classifier when ``num_classes`` differs from the pretrained
    cfg's (a tag's 1000 ImageNet classes): right for ImageNet weights fine-tuned to new
    classes, but a ``file=`` checkpoint trained on those very classes (a first training phase)
    would get a random head, silently. Where the file's classifier has ``num_classes`` rows,
    the cfg is told so, and timm keeps it."""
    classes = kwargs.get("num_classes")
    if classes is None or classes == cfg.num_classes or not cfg.classifier:
        return
    classifier = cfg.classifier if isinstance(cfg.classifier, str) else cfg.classifier[0]
    if _classifier_rows(os.fspath(cfg.file), f"{classifier}.weight") == classes:
        kwargs["pretrained_cfg_overlay"] = {**(kwargs.get("pretrained_cfg_overlay") or {}),
                                            "num_classes": classes}


def build_model(model_cls: type, variant: str, pretrained: bool, *,
                filter_fn: Callable[[Dict[str, Any], nn.Module], Dict[str, Any]],
                feature_cfg: Optional[Dict[str, Any]] = None, no_weights_hint: str = "",
                **kwargs) -> nn.Module:
    """``timm.models.build_model_with_cfg`` with attnzoo's pretrained policy: a tag whose
    weights are not downloadable (no ``hf_hub_id``, ``url`` or ``file``) raises instead of
    silently returning a randomly initialised model, and says where the official weights are
    and how to load them (``no_weights_hint``, where given, replaces that advice: for a family
    that has no official weights at all); a tag whose Hub weights cannot be fetched (offline,
    no such repo yet, no token) raises one ``OSError`` naming the repo, why, and the same
    advice, before timm's client would retry. ``in_chans`` and the drop rates are checked
    first (a bad one would fail later, in a layer, without its name)."""
    _check_build_args(variant, kwargs)
    if pretrained:
        cfg = _resolved_cfg(variant, kwargs)
        tag = f"{variant}.{cfg.tag}" if cfg.tag else variant
        if not (cfg.hf_hub_id or cfg.url or cfg.file or cfg.state_dict):
            if no_weights_hint:
                raise ValueError(no_weights_hint)
            origin = f" from {cfg.origin_url}" if cfg.origin_url else ""
            pending = pending_repo(tag)
            why = (f"its weights are not on the Hugging Face Hub yet (they are to be published "
                   f"as {pending})" if pending else "no downloadable weights")
            raise ValueError(
                f"{tag}: {why}; pretrained=True would give a randomly initialised model. "
                + _local_copy_advice(tag, variant, f"the official checkpoint{origin}"))
        if cfg.file:
            _check_local_file(tag, variant, cfg.file, cfg.source)
            _keep_a_trained_head(kwargs, cfg)
        _check_hub_weights(tag, variant, cfg)
    return build_model_with_cfg(model_cls, variant, pretrained, pretrained_filter_fn=filter_fn,
                                feature_cfg=feature_cfg, **kwargs)


# the drop rates a family may take (some are only the ViT's), each a probability: a bad one
# failed far from its argument (drop path: in the first training forward's bernoulli_)
_RATES = ("drop_rate", "drop_path_rate", "attn_drop_rate", "proj_drop_rate", "pos_drop_rate")


def _check_build_args(variant: str, kwargs: Dict[str, Any]) -> None:
    if kwargs.get("in_chans") is not None:
        check_sizes(variant, in_chans=kwargs["in_chans"])
    for name in _RATES:
        rate = kwargs.get(name)
        if rate is None:
            continue
        if isinstance(rate, bool) or not isinstance(rate, (int, float)):
            raise TypeError(f"{variant}: {name} must be a number, got {type(rate).__name__} "
                            f"{rate!r}")
        if not 0 <= rate < 1:
            raise ValueError(f"{variant}: {name} must be in [0, 1), got {rate}")


def check_indices(argument: str, indices: Any, n: int, what: str = "stages",
                  increasing: bool = False) -> Any:
    """``indices`` as timm's ``feature_take_indices`` takes them for ``n`` features (``None``:
    all; an int: the last that many; a sequence or array of ints, NumPy's too: those, negative
    from the end), else a ``ValueError`` / ``TypeError`` naming ``argument`` and what is
    accepted (timm's own assertion gave a converted index, and a list index error said
    nothing). ``increasing``: a sequence must name distinct features in increasing order
    (``features_only``'s ``out_indices``: a feature wrapper returns them in the model's order,
    once each, while its ``feature_info`` lists them as given). Returns them as timm takes
    them: Python ints (a NumPy integer is not timm's "last n")."""
    accepted = (f"accepted: None (all), an int from 1 to {n} (the last that many) or a "
                f"sequence of ints from {-n} to {n - 1}, for the {n} {what}")
    if indices is None:
        return None
    if _integral(indices):
        if not 1 <= indices <= n:
            raise ValueError(f"{argument}={indices}: {accepted}")
        return int(indices)
    if hasattr(indices, "tolist") and not isinstance(indices, torch.Tensor):  # NumPy arrays
        indices = indices.tolist()
    if not isinstance(indices, Sequence) or isinstance(indices, str) or not all(
            _integral(i) for i in indices):
        raise TypeError(f"{argument}={indices!r}: {accepted}")
    if not indices or any(not -n <= i < n for i in indices):
        raise ValueError(f"{argument}={indices!r}: {accepted}")
    positions = [i % n for i in indices]
    if increasing and positions != sorted(set(positions)):
        raise ValueError(f"{argument}={indices!r}: name distinct {what} in increasing order "
                         f"(the features come out in the model's order, once each), e.g. "
                         f"{sorted(set(positions))}")
    return tuple(int(i) for i in indices)


def _integral(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


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
            lines.append(f"missing from the checkpoint ({len(missing)}): {_first(missing, ', ')}")
        if unexpected:
            lines.append(f"not in the model ({len(unexpected)}): {_first(unexpected, ', ')}")
        if mismatched:
            lines.append(f"shape mismatch ({len(mismatched)}): {_first(mismatched, '; ')}")
        raise ValueError(f"checkpoint does not match {type(model).__name__} "
                         "(wrong variant, kernel size or depth?):\n  " + ";\n  ".join(lines))
    return state_dict


def _first(items: List[str], sep: str, shown: int = 4) -> str:
    """The first ``shown`` of ``items``, and how many more: an error line stays readable when a
    checkpoint of another model misses every key."""
    more = len(items) - shown
    return sep.join(items[:shown]) + (f"{sep}and {more} more" if more > 0 else "")


def check_attn_drop_rate(rate: float, family: str, why: str) -> None:
    """``attn_drop_rate`` (timm's name for attention-weight dropout, which its ViTs take): a
    family whose attention cannot drop its weights refuses any rate but 0 in one line, saying
    ``why`` and what to use instead; 0 builds the model as without it."""
    if rate:
        raise ValueError(f"attn_drop_rate={rate}: {family} has no attention-weight dropout: "
                         f"{why} (use drop_path_rate, or proj_drop_rate where the model has it)")


@register_notrace_function
def check_image_input(x: torch.Tensor, in_chans: int, min_size: int = 1,
                      min_size_hint: str = "") -> torch.Tensor:
    """Reject non-image input, wrong channels and images below the architecture's minimum with
    a clear ``ValueError`` (a plain function: FX keeps it as a leaf); ``min_size_hint`` ends
    the last message (how to lower the minimum)."""
    if x.dim() != 4:
        raise ValueError(f"expected a 4-D NCHW image batch [B, in_chans, H, W], got a "
                         f"{x.dim()}-D tensor of shape {list(x.shape)}")
    if x.shape[1] != in_chans:
        raise ValueError(f"the model was built with in_chans={in_chans} but the input has "
                         f"{x.shape[1]} channels (shape {list(x.shape)}); pass in_chans= "
                         f"to create_model to change it")
    if x.shape[2] < min_size or x.shape[3] < min_size:
        raise ValueError(f"input images must be at least {min_size}x{min_size} pixels for this "
                         f"architecture, got {x.shape[2]}x{x.shape[3]}{min_size_hint}")
    return x


def per_stage(value: Any, num_stages: int, name: str) -> list:
    """``value`` repeated per stage, or checked to have one entry per stage."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_stages:
            raise ValueError(f"{name} needs one entry per stage ({num_stages}), got {value!r}")
        return list(value)
    return [value] * num_stages

