"""Neighborhood attention (NA / dilated NA) as an ``nn.Module`` on NHWC feature maps.

The layer is NAT's / DiNAT's attention: a fused ``qkv`` projection, 2-D neighborhood attention
with an optional relative positional bias ``rpb`` (parameter names match the official
checkpoints), and an output projection ``proj``. ``attn_norm="quest"`` makes it QUEST attention
(Govindarajan et al., 2026): keys L2-normalised per head before the op, scale 1, on every backend.

Small inputs: NA needs ``kernel_size * dilation <= H, W``. Like the official runtime, the layer
zero-pads its (already normalised) input right/bottom up to ``kernel_size * dilation`` before
``qkv``, so the padded tokens' keys/values equal the ``qkv`` bias and are *not* masked, runs NA,
and crops back before ``proj``. Official weights thus give official outputs at any input size.
While exporting, the padding is one zero token that the padded keys read (``export_forward``).

Backend dispatch happens in plain module-level functions: :func:`na2d_qkv_dispatch` and
:func:`na2d_dispatch` (QUEST, whose normalised keys are a tensor of their own) are
``@torch.jit.ignore`` (scripted models call them as Python, so the context-variable backend
switch keeps working) and the helpers are registered with timm as FX leaves (``torch.fx`` does
not trace their shape-dependent control flow). Their names must not start with ``_``:
torch.fx's autowrap skips private globals.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import trunc_normal_
from timm.models import register_notrace_function

from .. import backends
from ..ops import na2d, na2d_qk, na2d_qkv, na_window_positions
from ..ops.neighborhood import na_export_rows
from ._checks import check_map, check_sizes
from .attention_map import AttentionMap
from .quest import check_attn_norm, l2_normalize

__all__ = ["NeighborhoodAttention2d"]


@register_notrace_function
def pad_to_window(x: torch.Tensor, window: int) -> torch.Tensor:
    """Zero-pad NHWC ``x`` right/bottom so that H and W are at least ``window`` (= K * d).
    (An export does not come here: :meth:`NeighborhoodAttention2d.export_forward`.)"""
    pad_h = max(window - x.shape[1], 0)
    pad_w = max(window - x.shape[2], 0)
    if pad_h > 0 or pad_w > 0:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    return x


@register_notrace_function
@torch.jit.ignore
def na2d_dispatch(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kernel_size: int,
        dilation: int,
        rpb: Optional[torch.Tensor],
        scale: float,
        backend: Optional[str],
) -> torch.Tensor:
    # Kept out of TorchScript: backend resolution reads thread-local state, env vars and caches.
    return na2d(q, k, v, kernel_size=kernel_size, dilation=dilation, rpb=rpb, scale=scale,
                backend=backend)


@register_notrace_function
@torch.jit.ignore
def na2d_qkv_dispatch(
        qkv: torch.Tensor,
        kernel_size: int,
        dilation: int,
        rpb: Optional[torch.Tensor],
        scale: float,
        backend: Optional[str],
) -> torch.Tensor:
    # q, k and v packed: the cuda backend returns their gradient as one tensor, not a stack
    return na2d_qkv(qkv, kernel_size=kernel_size, dilation=dilation, rpb=rpb, scale=scale,
                    backend=backend)


class NeighborhoodAttention2d(nn.Module):
    """Multi-head (dilated) neighborhood attention on ``[B, H, W, C]`` input.

    Args:
        dim: channels C (input and output).
        num_heads: attention heads; ``dim`` must be divisible by it.
        kernel_size: odd neighborhood size K.
        dilation: neighborhood dilation d.
        qkv_bias: bias on the fused ``qkv`` projection.
        rel_pos_bias: learn a relative positional bias ``rpb`` ``[heads, 2K-1, 2K-1]``.
        attn_drop: dropout on attention weights; the NA op computes the softmax internally and
            has no dropout, so only ``0.`` is accepted.
        proj_drop: dropout after ``proj``.
        backend: NA backend, one of :data:`attnzoo.backends.BACKENDS`; ``None`` follows
            :func:`attnzoo.use_backend` / :func:`attnzoo.set_backend` / ``ATTNZOO_BACKEND``.
        attn_norm: ``"none"`` (NAT's scaled dot product, scale ``head_dim ** -0.5``) or
            ``"quest"`` (QUEST: keys L2-normalised per head, norm in fp32, queries untouched,
            scale 1; the rpb is still added to the logits). No new parameters, so NAT weights
            load into either (as an initialisation for ``"quest"``: the logits change).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            kernel_size: int = 7,
            dilation: int = 1,
            qkv_bias: bool = True,
            rel_pos_bias: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            backend: Optional[str] = None,
            attn_norm: str = "none",
            device=None, dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        check_attn_norm(attn_norm)
        check_sizes(type(self).__name__, dim=dim, num_heads=num_heads)
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or \
                kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be an odd int >= 1, got {kernel_size!r}")
        if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
            raise ValueError(f"dilation must be an int >= 1, got {dilation!r}")
        if attn_drop:
            raise ValueError(
                f"attn_drop={attn_drop}: attention-weight dropout is not supported, the "
                "neighborhood-attention op fuses the softmax (use proj_drop / drop_path)")
        if backend is not None:
            backends.get_backend(backend)  # unknown names raise ValueError now, not at forward
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_norm = attn_norm
        self.scale = 1.0 if attn_norm == "quest" else self.head_dim ** -0.5
        self.kernel_size = kernel_size
        self.dilation = dilation
        self.window = kernel_size * dilation  # smallest H, W the op accepts
        self.backend = backend

        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias, **dd)
        if rel_pos_bias:
            self.rpb = nn.Parameter(torch.empty(num_heads, 2 * kernel_size - 1,
                                                2 * kernel_size - 1, **dd))
        else:
            self.register_parameter("rpb", None)
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Official init: every Linear trunc_normal(.02) / zero bias, rpb trunc_normal(.02).
        for linear in (self.qkv, self.proj):
            trunc_normal_(linear.weight, std=.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.rpb is not None:
            trunc_normal_(self.rpb, std=.02)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, "
                f"dilation={self.dilation}, rel_pos_bias={self.rpb is not None}, "
                f"attn_norm={self.attn_norm!r}, backend={self.backend!r}")

    def packed_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The qkv projection of the (padded) input as ``[B, H, W, 3, heads, head_dim]``."""
        # reshape by x's sizes, not unflatten: the TorchScript ONNX exporter bakes unflatten's in
        return self.qkv(x).reshape(x.shape[0], x.shape[1], x.shape[2], 3, self.num_heads,
                                   self.head_dim)

    def heads_qkv(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, H, W, heads, head_dim]`` of the (padded) input, k as the formulation
        uses it (unit-norm for QUEST)."""
        # strided views of the one projection, which every backend takes as they are; their
        # gradients come back as one stack (select's would be three zero-filled copies, summed)
        q, k, v = self.packed_qkv(x).unbind(3)
        if self.attn_norm == "quest":
            k = l2_normalize(k)
        return q, k, v

    def attention_map(self, x: torch.Tensor) -> AttentionMap:
        """The weights ``forward(x)`` uses, ``[B, H, W, heads, K*K]`` (unfused:
        :func:`attnzoo.ops.na2d_qk`, softmax), and where each query's window lies."""
        H, W = x.shape[1], x.shape[2]
        x = pad_to_window(x, self.window)
        q, k, _ = self.heads_qkv(x)
        weights = na2d_qk(q * self.scale, k, kernel_size=self.kernel_size,
                          dilation=self.dilation, rpb=self.rpb, backend="torch").softmax(-1)
        keys = na_window_positions(x.shape[1:3], kernel_size=self.kernel_size,
                                   dilation=self.dilation, device=x.device)
        return AttentionMap(weights[:, :H, :W], ("batch", "y", "x", "head", "key"),
                            keys[:H, :W], (H, W))

    def forward_rows(self, x: torch.Tensor, layout: Tuple[int, int, int]) -> torch.Tensor:
        """``forward`` while exporting, on the map's rows ``[B * H * W, dim]`` (``layout``:
        ``(B, H, W)``; a stage's blocks run on rows while exporting: 2-D tensors cost the
        exporter less symbolic-shape work than maps). NA's export formula
        (:func:`attnzoo.ops.neighborhood.na_export_rows`) on the qkv projection's rows; where
        the map may be smaller than the window (any traced size), one zero token in front
        stands for the padding: no shape of the graph holds the padded size."""
        B, H, W = layout
        small = not (isinstance(H, int) and isinstance(W, int)) or min(H, W) < self.window
        padded = small or torch.jit.is_tracing()
        x = x.reshape(B, -1, x.shape[-1])
        if padded:
            x = F.pad(x, (0, 0, 1, 0))
        # rows 3t, 3t + 1, 3t + 2: token t's q, k and v (the qkv projection's own order)
        qkv = self.qkv(x).reshape(B, -1, 1, self.num_heads, self.head_dim)
        if self.attn_norm == "quest":  # unit keys, before the gather copies them
            q, k, v = qkv.reshape(B, -1, 3, self.num_heads, self.head_dim).unbind(2)
            qkv = torch.stack([q, l2_normalize(k), v], 2).reshape(qkv.shape)
        ks, dil = (self.kernel_size,) * 2, (self.dilation,) * 2
        x = na_export_rows(qkv, (H, W), ks, dil, self.rpb, self.scale, padded)
        return backends.export_dropout(self.proj_drop, self.proj(x.reshape(-1, self.dim)))

    def export_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` while exporting: :meth:`forward_rows` on ``x``'s rows."""
        B, H, W, C = x.shape
        return self.forward_rows(x.reshape(-1, C), (B, H, W)).reshape(B, H, W, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (is_scripting() first: TorchScript compiles neither the check nor the export branch)
        if not torch.jit.is_scripting():
            if backends.exporting():
                return self.export_forward(x)
        x = check_map(x, self.dim, "NeighborhoodAttention2d")
        H, W = x.shape[1], x.shape[2]
        x = pad_to_window(x, self.window)
        if self.attn_norm == "quest":
            q, k, v = self.heads_qkv(x)
            x = na2d_dispatch(q, k, v, self.kernel_size, self.dilation, self.rpb, self.scale,
                               self.backend)
        else:
            x = na2d_qkv_dispatch(self.packed_qkv(x), self.kernel_size, self.dilation, self.rpb,
                                  self.scale, self.backend)
        x = x.flatten(-2)[:, :H, :W]
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


# leaves for torch.fx's own tracer too (timm's honours register_notrace_function only)
for _leaf in ('pad_to_window', 'na2d_dispatch', 'na2d_qkv_dispatch', 'check_map'):
    torch.fx.wrap(_leaf)
