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
    """Save ``image`` (a PIL image, drawn at its own aspect ratio) with each ``heat [n, h, w]``
    map stretched over it, one panel per map: the query marked (+), axes in the image's pixels, and
    a colour bar with the map's range. Positions outside the query's window (weight exactly 0)
    stay transparent. Weights that can be negative (SAN's patchwise weights are not normalised)
    take a diverging map centred on 0; softmax weights a sequential one from 0."""
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
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 4 * rows + 0.9), squeeze=False)
    W, H = image.size
    for i, ax in enumerate(axes.flat):
        if i >= n:
            ax.axis("off")
            continue
        ax.imshow(image)
        weights = heat[i].numpy()
        low, high = float(weights.min()), float(weights.max())
        if low < 0:  # signed weights: white at 0, red above, blue below
            bound = max(-low, high) or 1.0
            style = dict(cmap="RdBu_r", vmin=-bound, vmax=bound)
        else:
            style = dict(cmap="inferno", vmin=0, vmax=high or 1.0)
        drawn = ax.imshow(numpy.ma.masked_where(weights == 0, weights), extent=(0, W, H, 0),
                          alpha=0.75, interpolation="nearest", **style)
        bar = fig.colorbar(drawn, ax=ax, fraction=0.046, pad=0.03)
        bar.set_label(f"weight, {low:.3g} to {high:.3g}", fontsize=8)
        bar.ax.tick_params(labelsize=7)
        ax.plot(*query_xy, marker="+", markersize=9, color="black", mew=3)
        ax.plot(*query_xy, marker="+", markersize=9, color="cyan", mew=1.5)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("x (pixels)", fontsize=8)
        ax.set_ylabel("y (pixels)", fontsize=8)
        if labels:
            ax.set_title(labels[i], fontsize=10)
    import textwrap  # the title's lines fit the panels' width (a 4-inch panel at 100 dpi holds
    # ~50 characters of 10 pt text: 55 were 410 px wide, cut at both edges of one panel)
    fig.suptitle("\n".join(textwrap.fill(line, 48 * cols) for line in title.splitlines()),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
