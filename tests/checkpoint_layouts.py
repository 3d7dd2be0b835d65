"""Official checkpoint layouts, written in the tests from the specs and the official code, never
from attnzoo's own key maps: the fixtures the checkpoint filters are checked against.

Per family: the official key names and shapes of a variant (a "manifest", from the original
code's module structure), and converters from attnzoo's state dict to each official layout
(used to write official-layout files for the loading tests and the offline Hub cache).
"""
from __future__ import annotations

import re
from typing import Dict, Sequence, Tuple

import torch

Shape = Tuple[int, ...]


# ---------------------------------------------------------------------------------------------
# NAT / DiNAT (shared/specs/nat.md; SHI-Labs' classification/nat.py and NATTEN's
# NeighborhoodAttention2D: qkv, rpb, proj)
# ---------------------------------------------------------------------------------------------

def nat_official_manifest(embed_dim: int, depths: Sequence[int], num_heads: Sequence[int],
                          mlp_ratio: float, kernel_size: int = 7, layer_scale: bool = False,
                          in_chans: int = 3, num_classes: int = 1000) -> Dict[str, Shape]:
    """Every key of the original training code's state dict, with its shape."""
    C = embed_dim
    keys: Dict[str, Shape] = {
        "patch_embed.proj.0.weight": (C // 2, in_chans, 3, 3),
        "patch_embed.proj.0.bias": (C // 2,),
        "patch_embed.proj.1.weight": (C, C // 2, 3, 3),
        "patch_embed.proj.1.bias": (C,),
        "patch_embed.norm.weight": (C,),
        "patch_embed.norm.bias": (C,),
    }
    for i, (depth, heads) in enumerate(zip(depths, num_heads)):
        dim = C * 2 ** i
        hidden = int(dim * mlp_ratio)
        for j in range(depth):
            b = f"levels.{i}.blocks.{j}."
            keys.update({
                b + "norm1.weight": (dim,), b + "norm1.bias": (dim,),
                b + "attn.rpb": (heads, 2 * kernel_size - 1, 2 * kernel_size - 1),
                b + "attn.qkv.weight": (3 * dim, dim), b + "attn.qkv.bias": (3 * dim,),
                b + "attn.proj.weight": (dim, dim), b + "attn.proj.bias": (dim,),
                b + "norm2.weight": (dim,), b + "norm2.bias": (dim,),
                b + "mlp.fc1.weight": (hidden, dim), b + "mlp.fc1.bias": (hidden,),
                b + "mlp.fc2.weight": (dim, hidden), b + "mlp.fc2.bias": (dim,),
            })
            if layer_scale:
                keys[b + "gamma1"] = (dim,)
                keys[b + "gamma2"] = (dim,)
        if i < len(depths) - 1:
            keys[f"levels.{i}.downsample.reduction.weight"] = (2 * dim, dim, 3, 3)
            keys[f"levels.{i}.downsample.norm.weight"] = (2 * dim,)
            keys[f"levels.{i}.downsample.norm.bias"] = (2 * dim,)
    last = C * 2 ** (len(depths) - 1)
    keys.update({"norm.weight": (last,), "norm.bias": (last,),
                 "head.weight": (num_classes, last), "head.bias": (num_classes,)})
    return keys


def nat_to_official(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """attnzoo NAT (timm layout) -> the original training code's layout."""
    out = {}
    for k, v in state_dict.items():
        m = re.match(r"stages\.(\d+)\.downsample\.(conv|norm)\.(.+)$", k)
        if m:
            part = "reduction" if m.group(2) == "conv" else "norm"
            out[f"levels.{int(m.group(1)) - 1}.downsample.{part}.{m.group(3)}"] = v
            continue
        k = re.sub(r"^stem\.conv1\.", "patch_embed.proj.0.", k)
        k = re.sub(r"^stem\.conv2\.", "patch_embed.proj.1.", k)
        k = re.sub(r"^stem\.norm\.", "patch_embed.norm.", k)
        k = re.sub(r"^stages\.(\d+)\.blocks\.(\d+)\.ls([12])\.gamma$", r"levels.\1.blocks.\2.gamma\3", k)
        k = re.sub(r"^stages\.", "levels.", k)
        k = re.sub(r"^head\.fc\.", "head.", k)
        out[k] = v
    return out


_NAT_BLOCK_TO_HF = (
    ("norm1.", "layernorm_before."),
    ("norm2.", "layernorm_after."),
    ("attn.rpb", "attention.self.rpb"),
    ("attn.proj.", "attention.output.dense."),
    ("mlp.fc1.", "intermediate.dense."),
    ("mlp.fc2.", "output.dense."),
)
_NAT_TOP_TO_HF = (
    ("patch_embed.proj.", "embeddings.patch_embeddings.projection."),
    ("patch_embed.norm.", "embeddings.norm."),
    ("norm.", "layernorm."),
)


def nat_official_to_transformers(state_dict: Dict[str, torch.Tensor],
                                 prefix: str = "nat.") -> Dict[str, torch.Tensor]:
    """Original NAT/DiNAT layout -> transformers' Nat/DinatForImageClassification state dict:
    ``{nat,dinat}.embeddings.patch_embeddings.projection.*``, ``.embeddings.norm.*``,
    ``.encoder.levels.{i}.layers.{j}.{layernorm_before, attention.self.{query,key,value,rpb},
    attention.output.dense, layernorm_after, intermediate.dense, output.dense,
    layer_scale_parameters}``, ``.encoder.levels.{i}.downsample.{reduction,norm}.*``,
    ``.layernorm.*``, ``classifier.*`` (the spec's key map, inverted)."""
    out, gammas = {}, {}
    for k, v in state_dict.items():
        m = re.match(r"levels\.(\d+)\.blocks\.(\d+)\.(.+)$", k)
        if m:
            i, j, name = m.groups()
            layer = f"{prefix}encoder.levels.{i}.layers.{j}."
            if name.startswith("attn.qkv."):
                for part, t in zip(("query", "key", "value"), v.chunk(3, dim=0)):
                    out[f"{layer}attention.self.{part}.{name.rsplit('.', 1)[1]}"] = t.clone()
                continue
            if name in ("gamma1", "gamma2"):
                gammas.setdefault(layer, {})[name] = v
                continue
            for src, dst in _NAT_BLOCK_TO_HF:
                if name.startswith(src):
                    name = dst + name[len(src):]
                    break
            out[layer + name] = v
        elif k.startswith("levels."):
            out[f"{prefix}encoder.{k}"] = v  # levels.{i}.downsample.{reduction,norm}.*
        elif k.startswith("head."):
            out["classifier." + k[len("head."):]] = v
        else:
            for src, dst in _NAT_TOP_TO_HF:
                if k.startswith(src):
                    k = dst + k[len(src):]
                    break
            out[prefix + k] = v
    for layer, g in gammas.items():
        out[layer + "layer_scale_parameters"] = torch.stack([g["gamma1"], g["gamma2"]])
    return out


def nat_to_transformers(state_dict: Dict[str, torch.Tensor], prefix: str = "nat.") -> Dict[str, torch.Tensor]:
    """attnzoo NAT -> the transformers layout of the shi-labs Hub repos."""
    return nat_official_to_transformers(nat_to_official(state_dict), prefix)


# ---------------------------------------------------------------------------------------------
# QUEST-ViT (shared/specs/quest_vit.md): no QUEST checkpoints exist; the checkpoints it loads as
# an initialisation are the standard ViT / DeiT / DeiT-3 releases. DeiT-3's own layout
# (facebookresearch/deit models_v2.py, vit_models with Layer_scale_init_Block): LayerScale as
# per-block ``gamma_1`` / ``gamma_2`` vectors, a position embedding over the patches only.
# ---------------------------------------------------------------------------------------------

def deit3_official_manifest(embed_dim: int, depth: int, patch_size: int, img_size: int,
                            mlp_ratio: float = 4., in_chans: int = 3,
                            num_classes: int = 1000) -> Dict[str, Shape]:
    C, hidden = embed_dim, int(embed_dim * mlp_ratio)
    keys: Dict[str, Shape] = {
        "cls_token": (1, 1, C),
        "pos_embed": (1, (img_size // patch_size) ** 2, C),
        "patch_embed.proj.weight": (C, in_chans, patch_size, patch_size),
        "patch_embed.proj.bias": (C,),
    }
    for i in range(depth):
        p = f"blocks.{i}."
        keys.update({
            p + "gamma_1": (C,), p + "gamma_2": (C,),
            p + "norm1.weight": (C,), p + "norm1.bias": (C,),
            p + "attn.qkv.weight": (3 * C, C), p + "attn.qkv.bias": (3 * C,),
            p + "attn.proj.weight": (C, C), p + "attn.proj.bias": (C,),
            p + "norm2.weight": (C,), p + "norm2.bias": (C,),
            p + "mlp.fc1.weight": (hidden, C), p + "mlp.fc1.bias": (hidden,),
            p + "mlp.fc2.weight": (C, hidden), p + "mlp.fc2.bias": (C,),
        })
    keys.update({"norm.weight": (C,), "norm.bias": (C,),
                 "head.weight": (num_classes, C), "head.bias": (num_classes,)})
    return keys
