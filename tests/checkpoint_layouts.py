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
# QnA-ViT (shared/specs/qna_vit.md; the official Flax code, github.com/moabarar/qna:
# models/qna_vit.py QnAViT / LSAStage / QnAStage / BaseBlock / ClassificationHead,
# layers/qna.py FusedKQnA, layers/self_attention.py MultiHeadSelfAttention)
# ---------------------------------------------------------------------------------------------

def qna_official_manifest(embed_dim: int, qna_depths: Sequence[int], lsa_depths: Sequence[int],
                          qna_heads: Sequence[int], lsa_heads: Sequence[int],
                          kernel_sizes: Sequence[int], window_sizes: Sequence[int],
                          num_queries: int = 2, mlp_ratio: int = 4, in_chans: int = 3,
                          num_classes: int = 1000) -> Dict[str, Shape]:
    """Every leaf of the official ``params`` tree ('/'-joined path -> shape).

    Flax names compact submodules ``ClassName_<n>`` in creation order: per stage an LSAStage
    (no params when it has no blocks) then a QnAStage; blocks are named explicitly
    (``MSA_Block_{i}``, ``QnA_Block_{i}``, 1-based, and ``QnA_Block_{n+1}_stride_2`` for the
    downsampling block of stages 0..2, which creates its skip ``Conv_0`` before its
    ``LayerNorm_0``). Dense kernels are (in, out), convs HWIO; FusedKQnA's ``rpe_bias`` is
    (k*k, L*h) and ``attn_scale_weights`` (1, 1, k*k, L*h)."""
    C = embed_dim
    leaves: Dict[str, Shape] = {"StemBlock_0/conv_1x1/kernel": (4, 4, in_chans, C)}

    def layer_norm(prefix: str, i: int, dim: int) -> None:
        leaves[f"{prefix}/LayerNorm_{i}/scale"] = (dim,)
        leaves[f"{prefix}/LayerNorm_{i}/bias"] = (dim,)

    def mlp(prefix: str, dim: int) -> None:
        leaves[f"{prefix}/MlpBlock_0/Dense_0/kernel"] = (dim, mlp_ratio * dim)
        leaves[f"{prefix}/MlpBlock_0/Dense_0/bias"] = (mlp_ratio * dim,)
        leaves[f"{prefix}/MlpBlock_0/Dense_1/kernel"] = (mlp_ratio * dim, dim)
        leaves[f"{prefix}/MlpBlock_0/Dense_1/bias"] = (dim,)

    def base_block(prefix: str, dim: int) -> None:
        layer_norm(prefix, 0, dim)
        layer_norm(prefix, 1, dim)
        mlp(prefix, dim)

    def fused_kqna(prefix: str, cin: int, features: int, heads: int, k: int) -> None:
        f = f"{prefix}/FusedKQnA_0"
        leaves.update({
            f"{f}/query": (num_queries, features),
            f"{f}/Wk": (cin, features),
            f"{f}/to_v/kernel": (cin, features),
            f"{f}/to_out/kernel": (features, features),
            f"{f}/rpe_bias": (k * k, num_queries * heads),
            f"{f}/attn_scale_weights": (1, 1, k * k, num_queries * heads),
        })

    n_stages = len(qna_depths)
    for s in range(n_stages):
        dim = C * 2 ** s
        for i in range(1, lsa_depths[s] + 1):
            prefix = f"LSAStage_{s}/MSA_Block_{i}"
            base_block(prefix, dim)
            m = f"{prefix}/MultiHeadSelfAttention_0"
            w = window_sizes[s]
            leaves[f"{m}/to_qkv/kernel"] = (dim, 3 * dim)
            leaves[f"{m}/RelativePositionalEmbedding_0/rpe_bias"] = ((2 * w - 1) ** 2, lsa_heads[s])
            leaves[f"{m}/to_out/kernel"] = (dim, dim)
        for i in range(1, qna_depths[s] + 1):
            prefix = f"QnAStage_{s}/QnA_Block_{i}"
            base_block(prefix, dim)
            fused_kqna(prefix, dim, dim, qna_heads[s], kernel_sizes[s])
        if s < n_stages - 1:
            prefix = f"QnAStage_{s}/QnA_Block_{qna_depths[s] + 1}_stride_2"
            leaves[f"{prefix}/Conv_0/kernel"] = (1, 1, dim, 2 * dim)
            layer_norm(prefix, 0, dim)
            fused_kqna(prefix, dim, 2 * dim, 2 * qna_heads[s], kernel_sizes[s])
            layer_norm(prefix, 1, 2 * dim)
            mlp(prefix, 2 * dim)
    last = C * 2 ** (n_stages - 1)
    leaves.update({
        "ClassificationHead_0/LayerNorm_0/scale": (last,),
        "ClassificationHead_0/LayerNorm_0/bias": (last,),
        "ClassificationHead_0/head_logits/kernel": (last, num_classes),
        "ClassificationHead_0/head_logits/bias": (num_classes,),
    })
    return leaves


