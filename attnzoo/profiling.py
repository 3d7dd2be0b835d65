"""Model size and cost accounting: parameters, fvcore-style MACs, the list of attnzoo models."""
from __future__ import annotations

import contextlib
import fnmatch
import time
from typing import Callable, List, Sequence, Union

import torch
from torch.utils.flop_counter import FlopCounterMode

from . import backends
from .ops import neighborhood

__all__ = ["count_params", "count_macs", "time_steps", "list_attnzoo_models"]


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model: torch.nn.Module, input_size: Sequence[int]) -> int:
    """Multiply-accumulates of one forward pass, counted like fvcore (the papers' convention):
    convolutions and matmuls, with each neighborhood attention counted as QK plus AV,
    ``B * heads * tokens * head_dim * kernel_area`` each, whatever its backend actually computes
    (the tiled torch reference does more, NATTEN's CPU path far more)."""
    na_macs: List[int] = []
    inside_na: List[int] = []
    param = next(model.parameters())
    x = torch.randn(*input_size, device=param.device, dtype=param.dtype)
    counter = FlopCounterMode(display=False)

    @contextlib.contextmanager
    def on_na(macs: int):
        before = counter.get_total_flops()
        yield
        inside_na.append(counter.get_total_flops() - before)
        na_macs.append(macs)

    neighborhood.MAC_COUNTERS.append(on_na)
    try:
        # The torch reference runs anywhere, the meta device included (NATTEN's Flex path cannot
        # run under a FlopCounterMode); the count does not depend on the backend.
        with torch.no_grad(), backends.use_backend("torch"), counter:
            model(x)
    finally:
        neighborhood.MAC_COUNTERS.remove(on_na)
    return (counter.get_total_flops() - sum(inside_na)) // 2 + sum(na_macs)


def time_steps(fn: Callable[[], object], device: Union[str, torch.device], warmup: int = 1,
               repeats: int = 5) -> List[float]:
    """Wall seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls; on
    CUDA each call is synchronised so its kernels are inside the measurement."""
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def list_attnzoo_models(filter: str = "", pretrained: bool = False) -> List[str]:
    """Names of the timm models that attnzoo registers; with ``pretrained``, their pretrained
    tags (``nat_mini.in1k``)."""
    import timm
    from timm.models._registry import _model_entrypoints

    ours = [n for n, fn in _model_entrypoints.items() if fn.__module__.startswith("attnzoo.")]
    names = timm.list_models(ours, pretrained=pretrained) if ours else []
    return fnmatch.filter(names, filter) if filter else names
