"""QUEST attention (Govindarajan et al., 2026, "QUEST: A robust attention formulation using
Query-modulated spherical attention", arXiv:2604.00199) and the formulations it is compared with.

Per head, ``A = softmax(Q K_bar^T)``: each key is L2-normalised over the head dim, queries are
left as they are and the scale is exactly 1, so a query's norm sets how sharp its attention is
while which keys it prefers depends only on direction (cosine similarity); no key can grow its
norm to "steal attention" from every query, and every logit is bounded by its query's norm.

:class:`QuestAttention` is timm's ``Attention`` with that change: same constructor, same
parameters and state dict (no new parameter except for ``formulation='qknorm'``), the fused
``F.scaled_dot_product_attention`` path wherever ``timm.layers.use_fused_attn()`` allows it and
the explicit matmul path otherwise. It plugs into timm's ``VisionTransformer`` (and its ``Block``)
through their ``attn_layer`` argument, so a QUEST ViT is timm's ViT, not a fork; any timm ViT
becomes one: ``timm.create_model('vit_small_patch16_224', attn_layer=QuestAttention)``.

:func:`l2_normalize` is the shared normalisation: local attention layers (neighborhood attention,
windowed self-attention) offer ``attn_norm="quest"`` by normalising their keys with it before
their op and passing ``scale=1.0``.
"""
import math
from typing import Optional, Tuple, Type

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention, maybe_add_mask, resolve_self_attn_mask
from timm.models import register_notrace_function

from .attention_map import AttentionMap

__all__ = ["QuestAttention", "QNormAttention", "QKNormAttention", "StandardAttention",
           "FORMULATIONS", "ATTN_NORMS", "attn_layer_for", "check_attn_norm", "l2_normalize"]

# QuestAttention's formulations (the paper's Table 1 ablation):
#   quest    softmax(Q K_bar^T)                 keys normalised, scale 1 (the paper's method)
#   qnorm    softmax(Q_bar K^T)                 queries normalised, scale 1
#   qknorm   softmax(c_h Q_bar K_bar^T)         both normalised, learned per-head scale c_h
#            (QKNorm-HS; parametrised as Swin V2: c_h = exp(logit_scale_h) <= 100, init 10)
#   standard softmax(Q K^T / sqrt(head_dim))    timm's Attention
FORMULATIONS = ("quest", "qnorm", "qknorm", "standard")

# The ``attn_norm`` option of local attention layers: "none" (standard scaled dot product) or
# "quest" (keys L2-normalised, scale 1).
ATTN_NORMS = ("none", "quest")

# Leaves for a plain torch.fx.symbolic_trace too, as in timm's attention module (timm's own
# tracer gets them from its notrace registry): they branch on the mask arguments.
torch.fx.wrap("maybe_add_mask")
torch.fx.wrap("resolve_self_attn_mask")

_QKNORM_INIT = math.log(10.)
_QKNORM_MAX = math.log(100.)


