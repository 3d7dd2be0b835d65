"""Model size and cost accounting: parameters, fvcore-style MACs, a timing loop."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, List, Sequence, Union

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from . import backends

__all__ = ["count_params", "count_macs", "time_steps"]


def _sdpa_cpu_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)  # FlopCounterMode passes shapes


# FlopCounterMode counts SDPA's CUDA kernels and its math path (the meta device) but not the CPU
# flash kernel: without this, a model's count would depend on its device.
_SDPA_CPU = {op: _sdpa_cpu_flops for op in [
    getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)] if op is not None}


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def count_macs(model: torch.nn.Module, input_size: Sequence[int]) -> int:
    """Multiply-accumulates of one forward pass, counted like fvcore (the papers' convention):
    convolutions and matmuls as PyTorch's FlopCounterMode sees them, and every registered
    attnzoo op by its registered MAC formula, whatever its backend actually computes (the tiled
    NA reference does more, an elementwise aggregation shows FlopCounterMode nothing)."""
    param = next(model.parameters())
    x = torch.randn(*input_size, device=param.device, dtype=param.dtype)
    counter = FlopCounterMode(display=False, custom_mapping=_SDPA_CPU)
    seen_flops, op_macs = [0], [0]

    @contextlib.contextmanager
    def observer(op: str, backend: str, macs: int):
        before = counter.get_total_flops()
        yield
        seen_flops[0] += counter.get_total_flops() - before
        op_macs[0] += macs

    # The torch references run anywhere, the meta device included (NATTEN's Flex path cannot
    # run under a FlopCounterMode); the count does not depend on the backend.
    with torch.no_grad(), backends.use_backend("torch"), backends.observe_ops(observer), counter:
        model(x)
    return (counter.get_total_flops() - seen_flops[0]) // 2 + op_macs[0]


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
