"""QnA-ViT's token mixers as ``nn.Module`` s on NHWC feature maps ``[B, H, W, C]``.

* :class:`QnA` - Query and Attend (Arar et al., CVPR 2022): ``L`` learned queries, shared by
  every overlapping ``k x k`` window, attend to the window's keys; stride 2 downsamples.
* :class:`QnAUpsample` - QnA as an upsampling layer (the paper's Section 3.3.3 / Appendix F):
  ``s*s`` learned queries, each query's result one sub-pixel of the ``s x`` upsampled map.
* :class:`LocalSelfAttention` - QnA-ViT's "LSA" blocks' mixer: multi-head self-attention inside
  non-overlapping windows, with a Swin-style relative position bias table.

Backend dispatch happens in plain module-level functions (:func:`qna2d_dispatch` is
``@torch.jit.ignore``, so scripted models call it as Python and the backend switch keeps
working) registered with timm as FX leaves, as are the shape-dependent window helpers. Their
names must not start with ``_`` (torch.fx's autowrap skips private globals).
"""
import math
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import lecun_normal_, trunc_normal_
from timm.models import register_notrace_function

from .. import backends
from ..ops import qna2d, qna2d_weights, qna_window_positions
from ..ops.qna import qna_export_rows
from ._checks import check_map, check_sizes
from .attention_map import AttentionMap
from .quest import check_attn_norm, l2_normalize

__all__ = ["QnA", "QnAUpsample", "LocalSelfAttention"]


@register_notrace_function
@torch.jit.ignore
def qna2d_dispatch(
        logits: torch.Tensor,
        v: torch.Tensor,
        kernel_size: int,
        stride: int,
        rpb: Optional[torch.Tensor],
        window_weights: Optional[torch.Tensor],
        sum_queries: bool,
        backend: Optional[str],
) -> torch.Tensor:
    # Kept out of TorchScript: backend resolution reads thread-local state, env vars and caches.
    return qna2d(logits, v, kernel_size=kernel_size, stride=stride, rpb=rpb,
                 window_weights=window_weights, sum_queries=sum_queries, backend=backend)


def fused_query_keys(queries: torch.Tensor, key_weight: torch.Tensor,
                     num_heads: int) -> torch.Tensor:
    """The learned queries fused with the key projection, ``W_k q_hat``, ``[C, L * heads]``:
    each head's query L2-normalised (``q / (|q| + 1e-6)``, the official form) and divided by
    ``sqrt(head_dim)``. ``queries [L, F]``, ``key_weight [F, C]`` (an ``nn.Linear`` weight)."""
    L, dim = queries.shape
    head_dim = dim // num_heads
    q = queries.reshape(L, num_heads, head_dim)
    q = q / (torch.linalg.vector_norm(q, dim=-1, keepdim=True) + 1e-6) / math.sqrt(head_dim)
    fused = torch.einsum('lhd,hdc->clh', q, key_weight.reshape(num_heads, head_dim, -1))
    return fused.reshape(fused.shape[0], L * num_heads)


def qna_logits(x: torch.Tensor, queries: torch.Tensor, key_weight: torch.Tensor,
               num_heads: int) -> torch.Tensor:
    """Every learned query's score against the key at every position, ``[B, H, W, L, heads]``,
    computed fused as ``x @ (W_k q_hat)`` (:func:`fused_query_keys`): the ``[B, H, W, dim]``
    keys are never built."""
    logits = torch.matmul(x, fused_query_keys(queries, key_weight, num_heads))
    # reshape by x's sizes, not unflatten: the TorchScript ONNX exporter bakes unflatten's in
    return logits.reshape(x.shape[0], x.shape[1], x.shape[2], queries.shape[0], num_heads)