@register_notrace_function  # an FX leaf: it reads x.dtype (timm's tracer; torch.fx.wrap below)
def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x`` L2-normalised over its last dim (the head dim), in ``x``'s dtype.

    The norm is computed in float32 at least, also under autocast (bf16/fp16 sums of squares
    lose the precision the unit vectors need); float64 stays float64. The paper gives no
    epsilon; an all-zero vector stays zero (``F.normalize``'s 1e-12 floor), so it contributes a
    zero logit instead of NaN."""
    return F.normalize(x.to(torch.promote_types(x.dtype, torch.float32)), dim=-1).to(x.dtype)


torch.fx.wrap("l2_normalize")


def check_attn_norm(attn_norm: str) -> str:
    """Validate a local attention layer's ``attn_norm`` option."""
    if attn_norm not in ATTN_NORMS:
        raise ValueError(f"attn_norm must be one of {', '.join(map(repr, ATTN_NORMS))}, "
                         f"got {attn_norm!r}")
    return attn_norm


class QuestAttention(Attention):
    """timm's multi-head self-attention with QUEST (or a compared formulation) for its logits.

    Args: those of ``timm.layers.Attention`` (``dim``, ``num_heads``, ``attn_head_dim``,
    ``dim_out``, ``qkv_bias``, ``qk_norm``, ``scale_norm``, ``proj_bias``, ``gated``,
    ``attn_drop``, ``proj_drop``, ``norm_layer``, ``device``, ``dtype``), plus

        formulation: ``'quest'`` (keys L2-normalised, scale 1), ``'qnorm'`` (queries
            L2-normalised, scale 1), ``'qknorm'`` (both, times a learned per-head scale
            ``logit_scale``, the only formulation with a parameter timm's Attention lacks) or
            ``'standard'`` (timm's Attention). ``None``: the class default (``'quest'`` here;
            :class:`QNormAttention`, :class:`QKNormAttention`, :class:`StandardAttention` are
            the same module with another default, for ``VisionTransformer(attn_layer=...)``,
            which takes a class).

    timm's ``qk_norm=True`` (a LayerNorm on q and k) is a different thing and composes with
    these: it runs first, on the raw q and k.
    """
    default_formulation = "quest"

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            attn_head_dim: Optional[int] = None,
            dim_out: Optional[int] = None,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_norm: bool = False,
            proj_bias: bool = True,
            gated: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Optional[Type[nn.Module]] = None,
            formulation: Optional[str] = None,
            device=None, dtype=None,
    ) -> None:
        formulation = self.default_formulation if formulation is None else formulation
        if formulation not in FORMULATIONS:
            raise ValueError(f"formulation must be one of {', '.join(map(repr, FORMULATIONS))}, "
                             f"got {formulation!r}")
        super().__init__(
            dim, num_heads=num_heads, attn_head_dim=attn_head_dim, dim_out=dim_out,
            qkv_bias=qkv_bias, qk_norm=qk_norm, scale_norm=scale_norm, proj_bias=proj_bias,
            gated=gated, attn_drop=attn_drop, proj_drop=proj_drop, norm_layer=norm_layer,
            device=device, dtype=dtype)
        self.formulation = formulation
        self.normalize_q = formulation in ("qnorm", "qknorm")
        self.normalize_k = formulation in ("quest", "qknorm")
        if formulation != "standard":
            self.scale = 1.0  # the paper's C = 1 (no 1/sqrt(head_dim))
        self.logit_scale_max = _QKNORM_MAX  # an attribute: TorchScript cannot read globals
        if formulation == "qknorm":
            self.logit_scale = nn.Parameter(
                torch.empty(num_heads, 1, 1, device=device, dtype=dtype))
        else:
            self.register_parameter("logit_scale", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Only this module's own parameter; qkv / proj / norms reset themselves.
        if self.logit_scale is not None:
            nn.init.constant_(self.logit_scale, _QKNORM_INIT)

    def extra_repr(self) -> str:
        return f"formulation={self.formulation!r}, num_heads={self.num_heads}"

    def heads_qkv(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, heads, N, head_dim]`` as the formulation uses them: the logits are
        ``scale * q @ k^T`` (for QUEST: q as projected, k unit-norm, scale 1)."""
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(
            2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.normalize_q:
            q = l2_normalize(q)
        if self.normalize_k:
            k = l2_normalize(k)
        if self.logit_scale is not None:
            q = q * self.logit_scale.clamp(max=self.logit_scale_max).exp().to(q.dtype)
        return q, k, v

    def attention_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-softmax logits ``[B, heads, N, N]`` (no mask), for inspection and tests."""
        q, k, _ = self.heads_qkv(x)
        return (q * self.scale) @ k.transpose(-2, -1)

    def attention_map(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                      is_causal: bool = False) -> AttentionMap:
        """The global weights ``forward(x)`` uses, ``[B, heads, N, N]`` (query, key: every
        token, prefix tokens first), softmax over the keys."""
        attn = self.attention_logits(x)
        mask = resolve_self_attn_mask(x.shape[1], attn, attn_mask, is_causal)
        attn = maybe_add_mask(attn, mask)
        return AttentionMap(attn.softmax(dim=-1), ("batch", "head", "query", "key"))

    def forward(
            self,
            x: torch.Tensor,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ) -> torch.Tensor:
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        q, k, v = self.heads_qkv(x)

        if self.fused_attn:
            x = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=attn_mask,
                dropout_p=self.attn_drop.p if self.training else 0.,
                is_causal=is_causal,
                scale=self.scale,
            )
        else:
            attn = (q * self.scale) @ k.transpose(-2, -1)
            attn_bias = resolve_self_attn_mask(N, attn, attn_mask, is_causal)
            attn = maybe_add_mask(attn, attn_bias)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v

        x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class QNormAttention(QuestAttention):
    """:class:`QuestAttention` with ``formulation='qnorm'`` by default."""
    default_formulation = "qnorm"


class QKNormAttention(QuestAttention):
    """:class:`QuestAttention` with ``formulation='qknorm'`` by default."""
    default_formulation = "qknorm"


class StandardAttention(QuestAttention):
    """:class:`QuestAttention` with ``formulation='standard'`` by default (timm's Attention)."""
    default_formulation = "standard"


_LAYERS = {"quest": QuestAttention, "qnorm": QNormAttention, "qknorm": QKNormAttention,
           "standard": StandardAttention}


def attn_layer_for(formulation: str) -> Type[QuestAttention]:
    """The attention class for ``VisionTransformer(attn_layer=...)`` with that formulation."""
    if formulation not in _LAYERS:
        raise ValueError(f"formulation must be one of {', '.join(map(repr, FORMULATIONS))}, "
                         f"got {formulation!r}")
    return _LAYERS[formulation]
