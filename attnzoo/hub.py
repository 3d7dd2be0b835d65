"""Checkpoints in, Hugging Face Hub folders out: conversion, safetensors export, publishing and
model cards, in one place.

Conversion (``attnzoo convert``)
    :func:`load_official` reads any checkpoint of a model's family (a family may provide its own
    reader, ``read_checkpoint(path)`` in its model module, for files that are not torch /
    safetensors checkpoints, e.g. QnA-ViT's Flax msgpack; torch and safetensors files, told by
    their first bytes, always go to :func:`read_checkpoint` here) and converts it with the
    family's ``checkpoint_filter_fn``, which checks every key and shape. :func:`save_converted`
    writes the result as safetensors, which timm loads with
    ``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=PATH))``.

Publishing (``attnzoo publish``)
    :func:`load_checkpoint_model` builds the model from any checkpoint (official layouts, a timm
    ``train.py`` checkpoint, with its EMA weights if asked, or safetensors) and loads it strictly;
    :func:`evaluate` measures top-1/top-5 on an ImageFolder; :func:`write_hub_folder` writes the
    folder with timm's own ``save_for_hf`` (``model.safetensors``, ``config.json``) and the
    ``README.md`` of :func:`readme`; :func:`check_reload` reloads it through
    ``local-dir:`` and compares logits; :func:`upload` creates the repo and uploads the folder
    with huggingface_hub. Nothing is uploaded before the reload matched.

Model cards
    :func:`model_card` gives a model's card in the form timm's ``generate_readme`` takes; the
    Hub ``README.md`` (:func:`readme`) and ``MODEL_CARDS.md`` (:func:`model_cards_markdown`) are
    both rendered from it.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import math
import os
import pickle
import re
from pathlib import Path
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import __version__, backends
from .models import list_models, model_family
from .models._helpers import checkpoint_kind, unwrap_checkpoint
from .models._weights import HUB_ORG, WEIGHTS, hub_repo
from .profiling import count_macs, count_params

__all__ = ["HUB_ORG", "hub_repo", "PAPER_TOP1", "TRANSFORMERS_WITHOUT_ATTNZOO", "read_checkpoint",
           "load_official", "CONVERTED_FORMATS", "check_output_path", "save_converted",
           "LoadedCheckpoint", "load_checkpoint_model", "input_shape", "check_finite", "evaluate",
           "measure_facts", "backends_here", "config_line", "input_sizes",
           "weights_source", "backends_lines", "class_names", "model_card", "transformers_usage",
           "readme", "model_cards_markdown", "publish_table", "check_repo_id", "check_out_dir",
           "write_hub_folder", "check_reload", "check_token", "upload"]

PathLike = Union[str, os.PathLike]

# The top-1 each paper reports on ImageNet-1k val at the model's default resolution, and where
# (the registry's pretrained cfgs have no field for it). Models the sources do not cover are
# absent: the DiNAT-L 384 fine-tunes (not in shared/specs/nat.md).
PAPER_TOP1: Dict[str, Tuple[float, str]] = {
    **{name: (top1, "NAT paper, Table 3") for name, top1 in (
        ("nat_mini", 81.8), ("nat_tiny", 83.2), ("nat_small", 83.7), ("nat_base", 84.3))},
    **{name: (top1, "DiNAT paper, ImageNet-1k classification table") for name, top1 in (
        ("dinat_mini", 81.8), ("dinat_tiny", 82.7), ("dinat_small", 83.8),
        ("dinat_base", 84.4))},
    "dinat_large": (86.6, "DiNAT paper, ImageNet-22k pre-trained, fine-tuned on ImageNet-1k"),
    **{name: (top1, "QnA paper, Table 1") for name, top1 in (
        ("qna_vit_tiny", 81.7), ("qna_vit_tiny_7x7", 82.0), ("qna_vit_small", 83.2),
        ("qna_vit_base", 83.7))},
    **{name: (top1, "SAN paper, Table 3") for name, top1 in (
        ("san10_pairwise", 74.9), ("san10_patchwise", 77.1), ("san15_pairwise", 76.6),
        ("san15_patchwise", 78.0), ("san19_pairwise", 76.9), ("san19_patchwise", 78.2))},
    "quest_vit_tiny_patch16_224": (73.4, "QUEST paper, Table 1 (DeiT, 300 epochs)"),
    **{name: (top1, f"QUEST paper, Table 2 ({recipe})") for name, top1, recipe in (
        ("quest_vit_small_patch16_224", 80.2, "DeiT, 200 epochs"),
        ("quest_vit_base_patch16_224", 79.7, "DeiT, 100 epochs"),
        ("quest_vit_large_patch16_224", 74.9, "DeiT, 100 epochs"),
        ("quest_deit3_base_patch16_224", 83.2, "DeiT-3, 400+20 epochs"),
        ("quest_deit3_large_patch16_224", 84.1, "DeiT-3, 400+20 epochs"),
        ("quest_deit3_huge_patch14_224", 83.4, "DeiT-3, 400+20 epochs"))},
}

IMAGENET_VAL_IMAGES = 50_000  # ImageNet-1k's validation set, where the papers' top-1 is measured

# What transformers (4.57 to 5.24, measured) raises when timm does not know the architecture:
# `import attnzoo` was left out.
TRANSFORMERS_WITHOUT_ATTNZOO = ("ImportError: The model architecture '{arch}' is not supported "
                                "in your version of timm")

# timm train.py's checkpoint (CheckpointSaver): the model's and the EMA model's state dicts.
_TRAIN_KEYS = ("state_dict", "state_dict_ema")
# What a pretrained cfg says of the tag's official weights; a train.py checkpoint's model drops
# them (its card then states no dataset tag, no origin, and the licence publish is given)
_OFFICIAL_WEIGHTS_FIELDS = ("tag", "license", "origin_url", "notes", "hf_hub_id",
                            "hf_hub_filename", "url", "file")


# ----------------------------------------------------------------------------------------------
# reading and converting checkpoints
# ----------------------------------------------------------------------------------------------

def _check_file(path: str) -> None:
    if os.path.isdir(path):
        raise IsADirectoryError(f"checkpoint {path!r} is a folder, not a checkpoint file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")


def read_checkpoint(path: PathLike) -> Dict[str, Any]:
    """A torch (``.pth`` / ``.bin`` / ``.pt`` / ``.pth.tar``) or safetensors checkpoint, tensors on
    the CPU. A ``train.py`` checkpoint's ``args`` (an ``argparse.Namespace``) is allowed; nothing
    else that is not a tensor or a plain container is unpickled."""
    path = os.fspath(path)
    _check_file(path)
    kind = "safetensors" if path.endswith(".safetensors") else checkpoint_kind(path)
    if kind is None:
        raise ValueError(f"{path!r} is not a torch or safetensors checkpoint: its first bytes are "
                         "neither a torch.save file's (a zip archive or a pickle) nor a "
                         "safetensors header")
    try:
        if kind == "safetensors":
            import safetensors.torch
            return safetensors.torch.load_file(path, device="cpu")
        torch.serialization.add_safe_globals([argparse.Namespace])
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message advises weights_only=False over several lines; keep only the cause
        text = " ".join(str(e).split())
        cause = re.search(r"WeightsUnpickler error: *(.*?)(\. |$)", text)
        cause = cause.group(1) if cause else text.split(". ")[0]
        hint = ("; it holds Python objects besides tensors: if you trust it, load it yourself "
                "and torch.save its state_dict" if "global" in cause.lower()
                else " (corrupted or truncated?)")
        raise ValueError(f"{path!r} cannot be read by torch.load(weights_only=True), which runs no "
                         f"code from the file: {cause}{hint}") from e
    except Exception as e:  # noqa: BLE001 - report what the file is not, with the cause
        cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"{path!r} is not a readable torch or safetensors checkpoint (corrupted "
                         f"or truncated?): {type(e).__name__}: {cause}") from e


def _family_module(model_name: str):
    arch = model_name.split(".", 1)[0]
    if arch not in list_models():
        raise ValueError(f"{model_name!r} is not an attnzoo model; `attnzoo list` names them")
    return importlib.import_module(f"attnzoo.models.{model_family(arch)}")


def _read_any(model_name: str, path: PathLike) -> Any:
    """The checkpoint at ``path`` read by the family's reader or, for torch / safetensors
    files, by :func:`read_checkpoint`."""
    module = _family_module(model_name)
    _check_file(os.fspath(path))
    reader = read_checkpoint if checkpoint_kind(path) else getattr(module, "read_checkpoint",
                                                                   read_checkpoint)
    return reader(path)


def _convert(model_name: str, checkpoint: Any, model: Optional[torch.nn.Module] = None,
             **model_kwargs) -> Dict[str, torch.Tensor]:
    """``checkpoint`` through the family's filter onto ``model``, by default
    ``timm.create_model(model_name, **model_kwargs)`` built on the meta device (only its keys
    and shapes are needed)."""
    import timm
    if model is None:
        model = timm.create_model(model_name, pretrained=False, device="meta", **model_kwargs)
        model = _at_trained_grid(model_name, model, checkpoint, model_kwargs)
    state_dict = _family_module(model_name).checkpoint_filter_fn(checkpoint, model)
    return {k: v.contiguous() for k, v in state_dict.items()}


def head_and_stem_args(cfg: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor]
                       ) -> Dict[str, int]:
    """The ``num_classes`` / ``in_chans`` a state dict's classifier and stem need where they
    differ from the model's defaults (``cfg``: its pretrained cfg)."""
    args = {}
    head = state_dict.get(f"{cfg['classifier']}.weight")
    if head is not None and head.shape[0] != cfg["num_classes"]:
        args["num_classes"] = head.shape[0]
    stem = state_dict.get(f"{cfg['first_conv']}.weight")
    if stem is not None and stem.shape[1] != 3:
        args["in_chans"] = stem.shape[1]
    return args


