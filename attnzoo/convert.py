"""Official checkpoints of every family -> the state dict of ``timm.create_model(model_name)``.

``load_official(model_name, path)`` reads the file (a family may provide its own reader, named
``read_checkpoint(path)`` in its model module, for files that are not torch / safetensors
checkpoints, e.g. QnA-ViT's Flax msgpack; torch and safetensors files, told by their first
bytes, always go to :func:`read_checkpoint` here) and converts it with the family's
``checkpoint_filter_fn``, which checks every key and shape. ``save_converted`` writes the result
as safetensors, which timm loads with::

    timm.create_model(model_name, pretrained=True, pretrained_cfg_overlay=dict(file=PATH))
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Union

import torch

__all__ = ["load_official", "read_checkpoint", "save_converted"]

PathLike = Union[str, os.PathLike]


def read_checkpoint(path: PathLike) -> Dict[str, Any]:
    """A torch (``.pth`` / ``.bin`` / ``.pt``) or safetensors checkpoint, tensors on the CPU."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if path.endswith(".safetensors"):
        import safetensors.torch
        return safetensors.torch.load_file(path, device="cpu")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - report what the file is not, with the cause
        raise ValueError(f"{path!r} is not a torch or safetensors checkpoint this model's family "
                         f"can read ({type(e).__name__}: {e})") from e


def _is_torch_file(path: PathLike) -> bool:
    """A torch (zip or legacy pickle) or safetensors file, by its first bytes."""
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04" or (len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return True  # torch.save: a zip archive, or a pickle (PROTO opcode, protocol 2-5)
    # safetensors: little-endian u64 header length, then the JSON header
    return len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") > 1


def load_official(model_name: str, path: PathLike, **model_kwargs) -> Dict[str, torch.Tensor]:
    """Read an official checkpoint of ``model_name``'s family and convert it to the state dict of
    ``timm.create_model(model_name, **model_kwargs)``; raises ``ValueError`` naming what does not
    match."""
    import timm

    from .models import list_models
    if model_name.split(".", 1)[0] not in list_models():
        raise ValueError(f"{model_name!r} is not an attnzoo model; `attnzoo list` names them")
    model = timm.create_model(model_name, pretrained=False, device="meta", **model_kwargs)
    module = sys.modules[type(model).__module__]
    reader = getattr(module, "read_checkpoint", read_checkpoint)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {os.fspath(path)!r} does not exist")
    if _is_torch_file(path):
        reader = read_checkpoint
    state_dict = module.checkpoint_filter_fn(reader(path), model)
    return {k: v.contiguous() for k, v in state_dict.items()}


def save_converted(state_dict: Dict[str, torch.Tensor], path: PathLike) -> None:
    """Write a converted state dict as safetensors (what timm's ``file=`` overlay loads)."""
    import safetensors.torch
    safetensors.torch.save_file({k: v.contiguous() for k, v in state_dict.items()}, os.fspath(path))