def nest(flat: Dict[str, object]) -> Dict[str, object]:
    """'/'-joined paths -> the nested dict Flax serialises."""
    tree: Dict[str, object] = {}
    for path, leaf in flat.items():
        node = tree
        *parents, name = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = leaf
    return tree


def write_flax_checkpoint(path, params: Dict[str, object], step: int = 1000,
                          chunked: Sequence[str] = ()) -> None:
    """Write ``params`` (a nested dict of numpy arrays) as a Flax legacy checkpoint: msgpack of
    the training state's state dict, arrays as extension type 1 (``msgpack((shape, dtype name,
    C-order bytes))``), numpy scalars as type 3, as ``flax.serialization.to_bytes`` does (see
    its docs / source: ``_msgpack_ext_pack``, ``msgpack_serialize``). AdamW's state (optax's
    tuple of states, serialised as dicts keyed '0', '1', ...) holds two more copies of the tree.
    Leaves listed in ``chunked`` are stored as Flax's ``__msgpack_chunked_array__`` dicts (what
    it does above 1 GiB), in two chunks."""
    import msgpack
    import numpy as np

    def ext_pack(x):
        if isinstance(x, np.ndarray):
            return msgpack.ExtType(1, msgpack.packb((x.shape, x.dtype.name, x.tobytes("C")),
                                                    use_bin_type=True))
        if isinstance(x, np.generic):
            a = np.asarray(x)
            return msgpack.ExtType(3, msgpack.packb((a.shape, a.dtype.name, a.tobytes("C")),
                                                    use_bin_type=True))
        return x

    def chunk(a):
        flat = a.reshape(-1)
        half = max(1, flat.size // 2)
        return {"__msgpack_chunked_array__": True,
                "shape": {str(i): s for i, s in enumerate(a.shape)},
                "chunks": {"0": flat[:half], "1": flat[half:]}}

    def with_chunks(tree, prefix=""):
        out = {}
        for k, v in tree.items():
            p = f"{prefix}{k}"
            out[k] = with_chunks(v, p + "/") if isinstance(v, dict) else (
                chunk(v) if p in chunked else v)
        return out

    zeros = lambda t: {k: zeros(v) if isinstance(v, dict) else np.zeros_like(v)  # noqa: E731
                       for k, v in t.items()}
    state = {
        "step": np.int64(step),
        "params": with_chunks(params),
        "opt_state": {"0": {"count": np.int32(step), "mu": zeros(params), "nu": zeros(params)},
                      "1": {}, "2": {"count": np.int32(step)}},
        "batch_stats": None,
        "dynamic_scale": None,
    }
    with open(path, "wb") as f:
        f.write(msgpack.packb(state, default=ext_pack, strict_types=True))


# ---------------------------------------------------------------------------------------------
# SAN (shared/specs/san.md; hszhao/SAN model/san.py: conv_in, bn_in, conv{i}, bn{i},
# layer{i}.{j}.{bn1, sam, bn2, conv}, fc; tool/train.py saves {'epoch', 'state_dict', ...} of the
# DDP-wrapped model, so every key carries 'module.')
# ---------------------------------------------------------------------------------------------

def _bn(prefix: str, c: int) -> Dict[str, Shape]:
    return {prefix + "weight": (c,), prefix + "bias": (c,), prefix + "running_mean": (c,),
            prefix + "running_var": (c,), prefix + "num_batches_tracked": ()}


def san_official_manifest(depths: Sequence[int], sa_type: str,
                          kernels: Sequence[int] = (3, 7, 7, 7, 7),
                          widths: Sequence[int] = (64, 256, 512, 1024, 2048),
                          stem: int = 64, num_classes: int = 1000) -> Dict[str, Shape]:
    """Every key of the official model's state dict (without ``module.``), with its shape."""
    keys: Dict[str, Shape] = {"conv_in.weight": (stem, 3, 1, 1), **_bn("bn_in.", stem)}
    prev = stem
    for i, (depth, c, k) in enumerate(zip(depths, widths, kernels)):
        keys[f"conv{i}.weight"] = (c, prev, 1, 1)
        keys.update(_bn(f"bn{i}.", c))
        rel, mid = c // 16, c // 4
        cw = mid // 8
        for j in range(depth):
            b = f"layer{i}.{j}."
            keys.update(_bn(b + "bn1.", c))
            for name, out in (("conv1", rel), ("conv2", rel), ("conv3", mid)):
                keys[f"{b}sam.{name}.weight"] = (out, c, 1, 1)
                keys[f"{b}sam.{name}.bias"] = (out,)
            if sa_type == "pairwise":
                keys.update(_bn(b + "sam.conv_w.0.", rel + 2))
                keys[b + "sam.conv_w.2.weight"] = (rel, rel + 2, 1, 1)
                keys.update(_bn(b + "sam.conv_w.3.", rel))
                keys[b + "sam.conv_w.5.weight"] = (cw, rel, 1, 1)
                keys[b + "sam.conv_w.5.bias"] = (cw,)
                keys[b + "sam.conv_p.weight"] = (2, 2, 1, 1)
                keys[b + "sam.conv_p.bias"] = (2,)
            else:
                keys.update(_bn(b + "sam.conv_w.0.", rel * (k * k + 1)))
                keys[b + "sam.conv_w.2.weight"] = (cw, rel * (k * k + 1), 1, 1)
                keys.update(_bn(b + "sam.conv_w.3.", cw))
                keys[b + "sam.conv_w.5.weight"] = (k * k * cw, cw, 1, 1)
                keys[b + "sam.conv_w.5.bias"] = (k * k * cw,)
            keys.update(_bn(b + "bn2.", mid))
            keys[b + "conv.weight"] = (c, mid, 1, 1)
            keys[b + "conv.bias"] = (c,)
        prev = c
    keys["fc.weight"] = (num_classes, prev)
    keys["fc.bias"] = (num_classes,)
    return keys


def san_to_official(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """attnzoo SAN (timm layout) -> the official names. The official ``bn{i}`` closes stage i;
    attnzoo opens stage i + 1 with it (``stages.{i+1}.downsample.norm``), the last one is
    ``norm``."""
    last = max(int(k.split(".")[1]) for k in state_dict if k.startswith("stages."))
    out = {}
    for k, v in state_dict.items():
        parts = k.split(".")
        if parts[0] == "stem":
            name = {"conv": "conv_in", "norm": "bn_in"}[parts[1]] + "." + ".".join(parts[2:])
        elif parts[0] == "norm":
            name = f"bn{last}." + ".".join(parts[1:])
        elif parts[0] == "head":
            assert parts[1] == "fc", k
            name = "fc." + ".".join(parts[2:])
        elif parts[2] == "downsample":
            i = int(parts[1])
            if parts[3] == "conv":
                name = f"conv{i}." + ".".join(parts[4:])
            else:
                name = f"bn{i - 1}." + ".".join(parts[4:])
        else:
            i, j, module = parts[1], parts[3], parts[4]
            module = {"norm1": "bn1", "attn": "sam", "norm2": "bn2", "conv": "conv"}[module]
            name = f"layer{i}.{j}.{module}." + ".".join(parts[5:])
        out[name] = v
    return out


def san_training_checkpoint(state_dict: Dict[str, torch.Tensor]) -> dict:
    """What the official tool/train.py saves: the DDP model's state dict in a wrapper."""
    return {"epoch": 100, "state_dict": {"module." + k: v for k, v in state_dict.items()},
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.0, "momentum": 0.9}]},
            "top1_val": 0.0}


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