def grid_args(model: torch.nn.Module, checkpoint: Any) -> Dict[str, Tuple[int, int]]:
    """The ``img_size`` of a ViT (QUEST-ViT) whose checkpoint's position embedding holds another
    square grid of the same patch size: the size it was trained at. Built at its default, the
    family's filter would resample the embedding to that default without a word (and the
    logits change); a checkpoint of another patch size is resampled, as timm does."""
    embed = getattr(model, "patch_embed", None)
    if embed is None or not isinstance(checkpoint, Mapping):
        return {}
    state = unwrap_checkpoint(checkpoint)  # {'model': ...} (DeiT's), DDP's 'module.'
    pos, proj = state.get("pos_embed"), state.get("patch_embed.proj.weight")
    if not (isinstance(pos, torch.Tensor) and pos.dim() == 3 and isinstance(proj, torch.Tensor)
            and tuple(proj.shape[-2:]) == tuple(embed.patch_size)):
        return {}
    tokens = pos.shape[1] - (0 if getattr(model, "no_embed_class", False)
                             else getattr(model, "num_prefix_tokens", 0))
    side = math.isqrt(max(tokens, 0))
    if side < 1 or side * side != tokens or (side, side) == tuple(embed.grid_size):
        return {}
    return {"img_size": (side * embed.patch_size[0], side * embed.patch_size[1])}


def _at_trained_grid(model_name: str, model: torch.nn.Module, checkpoint: Any,
                     kwargs: Dict[str, Any]) -> torch.nn.Module:
    """``model`` (on the meta device), rebuilt at the grid ``checkpoint`` was trained at where
    :func:`grid_args` finds one and ``kwargs`` gives no ``img_size`` (``kwargs`` then takes it):
    before the conversion, whose filter would resample the position embedding."""
    import timm
    grid = {} if "img_size" in kwargs else grid_args(model, checkpoint)
    if not grid:
        return model
    kwargs.update(grid)
    return timm.create_model(model_name, pretrained=False, device="meta", **kwargs)


def load_official(model_name: str, path: PathLike, **model_kwargs) -> Dict[str, torch.Tensor]:
    """Read an official checkpoint of ``model_name``'s family and convert it to the state dict of
    ``timm.create_model(model_name, **model_kwargs)``; raises ``ValueError`` naming what does not
    match."""
    checkpoint = _read_any(model_name, path)
    args = checkpoint.get("args") if isinstance(checkpoint, dict) else None
    args = vars(args) if isinstance(args, argparse.Namespace) else args  # train.py's
    if isinstance(args, Mapping):
        _check_trained_as(model_name, os.path.basename(os.fspath(path)), args)
    return _convert(model_name, checkpoint, **model_kwargs)


# The files `attnzoo convert` writes, by the output's extension: both load with timm's
# ``pretrained_cfg_overlay=dict(file=...)``, which reads ``.safetensors`` and torch.load's others.
CONVERTED_FORMATS = {".safetensors": "safetensors", ".pth": "torch", ".pt": "torch",
                     ".bin": "torch"}


