"""attnzoo's fused GPU kernels, written in Triton (the ``cuda`` backend of the ops).

One module per op family (``neighborhood.py``), each exposing a ``torch.autograd.Function``
with forward and backward; ``tiling.py`` holds what the families share (window arithmetic, query
tiles and the key regions they stream, strided loads, the online-softmax step).

Triton is optional: importing :mod:`attnzoo.kernels` does not import it. The kernels run on CUDA
tensors; on CPU tensors only under Triton's interpreter, which is how CI proves them correct:
``TRITON_INTERPRET=1`` must be set when a kernel module is first imported (Triton then builds
interpreted functions) and while the kernels run on CPU (:func:`interpreter_enabled`).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

__all__ = ["triton_missing", "interpreter_enabled"]


def interpreter_enabled() -> bool:
    """TRITON_INTERPRET is set now (parsed the way Triton parses it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


# tl.gather (the rpb gradient) appeared in Triton 3.2.
MIN_TRITON = (3, 2)


@functools.lru_cache(maxsize=1)
def triton_missing() -> Optional[str]:
    """``None`` when a usable Triton is importable, else why not (with what to install)."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        return (f"Triton is not installed ({e}); install it with `pip install triton` "
                "(it ships with PyTorch's CUDA wheels on Linux)")
    version = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRITON or not hasattr(tl, "gather"):
        return (f"Triton {triton.__version__} is too old: attnzoo's kernels need Triton >= "
                f"{'.'.join(map(str, MIN_TRITON))} (`pip install -U triton`)")
    return None
