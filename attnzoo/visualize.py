"""Pictures of attention: one query's weights from an :class:`attnzoo.AttentionMap`, laid over
the image (``attnzoo attention``). matplotlib is optional (``pip install matplotlib``)."""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from .layers import AttentionMap

__all__ = ["query_grid", "query_heat", "draw_attention"]

_INSTALL = "pip install matplotlib"


def query_grid(amap: AttentionMap, num_prefix_tokens: int = 0) -> Tuple[int, int]:
    """The ``(rows, columns)`` of the map's queries (for tokens: the patch grid, which must be
    square unless the weights say otherwise)."""
    if amap.keys is not None:
        return tuple(amap.weights.shape[1:3])
    patches = amap.weights.shape[-1] - num_prefix_tokens
    side = int(round(patches ** 0.5))
    if side * side != patches:
        raise ValueError(f"a global map of {patches} patch tokens is not a square grid")
    return side, side


def query_heat(amap: AttentionMap, query: Tuple[int, int], head: Union[int, str] = "mean",
               num_prefix_tokens: int = 0) -> torch.Tensor:
    """The first image's attention of the query at grid ``query`` (row, column) over the keys,
    on the layer's input map ``[heads or 1, H, W]`` (for tokens: the patch grid): ``head`` an
    index of the map's head (SAN: group) axis, ``"mean"`` (their average) or ``"all"`` (each).
    QnA's learned queries are averaged (each one's weights sum to 1 over its window); keys
    outside the map are left out, and two taps on one position (SAN's reflection at a border)
    add up."""
    rows, cols = query_grid(amap, num_prefix_tokens)
    y, x = query
    if not (0 <= y < rows and 0 <= x < cols):
        raise ValueError(f"query ({y}, {x}) is outside the {rows}x{cols} query grid")
    axes = amap.axes
    heads_axis = axes.index("head") if "head" in axes else axes.index("group")
    if amap.keys is None:  # tokens: [B, heads, N, N]
        w = amap.weights[0, :, num_prefix_tokens + y * cols + x, num_prefix_tokens:]
        w = w.reshape(-1, rows, cols)
    else:
        w = amap.weights[0, y, x]                         # [(query,) heads/groups, key]
        if "query" in axes:
            w = w.mean(axes.index("query") - 3)
        H, W = amap.map_size
        keys = amap.keys[y, x]                            # [key, 2]
        inside = (keys[:, 0] >= 0) & (keys[:, 0] < H) & (keys[:, 1] >= 0) & (keys[:, 1] < W)
        flat = (keys[:, 0] * W + keys[:, 1])[inside]
        heat = w.new_zeros(w.shape[0], H * W)
        heat.index_add_(1, flat, w[:, inside])
        w = heat.reshape(-1, H, W)
    heads = w.shape[0]
    if head == "mean":
        return w.float().mean(0, keepdim=True)
    if head == "all":
        return w.float()
    if not isinstance(head, int) or not 0 <= head < heads:
        name = axes[heads_axis]
        raise ValueError(f"head must be 'mean', 'all' or a {name} index below {heads}, "
                         f"got {head!r}")
    return w[head:head + 1].float()


def draw_attention(image, heat: torch.Tensor, query_xy: Tuple[float, float], out: str,
                   title: str, labels: Optional[List[str]] = None) -> None:
    """Save ``image`` (a PIL image) with each ``heat [n, h, w]`` map stretched over it, one
    panel per map, the query marked."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy
    except ImportError as e:
        raise ImportError(f"drawing attention needs matplotlib, not installed: {_INSTALL}") from e
    n = heat.shape[0]
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 4 * rows + 0.6), squeeze=False)
    W, H = image.size
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= n:
            continue
        ax.imshow(image)
        # keys with no weight stay transparent: the picture shows the window itself
        weights = heat[i].numpy()
        ax.imshow(numpy.ma.masked_where(weights <= 0, weights), extent=(0, W, H, 0),
                  cmap="inferno", vmin=0, alpha=0.75, interpolation="nearest")
        ax.plot(*query_xy, marker="+", color="cyan", markersize=14, mew=2)
        if labels:
            ax.set_title(labels[i], fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