def check_output_path(path: PathLike) -> str:
    """The format :func:`save_converted` writes to ``path`` (by its extension), after checking
    that its folder exists; ``ValueError`` otherwise, before any work is done."""
    path = os.fspath(path)
    kind = CONVERTED_FORMATS.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise ValueError(f"output {path!r}: unknown extension; accepted: "
                         f"{', '.join(CONVERTED_FORMATS)} (safetensors recommended)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"output {path!r}: folder {folder!r} does not exist")
    return kind


def save_converted(state_dict: Dict[str, torch.Tensor], path: PathLike) -> None:
    """Write a converted state dict as safetensors or, for ``.pth`` / ``.pt`` / ``.bin``, with
    ``torch.save`` (both what timm's ``file=`` overlay loads)."""
    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    kind, path = check_output_path(path), os.fspath(path)
    partial = f"{path}.partial"  # replaced into place when whole: a failure leaves any old file
    try:
        if kind == "torch":
            torch.save(tensors, partial)
        else:
            import safetensors.torch
            safetensors.torch.save_file(tensors, partial)
        os.replace(partial, path)
    except Exception as e:  # noqa: BLE001 - torch's RuntimeError, safetensors' own error
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise OSError(f"output {path!r}: cannot write it: "
                      f"{' '.join(str(e).split()) or type(e).__name__}") from e


# ``--model-kwargs`` entries that say where train.py took initial weights from: they build no
# part of the model (and their files need not exist where the checkpoint is published).
_WEIGHT_SOURCE_KWARGS = ("pretrained", "pretrained_cfg", "pretrained_cfg_overlay",
                         "checkpoint_path", "pretrained_strict", "cache_dir")


class LoadedCheckpoint(NamedTuple):
    """What :func:`load_checkpoint_model` built: the model, which weights were taken (a
    phrase), the constructor arguments it was built with besides ``num_classes``
    (``config.json``'s ``model_args``: what a reload needs) and, for a train.py checkpoint,
    what was taken from its ``args`` (a phrase; empty otherwise)."""
    model: torch.nn.Module
    source: str
    model_args: Dict[str, Any]
    from_args: str = ""


def _check_trained_as(model_name: str, name: str, args: Mapping[str, Any]) -> None:
    """A train.py checkpoint's ``args`` name ``model_name``'s architecture (two models of the
    same weight shapes, NAT's and DiNAT's, would load each other's weights silently)."""
    arch = model_name.split(".", 1)[0]
    trained = str(args.get("model") or arch)
    if trained.split(".", 1)[0] != arch:
        raise ValueError(f"{name} was trained as {trained!r} (its args.model), not {arch!r}: "
                         f"name {trained.split('.', 1)[0]} as its model")


def _train_args(model_name: str, name: str,
                args: Mapping[str, Any]) -> Tuple[Dict[str, Any], str]:
    """The ``timm.create_model`` arguments train.py built its model with (from the checkpoint's
    ``args``) that change the weights' shapes or the eval forward, and what they were, in a
    phrase. Its drop rates and BatchNorm momentum are left out: they train, nothing else."""
    _check_trained_as(model_name, name, args)
    kwargs: Dict[str, Any] = {}
    in_chans = args.get("in_chans") or (args.get("input_size") or (None,))[0]
    for key, value in (("num_classes", args.get("num_classes")), ("in_chans", in_chans),
                       ("global_pool", args.get("gp")), ("bn_eps", args.get("bn_eps"))):
        if value is not None:  # as timm.create_model drops the None ones
            kwargs[key] = value
    model_kwargs = dict(args.get("model_kwargs") or {})
    dropped = sorted(k for k in model_kwargs if k in _WEIGHT_SOURCE_KWARGS)
    kwargs.update({k: v for k, v in model_kwargs.items() if k not in _WEIGHT_SOURCE_KWARGS})
    try:
        json.dumps(kwargs)
    except TypeError as e:
        raise ValueError(f"{name}: train.py's model arguments {kwargs} cannot go into "
                         f"config.json ({e}); accepted: numbers, strings, lists, dicts") from None
    taken = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "none but the defaults"
    return kwargs, (f"model arguments {taken}"
                    + (f"; left out {', '.join(dropped)} (where its initial weights came from)"
                       if dropped else ""))


def _train_data_config(model: torch.nn.Module, args: Mapping[str, Any],
                       model_kwargs: Mapping[str, Any]) -> Dict[str, Any]:
    """The entries of ``model``'s pretrained cfg that train.py's data config (its args: input
    or image size, interpolation, mean, std, crop) changed, as ``resolve_data_config`` gives
    them; a fixed-size model's ``img_size`` model argument sets the input size when the args do
    not (train.py then had to be given it too)."""
    from timm.data import resolve_data_config
    cfg = model.pretrained_cfg
    data = resolve_data_config(args, model=model)
    img_size = model_kwargs.get("img_size")
    if img_size is not None and not (args.get("input_size") or args.get("img_size")):
        size = tuple(img_size) if isinstance(img_size, (tuple, list)) else (img_size,) * 2
        data["input_size"] = (data["input_size"][0], *size)
    return {k: v for k, v in data.items() if _plain(cfg.get(k)) != _plain(v)}


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists, as config.json holds it."""
    return list(value) if isinstance(value, (tuple, list)) else value


def load_checkpoint_model(model_name: str, path: PathLike, use_ema: bool = False,
                          model_kwargs: Optional[Mapping[str, Any]] = None) -> LoadedCheckpoint:
    """``model_name`` (a model or ``model.tag``) built from the checkpoint at ``path`` and loaded
    strictly, in eval mode, with a sentence saying which weights (and train.py arguments) were
    taken, and the model arguments a reload needs.

    Any checkpoint :func:`load_official` reads, and timm ``train.py`` checkpoints: their
    ``state_dict`` by default, ``state_dict_ema`` with ``use_ema``; the model is built with the
    arguments train.py built it with (its ``args``: ``--model-kwargs``, ``--num-classes``,
    ``--in-chans``, ``--gp``, ``--bn-eps``), and its pretrained cfg takes train.py's data
    config (input size, mean, std, crop...). Otherwise the classifier's classes and the stem's
    input channels are the checkpoint's. ``model_kwargs``: constructor arguments of the user's
    (``--model-kwargs``), over train.py's. Raises ``ValueError`` (one line per problem) for a
    file that cannot be read or does not fit."""
    import timm

    checkpoint = _read_any(model_name, path)
    name = source = os.path.basename(os.fspath(path))
    kwargs: Dict[str, Any] = {}
    train_args, from_args = None, ""
    # timm's CheckpointSaver writes "arch"; an official {'epoch', 'state_dict'} file does not
    trained = isinstance(checkpoint, dict) and "arch" in checkpoint
    if isinstance(checkpoint, dict) and any(k in checkpoint for k in _TRAIN_KEYS):
        key = "state_dict_ema" if use_ema else "state_dict"
        if key not in checkpoint:
            raise ValueError(f"{name} has no {key!r} (it holds "
                             f"{', '.join(k for k in _TRAIN_KEYS if k in checkpoint)})")
        epoch = f", epoch {checkpoint['epoch']}" if "epoch" in checkpoint else ""
        other = "state_dict" if use_ema else "state_dict_ema"
        source = (f"{key} ({'EMA' if use_ema else 'non-EMA'} weights) of {name}{epoch}"
                  + (f"; it also holds {other}" if other in checkpoint else ""))
        train_args = checkpoint.get("args")
        if train_args is not None:  # train.py saves its argparse.Namespace
            train_args = (vars(train_args) if isinstance(train_args, argparse.Namespace)
                          else dict(train_args))
            kwargs, from_args = _train_args(model_name, name, train_args)
        checkpoint = checkpoint[key]
    elif use_ema:
        raise ValueError(f"{name} is not a train.py checkpoint with EMA weights "
                         f"(no 'state_dict_ema'); leave out --use-ema")
    kwargs.update(model_kwargs or {})
    try:  # on the meta device: the filter needs keys and shapes only
        model = timm.create_model(model_name, device="meta", **kwargs)
    except TypeError as e:  # an argument the model does not take
        raise ValueError(f"{name}: {model_name} cannot be built with {kwargs}: {e}") from None
    model = _at_trained_grid(model_name, model, checkpoint, kwargs)
    state_dict = _convert(model_name, checkpoint, model)
    inferred = {k: v for k, v in head_and_stem_args(model.pretrained_cfg, state_dict).items()
                if k not in kwargs}
    if inferred:
        kwargs.update(inferred)
        model = timm.create_model(model_name, device="meta", **kwargs)
    restored = model.state_dict().keys()
    if all(name in restored for name, _ in model.named_buffers()):
        model = model.to_empty(device="cpu")  # every value comes from the checkpoint: no init
    else:  # a buffer the state dict does not restore needs the constructor's value
        model = timm.create_model(model_name, **kwargs)
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as e:  # keys the filter leaves to timm (the classifier)
        raise ValueError(f"checkpoint does not match {model_name}: "
                         + " ".join(str(e).split())) from None
    if train_args is not None:
        data = _train_data_config(model, train_args, kwargs)
        if data:
            model.pretrained_cfg = model.default_cfg = {**model.pretrained_cfg, **data}
            from_args += "; data config " + ", ".join(f"{k}={v!r}" for k, v in data.items())
    if trained:  # whoever trained it: not the tag's official weights, nor their licence
        model.pretrained_cfg = model.default_cfg = {
            **model.pretrained_cfg, **dict.fromkeys(_OFFICIAL_WEIGHTS_FIELDS)}
    model_args = {k: v for k, v in kwargs.items() if k != "num_classes"}
    return LoadedCheckpoint(model.eval(), source, model_args, from_args)


# ----------------------------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------------------------

def input_shape(model: torch.nn.Module,
                size: Optional[Sequence[int]] = None) -> Tuple[int, ...]:
    """``(C, H, W)``: ``size`` (default: the pretrained cfg's ``input_size``) with the channels
    of the model's stem; timm keeps the cfg's 3 channels for a model built with another
    ``in_chans``."""
    size = model.pretrained_cfg["input_size"] if size is None else size
    return (_in_chans(model), *size[1:])


def _check_input(model: torch.nn.Module) -> torch.Tensor:
    """A fixed random image at the model's default input size (same values on every call)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1, *input_shape(model), generator=gen)


def check_finite(model: torch.nn.Module) -> torch.Tensor:
    """The logits of :func:`_check_input`; ``ValueError`` if any is not finite."""
    with torch.no_grad():
        logits = model(_check_input(model))
    bad = int((~torch.isfinite(logits)).sum())
    if bad:
        raise ValueError(f"the model's logits are not finite ({bad} of {logits.numel()} "
                         "values): wrong or corrupted weights")
    return logits


def _eval_targets(model: torch.nn.Module, image_dir: str, folders: Sequence[str],
                  images: int) -> Optional[torch.Tensor]:
    """The head's index of each class folder (in sorted order), or ``None`` where the folders
    are the head's classes in index order. ImageNet synset folders (``n01440764``...) of a
    1000-class head take their ImageNet-1k index from timm's ``ImageNetInfo``, so a part of
    ImageNet val counts right; any other ImageFolder must have one folder per class of the head
    (its sorted order is the head's order, as in timm's ``validate.py``)."""
    from timm.data import ImageNetInfo
    n = model.num_classes
    if n == 1000 and folders:
        synsets = {name: i for i, name in enumerate(ImageNetInfo("imagenet-1k").label_names())}
        if all(f in synsets for f in folders):
            return torch.tensor([synsets[f] for f in folders])
    if images and len(folders) == n:
        return None
    shown = ", ".join(list(folders)[:3]) + (", ..." if len(folders) > 3 else "")
    imagenet = (" or ImageNet-1k synset folders (n01440764, ...; any part of ImageNet val)"
                if n == 1000 else "")
    found = f"{len(folders)} class folders ({shown})" if shown else "no class folders"
    raise ValueError(f"--eval-dir {image_dir!r} has {found} and "
                     f"{images} images; the {n}-class head needs an ImageFolder with exactly "
                     f"{n} class folders, in the head's order when sorted{imagenet}")


def evaluate(model: torch.nn.Module, image_dir: PathLike, batch_size: int = 32,
             workers: int = 0) -> Dict[str, Any]:
    """Top-1 / top-5 accuracy (%) of ``model`` on an ImageFolder, with the model's eval
    transform (``resolve_data_config``), a progress bar on stderr; with the number of images
    and the class folders' names in sorted order (``classes``).

    The ImageFolder has one sub-folder per class of the head, in the head's order when sorted
    (as timm's ``validate.py`` takes them), or, for a 1000-class head, ImageNet-1k synset
    folders, any number of them (each is scored against its ImageNet-1k index); anything else
    is a ``ValueError``, as a top-1 that compares unrelated indices would mean nothing."""
    from timm.data import create_dataset, create_loader, resolve_data_config
    from tqdm import tqdm

    image_dir = os.fspath(image_dir)
    if not os.path.isdir(image_dir):
        raise ValueError(f"--eval-dir {image_dir!r} is not a folder")
    dataset = create_dataset("", root=image_dir)
    class_to_idx = getattr(dataset.reader, "class_to_idx", {})
    folders = sorted(class_to_idx, key=class_to_idx.get)
    targets = _eval_targets(model, image_dir, folders, len(dataset))
    if not len(dataset):
        raise ValueError(f"--eval-dir {image_dir!r} has no images")
    cfg = resolve_data_config({}, model=model)
    loader = create_loader(dataset, input_size=cfg["input_size"], batch_size=batch_size,
                           use_prefetcher=False, interpolation=cfg["interpolation"],
                           mean=cfg["mean"], std=cfg["std"], crop_pct=cfg["crop_pct"],
                           crop_mode=cfg["crop_mode"], num_workers=workers)
    correct1 = correct5 = 0
    with torch.no_grad():
        for x, y in tqdm(loader, desc="eval", unit="batch"):
            y = y if targets is None else targets[y]
            top = model(x).topk(min(5, model.num_classes), dim=-1).indices
            correct1 += int((top[:, 0] == y).sum())
            correct5 += int((top == y[:, None]).any(-1).sum())
    n = len(dataset)
    return {"top1": 100 * correct1 / n, "top5": 100 * correct5 / n, "images": n,
            "classes": folders}


def measure_facts(model: torch.nn.Module) -> Dict[str, Any]:
    """GMACs at the model's default input size, the attnzoo ops one forward runs and, per op,
    each backend's limits on the model's calls (``backends``: op -> backend -> ``None`` or why
    it never runs them, :func:`attnzoo.backends.call_limits`); counted on whatever device the
    model is on, the meta device being enough."""
    if next(model.parameters()).device.type != "meta":
        model = copy.deepcopy(model).to("meta")  # counting needs shapes, not a real forward
    with backends.record_calls() as calls:
        macs = count_macs(model, (1, *input_shape(model)))
    return {"gmacs": round(macs / 1e9, 2), "ops": list(calls),
            "backends": {op: backends.call_limits(op, keys) for op, keys in calls.items()}}


def smallest_size(model: torch.nn.Module) -> int:
    """The smallest square input side worth running a model of any input size at: its minimum
    (attnzoo's models' ``min_size``), at least its total stride, where its last maps have side
    1."""
    info = getattr(model, "feature_info", None)
    stride = info[-1].get("reduction", 32) if isinstance(info, list) and info and isinstance(
        info[-1], dict) else 32
    return max(getattr(model, "min_size", 1), stride)


def _probe_input(model: torch.nn.Module) -> torch.Tensor:
    """One image on ``model``'s device, of its smallest input size (64x64 where any size
    goes)."""
    cfg = model.pretrained_cfg
    size = cfg["input_size"] if cfg.get("fixed_input_size") else (
        cfg.get("min_input_size") or (3, 64, 64))
    return torch.randn(1, *input_shape(model, size), device=next(model.parameters()).device)


# a refusal's reason, without the op's call signature and the alternatives (backends.resolve)
_REFUSAL = re.compile(r"backend '\w+' cannot run \w+ here: (?P<reason>.*?)\. Backends that can: ",
                      re.S)


def backends_here(model: torch.nn.Module) -> Dict[str, Optional[str]]:
    """Each concrete backend: None if it runs a forward of ``model`` here (:func:`_probe_input`),
    else why not, in a phrase (every backend "runs" a model without attnzoo ops)."""
    x = _probe_input(model)
    result: Dict[str, Optional[str]] = {}
    for name in backends.CONCRETE_BACKENDS:
        try:
            with torch.no_grad(), backends.use_backend(name):
                model(x)
            result[name] = None
        except backends.BackendUnsupportedError as e:
            match = _REFUSAL.match(str(e))
            result[name] = match["reason"] if match else str(e)
    return result


def op_calls(model: torch.nn.Module) -> Tuple[str, Dict[str, int]]:
    """The attnzoo op calls of a forward of ``model`` (:func:`_probe_input`, on the torch
    reference): the input's size as ``HxW``, and how many times each op is called."""
    x = _probe_input(model)
    counts: Dict[str, int] = {}

    @contextlib.contextmanager
    def counting(op: str, backend: str, macs: int):
        counts[op] = counts.get(op, 0) + 1
        yield

    with torch.no_grad(), backends.use_backend("torch"), backends.observe_ops(counting):
        model(x)
    return f"{x.shape[-2]}x{x.shape[-1]}", counts


# ----------------------------------------------------------------------------------------------
# model cards
# ----------------------------------------------------------------------------------------------

def config_line(model: torch.nn.Module) -> str:
    """What distinguishes a variant: stage depths and widths, and its attention layers."""
    parts = []
    if hasattr(model, "stages"):
        parts.append(f"depths {[len(getattr(s, 'blocks', ())) for s in model.stages]}")
    parts.append(f"widths {[f['num_chs'] for f in model.feature_info]}")
    attn: Dict[str, list] = {}
    for m in model.modules():
        if type(m).__module__.startswith("attnzoo.layers"):
            attn.setdefault(type(m).__name__, []).append(m)
    for cls, mods in attn.items():
        configs: Dict[str, int] = {}
        for m in mods:  # one entry per distinct configuration, in order of appearance
            configs[m.extra_repr()] = configs.get(m.extra_repr(), 0) + 1
        parts += [f"{n} x {cls}({config})" for config, n in configs.items()]
    return "; ".join(parts)


def _bibtex(model_name: str, paper_id: str) -> Optional[str]:
    """The BibTeX entry that follows the paper's arXiv link in the family module's docstring."""
    doc = _family_module(model_name).__doc__ or ""
    arxiv = paper_id.split(":")[-1]
    m = re.search(rf"abs/{re.escape(arxiv)}\s*\n(@\w+\{{.*?\n\}})", doc, re.S)
    return m.group(1) if m else None


def input_sizes(cfg: Mapping[str, Any]) -> str:
    size = "x".join(map(str, cfg["input_size"][1:]))
    if cfg.get("fixed_input_size"):
        return f"{size} (img_size= or dynamic_img_size=True for others)"
    if cfg.get("min_input_size"):
        return f"any from {'x'.join(map(str, cfg['min_input_size'][1:]))} (default {size})"
    return f"any (default {size})"


def dynamic_size_refusal(cfg: Mapping[str, Any]) -> Optional[str]:
    """``None`` where an ONNX export of the model can take any input size (``attnzoo export
    --dynamic-size``), else why not, in a phrase."""
    if cfg.get("fixed_input_size"):
        size = "x".join(map(str, cfg["input_size"][1:]))
        return f"its input size is fixed at {size} (position embeddings learned for that grid)"
    return None


def export_line(cfg: Mapping[str, Any]) -> str:
    """What an ONNX export of the model allows, for its card."""
    arch = cfg["architecture"]
    refusal = dynamic_size_refusal(cfg)
    if refusal:
        return (f"dynamic batch (`attnzoo export {arch} {arch}.onnx`); no dynamic size: "
                f"{refusal}")
    return (f"dynamic batch and input size (`attnzoo export {arch} {arch}.onnx "
            "--dynamic-size`)")


def weights_source(tag: str) -> str:
    """Where ``pretrained=True`` gets tag ``tag``'s weights, in a sentence, from its record in
    :data:`attnzoo.models._weights.WEIGHTS` (or its cfg, for a tag without a record)."""
    import timm
    cfg = timm.get_pretrained_cfg(tag)
    if cfg is None or not cfg.tag:
        return "no pretrained tag"
    record, home = WEIGHTS.get(tag), hub_repo(tag)
    if record is not None and not record.published:
        return (f"not on the Hub yet (to be published as {record.repo}); the official checkpoint "
                f"is at {cfg.origin_url}: `attnzoo convert` it and load the file "
                "(pretrained=True says how)")
    if record is not None and record.repo == home:
        return (f"Hub repo {home}: the official checkpoint ({cfg.origin_url}) converted by "
                "`attnzoo publish`")
    if record is not None:
        return (f"Hub repo {record.repo}, the authors' upload (converted on load); a timm-native "
                f"copy can be published as {home}, and the tag then pointed at it")
    if cfg.url:
        return f"URL {cfg.url}"
    if cfg.file:
        return f"file overlay only ({cfg.file})"
    return f"none downloadable: the official weights are at {cfg.origin_url}"


def backends_lines(arch: str, facts: Mapping[str, Any]) -> Union[str, list]:
    """The card's backends: per attnzoo op the model runs, each backend that runs its calls or
    why it never does (``facts['backends']``, from the op registry), then where each backend
    runs; a sentence for a model without attnzoo ops."""
    if not facts["ops"]:
        return "none needed (no attnzoo op: plain PyTorch)"
    lines = [f"`{op}`: " + "; ".join(
        f"{name}: {'runs it' if reason is None else 'no, ' + reason}"
        for name, reason in facts["backends"][op].items()) for op in facts["ops"]]
    where = "; ".join(f"{name}: {text}" for name, text in backends.RUNS_ON.items())
    return lines + [f"{where}. `auto` picks, per call, the first of them in a fixed order that "
                    "runs it: on CUDA cuda (only where a verification record covers the GPU, "
                    "dtype, Triton and the kernels' version: docs/backends.md), natten, "
                    "torch; on CPU "
                    f"torch. `attnzoo info {arch}` tries each on your machine"]


def model_card(model: torch.nn.Module, facts: Mapping[str, Any], *, repo_id: str = "",
               weights: str = "", evaluation: Optional[Mapping[str, Any]] = None,
               throughput: str = "") -> Dict[str, Any]:
    """``model``'s card as timm's ``generate_readme`` takes it (``tags``, ``license``,
    ``details``, ``usage``, ``comparison``, ``citation``).

    ``facts``: :func:`measure_facts`'s ``gmacs`` and ``ops``; ``repo_id``: the Hub repo the card
    is for (usage loads ``hf-hub:<repo_id>``; default: the registry name); ``weights``: where
    these weights come from (default: the tag's source); ``evaluation``: :func:`evaluate`'s
    result; ``throughput``: a measured figure, with its setting."""
    cfg = model.pretrained_cfg
    arch, tag = cfg["architecture"], cfg.get("tag")
    name = f"{arch}.{tag}" if tag else arch
    paper_id = cfg.get("paper_ids", "")
    details: Dict[str, Any] = {
        "Model Type": "Image classification / feature backbone",
        "Architecture": config_line(model),
        "Model Stats": {
            "Params (M)": f"{count_params(model) / 1e6:.2f}",
            "GMACs": f"{facts['gmacs']:.2f} at {'x'.join(map(str, cfg['input_size'][1:]))}",
            "Input size": input_sizes(cfg),
        },
        "Data config": (f"{cfg['interpolation']} resize, crop_pct {cfg['crop_pct']}, mean "
                        f"{tuple(round(v, 4) for v in cfg['mean'])}, std "
                        f"{tuple(round(v, 4) for v in cfg['std'])}"),
    }
    if paper_id:
        details["Papers"] = {cfg.get("paper_name", paper_id):
                             f"https://arxiv.org/abs/{paper_id.split(':')[-1]}"}
    n = model.num_classes
    label_fields, labels = class_names(model, (evaluation or {}).get("classes"))
    if n != 1000:  # whatever the tag says, this head was not trained on ImageNet-1k's classes
        names = label_fields.get("label_names")
        shown = (", ".join(names[:10]) + (", ..." if n > 10 else "") if names
                 else f"no names (LABEL_0 to LABEL_{n - 1})")
        details["Classes"] = f"{n}, a head of its own (not ImageNet-1k's 1000 classes): {shown}"
    elif tag and "in1k" in tag:
        details["Dataset"] = "ImageNet-1k"
        if "in22k" in tag:
            details["Pretrain Dataset"] = "ImageNet-22k"
    if cfg.get("origin_url"):
        details["Original"] = cfg["origin_url"]
    details["Weights"] = weights or (weights_source(name) if tag else (
        "none published; see the family's documentation for initialising from other weights"))
    details["Attention backends"] = backends_lines(arch, facts)
    details["ONNX export"] = export_line(cfg)
    if throughput:
        details["Throughput"] = throughput
    details["Labels"] = labels
    load = f"hf-hub:{repo_id}" if repo_id else name
    hf_ready = bool(tag and cfg.get("hf_hub_id"))  # the tag's weights are on the Hub now
    own_repo = hf_ready and cfg["hf_hub_id"] == hub_repo(name)  # ours, in timm's layout
    if repo_id or hf_ready:
        create = f"model = timm.create_model('{load}', pretrained=True).eval()\n"
    elif tag and cfg.get("origin_url"):  # official weights, not on the Hub: converted first
        create = ("# its weights are not on the Hub yet: convert the official checkpoint first,\n"
                  f"# attnzoo convert {arch} CHECKPOINT {arch}.safetensors\n"
                  f"model = timm.create_model('{name}', pretrained=True, pretrained_cfg_overlay="
                  f"dict(file='{arch}.safetensors')).eval()\n")
    else:  # no weights anywhere: the snippet must not read as a classifier
        create = (f"model = timm.create_model('{load}', pretrained=False).eval()  # no published "
                  "weights: random until trained\n")
    usage = ("With timm:\n\n```python\nimport timm\nimport torch\n\n"
             "import attnzoo  # registers attnzoo's models with timm: before create_model\n\n"
             + create +
             "data_config = timm.data.resolve_model_data_config(model)\n"
             "transform = timm.data.create_transform(**data_config, is_training=False)\n"
             "with torch.no_grad():\n"
             "    logits = model(transform(image).unsqueeze(0))  # image: a PIL image\n```\n\n"
             + transformers_usage(arch, repo_id or (hub_repo(name) if own_repo else "")))
    rows = [f"| | {'ImageNet-1k ' if n == 1000 else ''}top-1 | top-5 | source |",
            "|---|---|---|---|"]
    if arch in PAPER_TOP1:
        top1, where = PAPER_TOP1[arch]
        rows.append(f"| paper | {top1} | | {where}"
                    f"{'' if n == 1000 else ' (ImageNet-1k, the architecture trained there)'} |")
    # a measured top-1 sits beside the paper's only where it is the paper's measure: every image
    # of ImageNet-1k's validation set, 1000 classes; else it is said apart
    comparable = evaluation and n == 1000 and evaluation["images"] >= IMAGENET_VAL_IMAGES
    if comparable:
        rows.append(f"| measured | {evaluation['top1']:.2f} | {evaluation['top5']:.2f} | "
                    f"`attnzoo publish --eval-dir` on {evaluation['images']} images |")
    measured = "" if comparable or not evaluation else (
        f"Measured by `attnzoo publish --eval-dir` on {evaluation['images']} images ({n} "
        f"classes): top-1 {evaluation['top1']:.2f}, top-5 {evaluation['top5']:.2f}. A check of "
        "these weights on those images, not comparable with a paper's ImageNet-1k figure.")
    card: Dict[str, Any] = {
        "tags": ["image-classification", "timm", "transformers", "attnzoo",
                 *([f"arxiv:{paper_id.split(':')[-1]}"] if paper_id else [])],
        "license": cfg.get("license") or "other",
        "details": details,
        "usage": usage,
    }
    parts = (["\n".join(rows)] if len(rows) > 2 else []) + ([measured] if measured else [])
    if parts:
        card["comparison"] = "\n\n".join(parts)
    bibtex = _bibtex(arch, paper_id) if paper_id else None
    if bibtex:
        card["citation"] = bibtex
    return card


def transformers_usage(arch: str, source: str = "") -> str:
    """The card's transformers block: ``pipeline`` on ``source`` (a Hub repo in timm's layout,
    as :func:`write_hub_folder` writes it; default: a placeholder for one), ``import attnzoo``
    first, and what a user sees without it."""
    repo = f'"{source}"' if source else '"ORG/NAME"  # a Hub repo or folder `attnzoo publish` wrote'
    return (
        "With transformers (`pip install transformers`): its `TimmWrapper` builds the "
        "model with timm, so the logits, the preprocessing (from config.json's `pretrained_cfg`) "
        "and the class names are timm's:\n\n```python\n"
        "import attnzoo  # registers attnzoo's models with timm: before transformers builds one\n"
        "from transformers import pipeline\n\n"
        f"repo = {repo}\n"
        "classifier = pipeline(\"image-classification\", model=repo)\n"
        "classifier(image)  # image: a PIL image, a path or a URL\n```\n\n"
        "`AutoModelForImageClassification` and `AutoImageProcessor` load it the same way. "
        f"Without `import attnzoo`, timm does not know `{arch}` and transformers stops with "
        f"`{TRANSFORMERS_WITHOUT_ATTNZOO.format(arch=arch)}...`: upgrading timm, which it "
        "suggests, does not help; importing attnzoo first does.\n")


def readme(card: Mapping[str, Any], title: str) -> str:
    """The Hub ``README.md`` of ``card``: timm's ``generate_readme`` (front matter with
    ``library_name: timm``, license, tags with the paper's ``arxiv:`` id, datasets,
    ``pipeline_tag: image-classification``)."""
    from timm.models._hub import generate_readme
    return generate_readme(dict(card), title)


def model_cards_markdown(facts: Mapping[str, Any]) -> str:
    """``MODEL_CARDS.md``: every registered model's card (:func:`readme` with its front matter
    as a YAML block and headings one level down), from ``facts`` as
    ``scripts/make_model_cards.py`` writes them (``models``: name -> ``gmacs``, ``ops``,
    ``img_per_s``; ``throughput_setting``; ``measured_on``)."""
    import timm
    out = [
        "# attnzoo model cards\n",
        "Generated by `python scripts/make_model_cards.py` (`attnzoo.hub.model_cards_markdown`, "
        "the generator of the Hub cards) from the figures in `scripts/model_card_facts.json`, "
        f"measured on {facts['measured_on']}. GMACs count convolutions and matmuls, and each "
        "attention op by its analytical formula (`attnzoo.profiling.count_macs`; neighborhood "
        "attention as QK plus AV, B x heads x tokens x head_dim x kernel area each), as the "
        "papers do; normalisation, activations and biases are not counted.\n",
    ]
    for name in list_models():
        model = timm.create_model(name, device="meta")
        model_facts = facts["models"][name]
        throughput = (f"{model_facts['img_per_s']:.2f} img/s, {facts['throughput_setting']}"
                      if model_facts.get("img_per_s") else "")
        text = readme(model_card(model, model_facts, throughput=throughput), name)
        _, front, body = text.split("---\n", 2)
        body = re.sub(r"^# Model card for .*\n", "", body)
        body = re.sub(r"^(#+) ", r"#\1 ", body, flags=re.M)
        out.append(f"## {name}\n\nHub metadata:\n\n```yaml\n{front}```\n{body}")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# the Hub folder and the upload
# ----------------------------------------------------------------------------------------------

def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it is ``ORG/NAME`` as the Hub accepts it, else ``ValueError``."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        if repo_id.count("/") != 1:
            raise HFValidationError("it needs exactly one '/'")
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f"--repo-id must be ORG/NAME (letters, digits, '-', '_', '.'; e.g. "
                         f"{hub_repo('nat_mini.in1k')}), got {repo_id!r}: "
                         f"{str(e).splitlines()[0]}") from None
    return repo_id


def check_out_dir(out: PathLike) -> Path:
    """``out`` if it does not exist or is an empty folder, else ``ValueError``."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {os.fspath(out)!r} exists and is not an empty folder; give a new "
                         "or empty one (nothing is overwritten)")
    return out


def class_names(model: torch.nn.Module,
                classes: Optional[Sequence[str]] = None) -> Tuple[Dict[str, Any], str]:
    """What ``model``'s classes are called: the ``config.json`` fields that name them, and a
    sentence for the card. ``classes``: an ImageFolder's class folders in index order
    (:func:`evaluate`'s ``classes``).

    - ``classes`` naming every class of the head (and not ImageNet's own synsets):
      ``label_names``, which timm puts in the model's ``pretrained_cfg`` and transformers turns
      into ``id2label``.
    - Else an ImageNet head (1000 classes; timm's ``infer_imagenet_subset``): nothing, as in
      timm's own ImageNet repos. timm (``ImageNetInfo``) and transformers (its ``TimmWrapper``
      config, 4.48+) both name the classes from the head's size, transformers with the
      descriptions ('tench, Tinca tinca'); ``label_names`` would replace those descriptions
      with whatever is written (timm writes synsets there), so ``pipeline`` would answer
      'n01440764'.
    - Else nothing: the classes have no names (transformers answers ``LABEL_0``...)."""
    from timm.data import ImageNetInfo, infer_imagenet_subset
    n = model.num_classes
    subset = infer_imagenet_subset(model)
    info = ImageNetInfo(subset) if subset else None
    if classes is not None and len(classes) == n and (
            info is None or list(classes) != info.label_names()):
        shown = ", ".join(classes[:5]) + (", ..." if n > 5 else "")
        return {"label_names": list(classes)}, (
            f"{n} classes, named after the class folders of the ImageFolder given to `attnzoo "
            f"publish --eval-dir` (config.json `label_names`, in index order): {shown}")
    if info is not None:
        return {}, (
            f"{subset}'s {n} classes, named from the {n}-class head by timm's `ImageNetInfo`, as "
            "for timm's own ImageNet repos: transformers' `pipeline` answers their descriptions "
            f"('{info.index_to_description(0)}'), timm's `ImageNetInfo` gives those and the "
            f"synsets ('{info.index_to_label_name(0)}')")
    return {}, (f"{n} classes without names (`attnzoo publish` names them from an `--eval-dir` "
                f"ImageFolder with {n} class folders): transformers answers `LABEL_0` to "
                f"`LABEL_{n - 1}`, timm gives class indices")


def write_hub_folder(model: torch.nn.Module, out: PathLike, card: Mapping[str, Any],
                     title: str, classes: Optional[Sequence[str]] = None,
                     model_args: Optional[Mapping[str, Any]] = None) -> Path:
    """Write ``model`` as a timm Hub folder: timm's ``save_for_hf`` (``model.safetensors``,
    ``config.json`` with ``architecture``, ``num_classes``, ``pretrained_cfg``, the label names
    :func:`class_names` gives for ``classes``) and ``README.md`` from ``card``. timm loads it
    (``local-dir:``, ``hf-hub:``) and so does transformers (``TimmWrapper``: the
    ``pretrained_cfg`` is its image processor's config too).

    ``config.json``'s ``model_args`` holds exactly the constructor arguments that differ from
    the architecture's defaults, whatever timm version writes it: ``model_args`` (those the
    model was built with, :func:`load_checkpoint_model`'s) and ``in_chans`` where not 3; never
    ``num_classes`` (its top-level value rules, and transformers' TimmWrapper passes it
    separately). The source cfg's ``notes`` (how to obtain and convert the official weights)
    are dropped: the folder holds them converted."""
    from timm.models import save_for_hf
    out = check_out_dir(out)
    in_chans = _in_chans(model)
    model_args = {k: v for k, v in (model_args or {}).items() if k != "num_classes"}
    if in_chans != 3:
        model_args["in_chans"] = in_chans
    save_for_hf(model, out, model_config=class_names(model, classes)[0],
                model_args=model_args or None, safe_serialization=True)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("model_args", None)
    if model_args:
        config["model_args"] = model_args
    config["pretrained_cfg"].pop("notes", None)
    config_path.write_text(json.dumps(config, indent=2))
    (out / "README.md").write_text(readme(card, title), encoding="utf-8")
    # every file as the umask makes a new file (0644 with the usual 022): safetensors writes
    # its file through a private temporary (0600), which others could not read
    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)
    return out


def _in_chans(model: torch.nn.Module) -> int:
    first_conv = model.pretrained_cfg.get("first_conv")
    if isinstance(first_conv, (tuple, list)):  # timm's models with several stems (CrossViT)
        first_conv = first_conv[0] if first_conv else None
    weight = getattr(model.get_submodule(first_conv), "weight", None) if first_conv else None
    if isinstance(weight, torch.Tensor) and weight.dim() >= 2:
        return weight.shape[1]
    return model.pretrained_cfg["input_size"][0]


def check_reload(model: torch.nn.Module, folder: PathLike,
                 want: Optional[torch.Tensor] = None) -> None:
    """Reload ``folder`` with ``timm.create_model('local-dir:...', pretrained=True)`` and compare
    its logits with ``model``'s (``want``: those :func:`check_finite` returned) on the same fixed
    batch; ``ValueError`` unless they are identical."""
    import timm
    reloaded = timm.create_model(f"local-dir:{os.fspath(folder)}", pretrained=True).eval()
    x = _check_input(model)
    with torch.no_grad():
        want = model(x) if want is None else want
        got = reloaded(x)
    if got.shape != want.shape:
        raise ValueError(f"the reloaded folder gives logits of shape {tuple(got.shape)}, the "
                         f"source {tuple(want.shape)}: nothing uploaded")
    if not torch.equal(got, want):
        raise ValueError(f"the reloaded folder's logits differ from the source's (max |diff| "
                         f"{(got - want).abs().max().item():.3g}): nothing uploaded; the folder "
                         f"is left in {os.fspath(folder)} to inspect")


def check_token() -> None:
    """``ValueError`` when huggingface_hub has no token (``HF_TOKEN`` or the saved login)."""
    from huggingface_hub import get_token
    if not get_token():
        raise ValueError("no Hugging Face token: run `huggingface-cli login` or set HF_TOKEN "
                         "(a token with write access to the repo's namespace)")


def upload(folder: PathLike, repo_id: str, *, private: bool = False,
           revision: Optional[str] = None, commit_message: str = "") -> str:
    """Create ``repo_id`` (if needed) and upload ``folder`` to it with huggingface_hub (token:
    ``HF_TOKEN`` or the saved login; progress bars from huggingface_hub); returns the URL of
    what was uploaded. ``ValueError`` without a token."""
    from huggingface_hub import HfApi
    check_token()
    api = HfApi(library_name="attnzoo", library_version=__version__)
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    if revision:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=os.fspath(folder), revision=revision,
                      commit_message=commit_message or f"Add {repo_id} (attnzoo publish)")
    return f"{url}/tree/{revision}" if revision else str(url)


def publish_table() -> str:
    """docs/publishing.md's table: every tag with weights, where its weights are now, its home
    in the project namespace, the source checkpoint and the command that publishes it there."""
    import timm
    rows = ["| tag | pretrained=True loads | project repo | source checkpoint | command |",
            "|---|---|---|---|---|"]
    for tag, record in sorted(WEIGHTS.items()):
        cfg = timm.get_pretrained_cfg(tag)
        arch = tag.split(".", 1)[0]
        home = hub_repo(tag)
        now = record.repo if record.published else "nothing: not on the Hub yet"
        if record.repo == home:
            source = f"the official {arch} checkpoint linked from {cfg.origin_url}"
        else:
            source = f"`{record.filename}` of https://huggingface.co/{record.repo}"
        rows.append(f"| `{tag}` | {now} | {home} | {source} | `attnzoo publish {tag} "
                    f"CHECKPOINT --repo-id {home} --eval-dir IMAGENET_VAL` |")
    return "\n".join(rows) + "\n"
