"""Attention weights of any attnzoo attention layer, and of a model's chosen layers.

Every attention layer (:class:`NeighborhoodAttention2d`, :class:`QnA`, :class:`QnAUpsample`,
:class:`LocalSelfAttention`, :class:`SAM`, :class:`QuestAttention`) has an
``attention_map(x)`` method: the weights its forward uses for input ``x``, computed through the
unfused ops (:func:`attnzoo.ops.na2d_qk`, :func:`attnzoo.ops.qna2d_weights`, ...) whatever
backend the forward runs, as an :class:`AttentionMap`. :func:`record_attention` collects them
from a model's forward (a forward hook per chosen layer), so the model computes exactly what it
computes without it; :func:`attention_maps` is the one-call form.
"""
from __future__ import annotations

import contextlib
import re
from typing import Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

__all__ = ["AttentionMap", "attention_layers", "record_attention", "attention_maps"]


class AttentionMap(NamedTuple):
    """One layer's attention weights for one input.

    Attributes:
        weights: the weights, whose dims ``axes`` names. Local layers put the query grid first:
            ``("batch", "y", "x", ..., "key")``, ``key`` indexing the query's window (its
            positions in ``keys``). Global attention (QUEST-ViT):
            ``("batch", "head", "query", "key")`` over every token, prefix tokens first.
        axes: the name of each dim of ``weights``:

            * NAT / DiNAT: ``batch, y, x, head, key`` (softmax over ``key``);
            * QnA: ``batch, y, x, query, head, key``, per learned query (softmax over the
              window's in-bounds keys; the layer then scales them by its window weights);
            * QnA-ViT's LSA blocks: ``batch, y, x, head, key`` (softmax within the window);
            * SAN: ``batch, y, x, group, key``, one weight per channel group (pairwise: softmax
              over ``key``; patchwise: unnormalised, as the paper's);
            * QUEST-ViT: ``batch, head, query, key``.
        keys: ``[*query grid, key, 2]`` int64, the ``(y, x)`` of each window key on the layer's
            input map (positions outside it, a QnA window at the border or NAT's padding of
            small maps, are kept); ``None`` for global attention.
        map_size: ``(H, W)`` of the layer's input map (``None`` for tokens).
        stride: a query at grid ``(y, x)`` sits at ``(y * stride, x * stride)`` of the map.
    """
    weights: torch.Tensor
    axes: Tuple[str, ...]
    keys: Optional[torch.Tensor] = None
    map_size: Optional[Tuple[int, int]] = None
    stride: int = 1


def attention_layers(model: nn.Module) -> Dict[str, nn.Module]:
    """The modules of ``model`` that give attention maps, by name, in forward order."""
    return {name: m for name, m in model.named_modules()
            if callable(getattr(m, "attention_map", None))}


def _resolve(model: nn.Module, layers: Union[None, str, Sequence[str]]) -> Dict[str, nn.Module]:
    found = attention_layers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no attnzoo attention layer")
    if layers is None:
        return found
    chosen = {}
    for layer in [layers] if isinstance(layers, str) else layers:
        # "stages.0.blocks.1.attn", "stages.0.blocks.1", or the short "0.1" (stage.block) / "5"
        # (ViT block)
        candidates = [str(layer), f"{layer}.attn"]
        if re.fullmatch(r"\d+\.\d+", str(layer)):
            stage, block = str(layer).split(".")
            candidates.append(f"stages.{stage}.blocks.{block}.attn")
        elif re.fullmatch(r"\d+", str(layer)):
            candidates.append(f"blocks.{layer}.attn")
        name = next((c for c in candidates if c in found), None)
        if name is None:
            names = list(found)
            first = f".{names[0]}"  # a ViT's blocks (features_only's too) have no stage
            short = "'BLOCK'" if ".blocks." in first and ".stages." not in first else (
                "'STAGE.BLOCK'")
            raise ValueError(f"layers: {layer!r} is not an attention layer of "
                             f"{type(model).__name__}; accepted: {short} or a name, e.g. "
                             f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} "
                             f"({len(names)} in all)")
        chosen[name] = found[name]
    return chosen


@contextlib.contextmanager
def record_attention(model: nn.Module, layers: Union[None, str, Sequence[str]] = None
                     ) -> Iterator[Dict[str, AttentionMap]]:
    """Within the block, each forward of ``model`` fills the yielded dict with the
    :class:`AttentionMap` of each chosen layer (its last call), by module name. The model's
    forward is unchanged (the maps are computed beside it, from each layer's input).

    Args:
        layers: ``None`` (every attention layer), a module name, ``"STAGE.BLOCK"`` for the
            staged families (NAT, DiNAT, QnA-ViT, SAN) or ``"BLOCK"`` for ViTs, or a list.

    Example::

        >>> with attnzoo.record_attention(model, "1.0") as maps:
        ...     logits = model(x)
        >>> maps["stages.1.blocks.0.attn"].weights.shape   # NAT: [B, H, W, heads, K*K]
    """
    maps: Dict[str, AttentionMap] = {}
    handles: List[torch.utils.hooks.RemovableHandle] = []

    def hook(name):
        def record(module, args, kwargs, output):
            maps[name] = module.attention_map(*args, **kwargs)
        return record

    try:
        for name, module in _resolve(model, layers).items():
            handles.append(module.register_forward_hook(hook(name), with_kwargs=True))
        yield maps
    finally:
        for handle in handles:
            handle.remove()


def attention_maps(model: nn.Module, x: torch.Tensor,
                   layers: Union[None, str, Sequence[str]] = None) -> Dict[str, AttentionMap]:
    """``model(x)``'s attention maps of ``layers`` (see :func:`record_attention`), computed
    without gradients; the model's train/eval mode is the caller's (use ``model.eval()``)."""
    with torch.no_grad(), record_attention(model, layers) as maps:
        model(x)
    return dict(maps)