class _QueriesAndAttend(nn.Module):
    """What :class:`QnA` and :class:`QnAUpsample` share: learned queries, the key and value
    projections, the output projection and the relative bias per window offset."""

    def __init__(self, dim: int, out_dim: int, num_heads: int, num_queries: int,
                 kernel_size: int, rel_pos_bias: bool, bias: bool, proj_drop: float,
                 backend: Optional[str], device, dtype):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        self.layer_name = type(self).__name__  # as errors name it (QnA or QnAUpsample)
        check_sizes(self.layer_name, dim=dim, out_dim=out_dim, num_heads=num_heads,
                    num_queries=num_queries)
        if out_dim % num_heads:
            raise ValueError(f"out_dim ({out_dim}) must be divisible by num_heads ({num_heads})")
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or \
                kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd int >= 1, got {kernel_size!r}")
        if backend is not None:
            backends.get_backend(backend)  # unknown names raise ValueError now, not at forward
        self.dim = dim
        self.out_dim = out_dim
        self.num_heads = num_heads
        self.head_dim = out_dim // num_heads
        self.num_queries = num_queries
        self.kernel_size = kernel_size
        self.backend = backend
        self.queries = nn.Parameter(torch.empty(num_queries, out_dim, **dd))
        # Keys: only the weight is used (fused into the queries); a key bias would add one
        # constant per query and head to the logits, which the softmax cancels.
        self.k = nn.Linear(dim, out_dim, bias=False, **dd)
        self.v = nn.Linear(dim, out_dim, bias=bias, **dd)
        self.proj = nn.Linear(out_dim, out_dim, bias=bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        shape = (num_queries, num_heads, kernel_size, kernel_size)
        if rel_pos_bias:
            self.rpb = nn.Parameter(torch.empty(shape, **dd))
        else:
            self.register_parameter("rpb", None)

    def reset_parameters(self) -> None:
        # Official init: queries trunc_normal(+-2 sigma) * sqrt(1 / head_dim), projections
        # lecun_normal, zero biases, zero relative bias.
        trunc_normal_(self.queries, std=1., a=-2., b=2.)
        with torch.no_grad():
            self.queries.mul_(self.head_dim ** -0.5)
        for linear in (self.k, self.v, self.proj):
            lecun_normal_(linear.weight)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.rpb is not None:
            nn.init.zeros_(self.rpb)

    def logits_and_values(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x = check_map(x, self.dim, self.layer_name)
        logits = qna_logits(x, self.queries, self.k.weight, self.num_heads)
        v = self.v(x).reshape(x.shape[0], x.shape[1], x.shape[2], self.num_heads, self.head_dim)
        return logits, v

    def window_map(self, x: torch.Tensor, stride: int) -> AttentionMap:
        weights = qna2d_weights(qna_logits(x, self.queries, self.k.weight, self.num_heads),
                                kernel_size=self.kernel_size, stride=stride, rpb=self.rpb)
        keys = qna_window_positions(x.shape[1], x.shape[2], kernel_size=self.kernel_size,
                                    stride=stride, device=x.device)
        return AttentionMap(weights, ("batch", "y", "x", "query", "head", "key"), keys,
                            (x.shape[1], x.shape[2]), stride)


class QnA(_QueriesAndAttend):
    """Query and Attend on ``[B, H, W, dim]`` -> ``[B, ceil(H/stride), ceil(W/stride), out_dim]``.

    ``num_queries`` learned queries (per head, L2-normalised, scaled by ``head_dim ** -0.5``)
    attend to the keys of the ``k x k`` window centred at each output position (stride
    ``stride``); out-of-bounds keys are excluded. Each query's softmax weights get a relative
    bias ``rpb [L, heads, k, k]`` per window offset, are scaled by ``window_weights`` (same
    shape, numerator only) and the queries' results are summed, then projected (``proj``). See
    :func:`attnzoo.ops.qna2d`.

    Args:
        dim: input channels.
        out_dim: output channels F (default ``dim``; QnA-ViT's downsampling layers double it).
        num_heads: heads (QnA-ViT: head_dim 8).
        kernel_size: odd window size k.
        stride: window stride (2 downsamples).
        num_queries: learned queries L.
        rel_pos_bias: learn ``rpb`` (zero init).
        window_weights: learn ``window_weights`` (init N(0, 0.02^2)); without them each query's
            result is a plain softmax average.
        bias: biases on the value and output projections (QnA-ViT: none).
        proj_drop: dropout after ``proj``.
        backend: ``qna2d`` backend (``None``: follow :mod:`attnzoo.backends`).
    """

    def __init__(
            self,
            dim: int,
            out_dim: Optional[int] = None,
            num_heads: int = 8,
            kernel_size: int = 3,
            stride: int = 1,
            num_queries: int = 2,
            rel_pos_bias: bool = True,
            window_weights: bool = True,
            bias: bool = False,
            proj_drop: float = 0.,
            backend: Optional[str] = None,
            device=None, dtype=None,
    ):
        super().__init__(dim, out_dim or dim, num_heads, num_queries, kernel_size, rel_pos_bias,
                         bias, proj_drop, backend, device, dtype)
        if not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be an int >= 1, got {stride!r}")
        self.stride = stride
        if window_weights:
            self.window_weights = nn.Parameter(torch.empty(
                num_queries, num_heads, kernel_size, kernel_size, device=device, dtype=dtype))
        else:
            self.register_parameter("window_weights", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.window_weights is not None:
            nn.init.normal_(self.window_weights, std=.02)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, out_dim={self.out_dim}, num_heads={self.num_heads}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"num_queries={self.num_queries}, backend={self.backend!r}")

    def attention_map(self, x: torch.Tensor) -> AttentionMap:
        """Each learned query's softmax weights over each window in ``forward(x)``,
        ``[B, H_out, W_out, queries, heads, k*k]`` (before the window weights scale them), and
        where each window lies (:func:`attnzoo.ops.qna2d_weights`)."""
        return self.window_map(x, self.stride)

    def forward_rows(self, x: torch.Tensor, layout: Tuple[int, int, int]) -> torch.Tensor:
        """``forward`` while exporting, on the map's rows ``[B * H * W, dim]`` (``layout``:
        ``(B, H, W)``); returns the output map's rows ``[B * Ho * Wo, out_dim]``. QnA's export
        formula (:func:`attnzoo.ops.qna.qna_export_rows`): on rows, every reshape is of static
        sizes (the exporters' symbolic-shape work per node grows with a tensor's symbolic
        dims)."""
        fused = fused_query_keys(self.queries, self.k.weight, self.num_heads)
        logits = torch.matmul(x, fused).reshape(-1, self.num_queries, self.num_heads)
        v = self.v(x).reshape(-1, self.num_heads, self.head_dim)
        x = qna_export_rows(logits, v, layout, self.kernel_size, self.stride, self.rpb,
                            self.window_weights, True)
        return backends.export_dropout(self.proj_drop, self.proj(x.reshape(-1, self.out_dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (is_scripting() first: TorchScript compiles neither the check nor the export branch)
        if not torch.jit.is_scripting():
            if backends.exporting():
                B, H, W = x.shape[0], x.shape[1], x.shape[2]
                x = self.forward_rows(x.reshape(-1, x.shape[3]), (B, H, W))
                Ho, Wo = (H - 1) // self.stride + 1, (W - 1) // self.stride + 1
                return x.reshape(B, Ho, Wo, self.out_dim)
        logits, v = self.logits_and_values(x)
        x = qna2d_dispatch(logits, v, self.kernel_size, self.stride, self.rpb,
                           self.window_weights, True, self.backend)
        x = self.proj(x.flatten(-2))
        x = self.proj_drop(x)
        return x


class QnAUpsample(_QueriesAndAttend):
    """QnA as an upsampling layer: ``[B, H, W, dim]`` -> ``[B, scale*H, scale*W, out_dim]``.

    ``scale ** 2`` learned queries attend to every ``k x k`` window (stride 1); query
    ``l = i * scale + j``'s result (softmax average of the values, with its own relative bias
    per window offset, then ``proj``) becomes sub-pixel ``(i, j)`` of the window's
    ``scale x scale`` output block: a content-adaptive ``scale x scale`` upsampling kernel
    (the paper's Eq. 10-11).

    Example, a decoder stage on NCHW maps (channels last inside, as every QnA layer)::

        >>> import torch
        >>> from attnzoo.layers import QnAUpsample
        >>> up = QnAUpsample(64, 32, num_heads=4, scale=2)
        >>> norm = torch.nn.LayerNorm(64)
        >>> x = torch.randn(2, 64, 16, 24)                     # [B, C, H, W]
        >>> y = up(norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        >>> y.shape
        torch.Size([2, 32, 32, 48])

    Args (the others as :class:`QnA`'s):
        scale: upsampling factor s (``s*s`` learned queries).
        kernel_size: odd window size k (the paper's autoencoder: 3).
        rel_pos_bias: learn a relative bias per query, head and window offset.
    """

    def __init__(
            self,
            dim: int,
            out_dim: Optional[int] = None,
            num_heads: int = 8,
            scale: int = 2,
            kernel_size: int = 3,
            rel_pos_bias: bool = True,
            bias: bool = False,
            proj_drop: float = 0.,
            backend: Optional[str] = None,
            device=None, dtype=None,
    ):
        if not isinstance(scale, int) or scale < 1:
            raise ValueError(f"scale must be an int >= 1, got {scale!r}")
        super().__init__(dim, out_dim or dim, num_heads, scale * scale, kernel_size,
                         rel_pos_bias, bias, proj_drop, backend, device, dtype)
        self.scale = scale
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, out_dim={self.out_dim}, num_heads={self.num_heads}, "
                f"scale={self.scale}, kernel_size={self.kernel_size}, backend={self.backend!r}")

    def attention_map(self, x: torch.Tensor) -> AttentionMap:
        """Each sub-pixel query's softmax weights over each window (stride 1),
        ``[B, H, W, scale**2, heads, k*k]``; query ``i * scale + j`` makes sub-pixel
        ``(i, j)``."""
        return self.window_map(x, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W = x.shape[0], x.shape[1], x.shape[2]
        logits, v = self.logits_and_values(x)
        x = qna2d_dispatch(logits, v, self.kernel_size, 1, self.rpb, None, False, self.backend)
        x = self.proj(x.flatten(-2))                        # [B, H, W, s*s, out_dim]
        x = self.proj_drop(x)
        s = self.scale
        x = x.reshape(B, H, W, s, s, self.out_dim).permute(0, 1, 3, 2, 4, 5)
        return x.reshape(B, H * s, W * s, self.out_dim)


# --------------------------------------------------------------------------------------------
# LSA: window self-attention
# --------------------------------------------------------------------------------------------

def window_layout(size: int, window_size: int) -> Tuple[int, int]:
    """``(window, count)`` along one axis: the fewest windows of at most ``window_size`` that
    cover ``size``, made as equal as possible (the last one padded)."""
    count = (size + window_size - 1) // window_size
    window = (size + count - 1) // count
    return window, count


def relative_position_index(win_h: int, win_w: int, window_size: int,
                            device: torch.device) -> torch.Tensor:
    """``[N, N]`` rows of a ``((2w-1)^2, heads)`` bias table (``w = window_size``) for a
    ``win_h x win_w`` window, ``N = win_h * win_w``: Swin's index, query minus key offsets."""
    rows = torch.arange(win_h, device=device)
    cols = torch.arange(win_w, device=device)
    dy = rows.view(win_h, 1, 1, 1) - rows.view(1, 1, win_h, 1) + window_size - 1
    dx = cols.view(1, win_w, 1, 1) - cols.view(1, 1, 1, win_w) + window_size - 1
    return (dy * (2 * window_size - 1) + dx).reshape(win_h * win_w, win_h * win_w)


def _layout_tensors(H: int, W: int, window_size: int, padded: bool, device: torch.device
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What the window layout alone decides: each window's ``[n * n]`` rows of the bias table and,
    where the map is padded, which of each window's keys lie in the padding,
    ``[nh * nw, 1, 1, n]`` (``n = wh * ww``)."""
    wh, nh = window_layout(H, window_size)
    ww, nw = window_layout(W, window_size)
    index = relative_position_index(wh, ww, window_size, device).reshape(-1)
    if not padded:
        return index, None
    valid = ((torch.arange(nh * wh, device=device) < H).view(nh * wh, 1)
             & (torch.arange(nw * ww, device=device) < W).view(1, nw * ww))
    return index, ~valid.reshape(nh, wh, nw, ww).permute(0, 2, 1, 3).reshape(nh * nw, 1, 1,
                                                                              wh * ww)


def _window_bias(table: torch.Tensor, index: torch.Tensor, n: int, num_heads: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """A window's relative biases from ``table`` by its rows ``index [n * n]``,
    ``[heads, n, n]`` in ``dtype``."""
    bias = table.index_select(0, index).reshape(n, n, num_heads).permute(2, 0, 1)
    return bias if bias.dtype == dtype else bias.to(dtype)


def _window_axis(L, window_size: int, device: torch.device):
    """One axis of :func:`window_attention`'s windows at size ``L``: ``count`` windows, each in
    a slot of ``width`` positions; which token fills each slot position (``[count * width]``;
    0 where none, then not ``valid``), each token's slot position (``[L]``), ``count`` and
    ``width``. At a static size the windows are :func:`window_layout`'s, as wide as their slots.
    At a traced size the slots are ``window_size`` wide and the window, ``ceil(L / count)``, is
    computed by tensor ops: as a size it would be ``L`` divided by an expression of ``L``,
    which every later shape would carry (torch.export and the dynamo exporter's decompositions
    ran several times slower per block)."""
    if isinstance(L, int):
        width, count = window_layout(L, window_size)
        token = torch.arange(count * width, device=device)
        return token, token < L, torch.arange(L, device=device), count, width
    w = window_size
    count = (L + w - 1) // w
    s = torch.arange(count * w, device=device)
    window = torch.div(s - s + (L + count - 1), count, rounding_mode="floor")
    token = torch.div(s, w, rounding_mode="floor") * window + s % w
    valid = (s % w < window) & (token < L)
    y = torch.arange(L, device=device)
    window_y = torch.div(y - y + (L + count - 1), count, rounding_mode="floor")
    slot = torch.div(y, window_y, rounding_mode="floor") * w + y % window_y
    return token, valid, slot, count, w


class _WindowRows(NamedTuple):
    """:func:`window_attention_rows`' windows on the rows of a batch of maps."""
    gather: torch.Tensor  # [3 * B * nW * n]: the q, then k, then v rows of each window's tokens
    scatter: torch.Tensor  # [B * H * W]: each token's row of the windows' output
    invalid: Optional[torch.Tensor]  # [B * nW, 1, 1, n]: padding keys; None where none
    n: int  # slot positions per window
    bias_index: torch.Tensor  # [n * n]: the bias table's rows for a window


def _window_rows(B, H, W, window_size: int, device: torch.device) -> _WindowRows:
    """The windows of a batch of ``B`` maps of ``H x W`` (:func:`_window_axis` per axis), as
    rows of the maps' flattened tokens; tensor ops of the sizes only."""
    rows, valid_r, slot_r, nh, wh = _window_axis(H, window_size, device)
    cols, valid_c, slot_c, nw, ww = _window_axis(W, window_size, device)
    n = wh * ww
    batch = torch.arange(B, device=device)
    token = rows.view(1, -1, 1, wh, 1) * W + cols.view(1, 1, -1, 1, ww)     # [1, nh, nw, wh, ww]
    valid = valid_r.view(1, -1, 1, wh, 1) & valid_c.view(1, 1, -1, 1, ww)
    # rows of the qkv projection with a zero token in front, 3 rows a token (its q, k and v):
    # slot positions without a token read the zero token
    token = torch.where(valid, token + batch.view(-1, 1, 1, 1, 1) * (H * W) + 1, 0)
    gather = token.view(1, -1) * 3 + torch.arange(3, device=device).view(3, 1)
    y, x = slot_r.view(-1, 1), slot_c.view(1, -1)
    row = (y // wh * nw + x // ww) * n + y % wh * ww + x % ww                 # [H, W]
    scatter = row + batch.view(-1, 1, 1) * (nh * nw * n)
    invalid = None
    if not (isinstance(H, int) and isinstance(W, int) and nh * wh == H and nw * ww == W):
        invalid = (~valid).expand(B, -1, -1, -1, -1).reshape(-1, 1, 1, n)
    return _WindowRows(gather.reshape(-1), scatter.reshape(-1), invalid, n,
                       relative_position_index(wh, ww, window_size, device).reshape(-1))


def window_attention_rows(qkv: torch.Tensor, layout: Tuple[int, int, int], table: torch.Tensor,
                          num_heads: int, window_size: int, attn_norm: str = "none"
                          ) -> torch.Tensor:
    """:func:`window_attention` as an export graph, on the rows of a batch of maps: ``qkv
    [B * H * W, 3 * C]``, ``layout`` ``(B, H, W)``; returns ``[B * H * W, C]``. Each window's
    tokens are gathered by one ``index_select`` (:func:`_window_rows`, from the sizes, once per
    size in a torch.export trace: :func:`attnzoo.backends.export_memo`) into a slot, the keys
    of a slot's padding masked, and scattered back by another; every reshape is of static
    sizes (the exporters' symbolic-shape work per node grows with a tensor's symbolic dims)."""
    B, H, W = layout
    C = qkv.shape[1] // 3
    head_dim = C // num_heads
    win = backends.export_memo(("lsa rows", B, H, W, window_size, qkv.device), qkv,
                               _window_rows, B, H, W, window_size, qkv.device)
    qkv = F.pad(qkv, (0, 0, 1, 0)).reshape(-1, C).index_select(0, win.gather)
    qkv = qkv.reshape(3, -1, win.n, num_heads, head_dim).transpose(2, 3)
    q, k, v = qkv[0], qkv[1], qkv[2]                                    # [B * nW, heads, n, d]
    scale: Optional[float] = None  # SDPA's head_dim ** -0.5
    if attn_norm == "quest":
        k, scale = l2_normalize(k), 1.0
    bias = _window_bias(table, win.bias_index, win.n, num_heads, q.dtype)       # [heads, n, n]
    if win.invalid is not None:
        bias = bias.masked_fill(win.invalid, float("-inf"))            # [B * nW, heads, n, n]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale).transpose(1, 2)
    # the copy the reshape makes anyway, made explicit: on torch 2.14 the dynamo exporter's
    # decompositions turn that reshape into a view, which fails on SDPA's strides
    out = out.clone(memory_format=torch.contiguous_format)
    return out.reshape(-1, C).index_select(0, win.scatter)


def _attend_in_windows(qkv: torch.Tensor, table: torch.Tensor, index: torch.Tensor,
                       invalid: Optional[torch.Tensor], num_heads: int, nh: int, nw: int,
                       wh: int, ww: int, attn_norm: str) -> torch.Tensor:
    """Attention inside each of ``nh x nw`` windows of ``wh x ww`` that tile ``qkv [B, nh * wh,
    nw * ww, 3 * C]`` exactly: ``index`` the bias table's rows for a window, ``invalid`` (or
    None) its keys to mask ``[nh * nw, 1, 1, wh * ww]``. Returns ``[B, nh * wh, nw * ww, C]``."""
    B, C = qkv.shape[0], qkv.shape[3] // 3
    head_dim, n = C // num_heads, wh * ww
    qkv = qkv.reshape(B, nh, wh, nw, ww, 3, num_heads, head_dim)
    q, k, v = qkv.permute(5, 0, 1, 3, 6, 2, 4, 7).reshape(3, B * nh * nw, num_heads, n,
                                                          head_dim).unbind(0)
    # None: SDPA's head_dim ** -0.5 (torch 2.4's TorchScript ONNX exporter fails on a float)
    scale: Optional[float] = None
    if attn_norm == "quest":
        k, scale = l2_normalize(k), 1.0
    bias = _window_bias(table, index, n, num_heads, q.dtype).unsqueeze(0)    # [1, heads, n, n]
    if invalid is not None:
        bias = bias.masked_fill(invalid, float("-inf"))                         # [nW, heads, n, n]
        bias = bias.unsqueeze(0).expand(B, -1, -1, -1, -1).reshape(B * nh * nw, num_heads, n, n)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    out = out.reshape(B, nh, nw, num_heads, wh, ww, head_dim).permute(0, 1, 4, 2, 5, 3, 6)
    return out.reshape(B, nh * wh, nw * ww, C)


@register_notrace_function
def window_attention(qkv: torch.Tensor, table: torch.Tensor, num_heads: int,
                     window_size: int, attn_norm: str = "none") -> torch.Tensor:
    """Multi-head attention of ``qkv [B, H, W, 3 * C]`` (timm's ``(3, heads, head_dim)`` channel
    order) inside non-overlapping windows; ``table [(2w-1)^2, heads]`` relative biases.

    Windows: per axis the fewest of at most ``window_size`` that cover the map, as equal as
    possible (:func:`window_layout`), so a map no larger than the window is one global window
    and a multiple of it is tiled exactly as the official code does; where the windows overrun
    the map, the padded keys are masked out. ``attn_norm="quest"``: keys L2-normalised per head
    and scale 1 (QUEST) instead of scale ``head_dim ** -0.5``. Returns ``[B, H, W, C]``."""
    B, H, W = qkv.shape[0], qkv.shape[1], qkv.shape[2]
    if not torch.jit.is_scripting():  # (TorchScript compiles neither the check nor the export)
        if backends.exporting():
            out = window_attention_rows(qkv.reshape(-1, qkv.shape[3]), (B, H, W), table,
                                        num_heads, window_size, attn_norm)
            return out.reshape(B, H, W, out.shape[1])
    wh, nh = window_layout(H, window_size)
    ww, nw = window_layout(W, window_size)
    pad_h, pad_w = nh * wh - H, nw * ww - W
    padded = pad_h > 0 or pad_w > 0
    if padded:
        qkv = F.pad(qkv, (0, 0, 0, pad_w, 0, pad_h))
    index, invalid = _layout_tensors(H, W, window_size, padded, qkv.device)
    out = _attend_in_windows(qkv, table, index, invalid, num_heads, nh, nw, wh, ww, attn_norm)
    if padded:
        out = out[:, :H, :W]
    return out


def window_attention_map(qkv: torch.Tensor, table: torch.Tensor, num_heads: int,
                         window_size: int, attn_norm: str = "none") -> AttentionMap:
    """:func:`window_attention`'s weights, unfused: each query's softmax over its window's keys,
    ``[B, H, W, heads, wh*ww]`` (row-major in the window; padded keys get 0), and the keys'
    positions ``[H, W, wh*ww, 2]`` on the map."""
    B, H, W = qkv.shape[0], qkv.shape[1], qkv.shape[2]
    head_dim = qkv.shape[3] // 3 // num_heads
    wh, nh = window_layout(H, window_size)
    ww, nw = window_layout(W, window_size)
    padded = nh * wh > H or nw * ww > W
    qkv = F.pad(qkv, (0, 0, 0, nw * ww - W, 0, nh * wh - H))
    n = wh * ww
    q, k, _ = qkv.reshape(B, nh, wh, nw, ww, 3, num_heads, head_dim).permute(
        5, 0, 1, 3, 6, 2, 4, 7).reshape(3, B, nh * nw, num_heads, n, head_dim).unbind(0)
    scale = head_dim ** -0.5
    if attn_norm == "quest":
        k, scale = l2_normalize(k), 1.0
    index, invalid = _layout_tensors(H, W, window_size, padded, qkv.device)
    logits = (q * scale) @ k.transpose(-1, -2) \
        + _window_bias(table, index, n, num_heads, q.dtype)             # [B, nW, heads, n, n]
    if invalid is not None:
        logits = logits.masked_fill(invalid, float("-inf"))
    weights = logits.softmax(-1).reshape(B, nh, nw, num_heads, wh, ww, n).permute(
        0, 1, 4, 2, 5, 3, 6).reshape(B, nh * wh, nw * ww, num_heads, n)[:, :H, :W]
    y, x = torch.arange(H, device=qkv.device), torch.arange(W, device=qkv.device)
    a, b = torch.arange(wh, device=qkv.device), torch.arange(ww, device=qkv.device)
    key_y = (y // wh * wh).view(H, 1, 1, 1) + a.view(1, 1, wh, 1)
    key_x = (x // ww * ww).view(1, W, 1, 1) + b.view(1, 1, 1, ww)
    keys = torch.stack([key_y.expand(H, W, wh, ww), key_x.expand(H, W, wh, ww)], -1)
    return AttentionMap(weights, ("batch", "y", "x", "head", "key"), keys.reshape(H, W, n, 2),
                        (H, W))


class LocalSelfAttention(nn.Module):
    """Multi-head self-attention inside non-overlapping, non-shifted windows of
    ``window_size`` (QnA-ViT's LSA blocks), ``[B, H, W, dim]`` -> same.

    Relative position bias: Swin's table ``relative_position_bias_table [(2w-1)^2, heads]``
    (zero init), added to the scaled logits. Maps that are not a multiple of the window: see
    :func:`window_attention` (windows shrink to tile the map evenly; a map no larger than
    ``window_size`` is attended globally).

    Args:
        dim: channels.
        num_heads: heads (QnA-ViT: head_dim 32).
        window_size: largest window side w.
        qkv_bias: bias on ``qkv`` (QnA-ViT: none).
        proj_bias: bias on ``proj`` (QnA-ViT: none).
        proj_drop: dropout after ``proj``.
        attn_norm: ``"none"`` (scaled dot product) or ``"quest"`` (QUEST: keys L2-normalised
            per head, norm in fp32, scale 1; the relative bias is still added). No new
            parameters, so QnA-ViT weights load into either (as an initialisation for
            ``"quest"``: the logits change).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            window_size: int = 7,
            qkv_bias: bool = False,
            proj_bias: bool = False,
            proj_drop: float = 0.,
            attn_norm: str = "none",
            device=None, dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        check_sizes("LocalSelfAttention", dim=dim, num_heads=num_heads)
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be an int >= 1, got {window_size!r}")
        self.dim = dim
        self.num_heads = num_heads
        self.window_size = window_size
        self.attn_norm = check_attn_norm(attn_norm)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias, **dd)
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * window_size - 1) ** 2, num_heads, **dd))
        self.proj = nn.Linear(dim, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for linear in (self.qkv, self.proj):
            lecun_normal_(linear.weight)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        nn.init.zeros_(self.relative_position_bias_table)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, window_size={self.window_size}, "
                f"attn_norm={self.attn_norm!r}")

    def attention_map(self, x: torch.Tensor) -> AttentionMap:
        """The weights ``forward(x)`` uses, per query over its window (see
        :func:`window_attention_map`)."""
        return window_attention_map(self.qkv(x), self.relative_position_bias_table,
                                    self.num_heads, self.window_size, self.attn_norm)

    def forward_rows(self, x: torch.Tensor, layout: Tuple[int, int, int]) -> torch.Tensor:
        """``forward`` while exporting, on the map's rows ``[B * H * W, dim]`` (``layout``:
        ``(B, H, W)``): :func:`window_attention_rows`."""
        x = window_attention_rows(self.qkv(x), layout, self.relative_position_bias_table,
                                  self.num_heads, self.window_size, self.attn_norm)
        return backends.export_dropout(self.proj_drop, self.proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = check_map(x, self.dim, "LocalSelfAttention")
        x = window_attention(self.qkv(x), self.relative_position_bias_table, self.num_heads,
                             self.window_size, self.attn_norm)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


# leaves for torch.fx's own tracer too (timm's honours register_notrace_function only)
for _leaf in ('qna2d_dispatch', 'window_attention', 'check_map'):
    torch.fx.wrap(_leaf)
