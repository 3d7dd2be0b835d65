"""Model size and cost accounting: parameters, fvcore-style MACs, the list of attnzoo models."""
from __future__ import annotations

import fnmatch
from typing import List, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from .ops import neighborhood

__all__ = ["count_params", "count_macs", "list_attnzoo_models"]


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model: torch.nn.Module, input_size: Sequence[int]) -> int:
    """Multiply-accumulates of one forward pass, counted like fvcore (the papers' convention):
    convolutions and matmuls, with each neighborhood attention counted as QK plus AV,
    ``B * heads * tokens * head_dim * kernel_area`` each, whichever backend runs it (the dense
    or tiled torch reference computes more than that)."""
    na_macs: List[int] = []
    param = next(model.parameters())
    x = torch.randn(*input_size, device=param.device, dtype=param.dtype)
    neighborhood.MAC_COUNTERS.append(na_macs.append)
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x)
    finally:
        neighborhood.MAC_COUNTERS.remove(na_macs.append)
    flops = sum(v for op, v in counter.get_flop_counts()["Global"].items()
                if "scaled_dot_product" not in str(op))
    return flops // 2 + sum(na_macs)


def list_attnzoo_models(filter: str = "", pretrained: bool = False) -> List[str]:
    """Names of the timm models that attnzoo registers; with ``pretrained``, their pretrained
    tags (``nat_mini.in1k``)."""
    import timm
    from timm.models._registry import _model_entrypoints

    ours = [n for n, fn in _model_entrypoints.items() if fn.__module__.startswith("attnzoo.")]
    names = timm.list_models(ours, pretrained=pretrained) if ours else []
    return fnmatch.filter(names, filter) if filter else names
