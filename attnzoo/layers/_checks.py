"""Argument and input checks the layers (and the models' builder) share: a mistake named where
it is made, instead of a division by zero in a constructor or a matmul's shape error at the
first forward. (No ``from __future__ import annotations``: TorchScript reads check_map's
annotations.)"""
import torch
from timm.models import register_notrace_function

__all__ = ["check_sizes", "check_map"]


def check_sizes(owner: str, **sizes: object) -> None:
    """Each of ``sizes`` (a dimension, a head or query count) is an int >= 1, not a bool."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} "
                            f"{value!r}")
        if value < 1:
            raise ValueError(f"{owner}: {name} must be >= 1, got {value}")


@register_notrace_function  # an FX leaf (and torch.fx.wrap where it is called): reads sizes
@torch.jit.ignore
def check_map(x: torch.Tensor, dim: int, owner: str) -> torch.Tensor:
    """``x`` is a channels-last map ``[B, H, W, dim]``; returned as it is."""
    if x.dim() != 4 or x.shape[-1] != dim:
        raise ValueError(f"{owner}: the input must be a channels-last map [B, H, W, {dim}] "
                         f"(NHWC), got shape {tuple(x.shape)}")
    return x
