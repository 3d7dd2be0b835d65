""" QnA-ViT

Paper: `Learned Queries for Efficient Local Attention` - https://arxiv.org/abs/2112.11435
@inproceedings{arar2022learned,
  title     = {Learned Queries for Efficient Local Attention},
  author    = {Arar, Moab and Shamir, Ariel and Bermano, Amit H.},
  booktitle = {Proceedings of the IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR)},
  year      = {2022},
}

Official code and weights (JAX/Flax, MIT license): https://github.com/moabarar/qna. The authors
publish the weights as Flax checkpoints behind a download link: :func:`read_checkpoint` reads
them (msgpack + numpy, no JAX) and :func:`checkpoint_filter_fn` converts them. ``attnzoo
publish`` puts the converted weights in the project's Hub repos (``attnzoo/qna_vit_tiny.in1k``),
which ``pretrained=True`` loads; a local copy loads with ``attnzoo convert qna_vit_tiny
checkpoint_N qna_vit_tiny.safetensors`` and ``timm.create_model('qna_vit_tiny', pretrained=True,
pretrained_cfg_overlay=dict(file='qna_vit_tiny.safetensors'))``.

Architecture: a 4x4 stride-4 patch conv, four stages of pre-norm blocks (LayerNorm eps 1e-6,
tanh GELU MLP x4, no layer scale), LayerNorm, global average pool, linear head. A stage runs
window self-attention blocks ("LSA", stages 2-3) first, then QnA blocks; in the paper the last
QnA block of stages 0-2 strides 2 and doubles the channels and heads.

Mapping onto timm's layout (attnzoo's model policy, :mod:`attnzoo.models`): that downsampling
block (QnA with stride 2 and a 1x1 stride-2 conv skip) is the ``downsample`` leading
``stages.{i+1}``, so ``stages.0`` is the first two QnA blocks at stride 4, ``stages.1`` the first
downsampling block and three QnA blocks at stride 8, and so on: a stage's output is the last
feature map at its resolution (NCHW, ``embed_dim * 2**i`` channels, reduction ``4 * 2**i``), what
``features_only`` / ``forward_intermediates`` return. Execution order, and so the drop-path
schedule (linear over every block, the downsampling ones included, which drop only their MLP
branch), is the official one.

Input sizes: any ``H, W >= 1``. The stem pads like the official ``'SAME'`` convolution (nothing
at multiples of 4), QnA handles every size (out-of-bounds keys are excluded from its windows),
stride-2 levels are ``ceil(H / 2)``. The official LSA requires the window (14 in stage 2, 7 in
stage 3) to divide the map (multiples of 224 px); here each axis uses the fewest windows of at
most that size which cover the map, made as equal as possible, and masks the padded keys where
they do not divide it evenly: at multiples of 224 px this is exactly the official tiling, a map
no larger than the window (e.g. 160 px: 10x10 and 5x5) is one global window, and 256 px (16x16
in stage 2) uses 2x2 windows of 8x8.
"""
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import (
    DropPath,
    LayerNorm2d,
    Mlp,
    calculate_drop_path_rates,
    lecun_normal_,
)
from timm.layers.activations import GELUTanh  # timm 1.0.29 does not export it from timm.layers
from timm.models import generate_default_cfgs, register_notrace_function

from .. import backends
from ..layers import LocalSelfAttention, QnA
from ..layers.quest import check_attn_norm
from ._helpers import check_attn_drop_rate, check_state_dict, per_stage, unwrap_checkpoint
from ._registry import register_model
from ._staged import ImageStem, Stage, StagedModel, build_staged, mlp_rows, staged_cfg
from ._weights import hub_weights

__all__ = ["QnAViT", "checkpoint_filter_fn", "read_checkpoint"]

_LN_EPS = 1e-6  # Flax's LayerNorm default


@register_notrace_function
def pad_same(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """TensorFlow / JAX ``'SAME'`` padding of NCHW ``x`` for the stem's convolution (kernel and
    stride ``patch_size``): up to the next multiple of ``patch_size`` per axis, the smaller half
    first; no copy where nothing is padded. An exported graph serves every size: it always pads
    (maybe by 0), by amounts that follow the traced size."""
    pads: List[int] = []
    for n in (x.shape[3], x.shape[2]):
        # the padded size in blocks as (n - 1) // p + 1, a strided conv's own form: a traced
        # size's later sizes then simplify to (s - 1) // 2**i + 1 (from (n + p - 1) // p they
        # nest divisions, which every later shape carried: a dynamic-size export 77 -> 50 s)
        total = ((n - 1) // patch_size + 1) * patch_size - n
        pads += [total // 2, total - total // 2]
    # (is_scripting() first: TorchScript compiles neither the check nor the export branch)
    if not torch.jit.is_scripting():
        if backends.exporting():
            return F.pad(x, pads)
    if max(pads) > 0:
        x = F.pad(x, pads)
    return x


class Stem(ImageStem):
    """The official stem: a 4x4 stride-4 convolution, no bias, ``'SAME'`` padding (none at
    multiples of 4), no norm; NCHW in and out."""

    def __init__(self, in_chans: int = 3, embed_dim: int = 64, patch_size: int = 4, device=None,
                 dtype=None):
        super().__init__(in_chans)
        self.patch_size = patch_size
        self.conv = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size, bias=False,
                              device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(pad_same(self.check(x), self.patch_size))


class Block(nn.Module):
    """Pre-norm transformer block on NHWC maps: ``x + drop_path(attn(norm1(x)))``, then
    ``x + drop_path(mlp(norm2(x)))``; ``attn`` is a :class:`~attnzoo.layers.QnA` or a
    :class:`~attnzoo.layers.LocalSelfAttention`."""

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: float = 4., proj_drop: float = 0.,
                 drop_path: float = 0., device=None, dtype=None):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=_LN_EPS, **dd)
        self.attn = attn
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=_LN_EPS, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=GELUTanh, drop=proj_drop, **dd)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x)))
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x

    def forward_rows(self, x: torch.Tensor, layout: Tuple[int, int, int]) -> torch.Tensor:
        """``forward`` on the map's rows while exporting (:meth:`Stage.blocks_on_rows`)."""
        x = x + self.drop_path1(self.attn.forward_rows(self.norm1(x), layout))
        x = x + self.drop_path2(mlp_rows(self.mlp, self.norm2(x)))
        return x


class DownsampleBlock(nn.Module):
    """The paper's downsampling QnA block, NHWC: a stride-2 QnA with ``out_dim`` channels, whose
    skip is a 1x1 stride-2 conv (no bias) of the un-normalised input, then the MLP half of a
    block. Only the MLP branch has drop path (as officially)."""

    def __init__(self, dim: int, out_dim: int, num_heads: int, kernel_size: int = 3,
                 num_queries: int = 2, mlp_ratio: float = 4., proj_drop: float = 0.,
                 drop_path: float = 0., backend: Optional[str] = None, device=None, dtype=None):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        self.shortcut = nn.Conv2d(dim, out_dim, 1, stride=2, bias=False, **dd)
        self.norm1 = nn.LayerNorm(dim, eps=_LN_EPS, **dd)
        self.attn = QnA(dim, out_dim, num_heads, kernel_size=kernel_size, stride=2,
                        num_queries=num_queries, proj_drop=proj_drop, backend=backend, **dd)
        self.norm2 = nn.LayerNorm(out_dim, eps=_LN_EPS, **dd)
        self.mlp = Mlp(out_dim, int(out_dim * mlp_ratio), act_layer=GELUTanh, drop=proj_drop,
                       **dd)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = self.shortcut(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        x = shortcut + self.attn(self.norm1(x))
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x


class QnAStage(Stage):
    """``downsample`` (identity in stage 0), then the LSA blocks, then the QnA blocks; NHWC
    inside, NCHW in and out, so a stage's output is its feature tap for every feature
    extractor."""

    def __init__(
            self,
            in_dim: int,
            dim: int,
            qna_depth: int,
            lsa_depth: int,
            qna_heads: int,
            lsa_heads: int,
            kernel_size: int,
            window_size: int,
            drop_path: Sequence[float],
            downsample: Optional[Dict[str, Any]] = None,
            num_queries: int = 2,
            mlp_ratio: float = 4.,
            proj_drop: float = 0.,
            backend: Optional[str] = None,
            attn_norm: str = "none",
            device=None, dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        dpr = list(drop_path)
        if downsample is not None:
            self.downsample = DownsampleBlock(
                in_dim, dim, num_queries=num_queries, mlp_ratio=mlp_ratio, proj_drop=proj_drop,
                drop_path=dpr.pop(0), backend=backend, **downsample, **dd)
        else:
            self.downsample = nn.Identity()
        blocks = []
        for j in range(lsa_depth + qna_depth):
            if j < lsa_depth:
                attn = LocalSelfAttention(dim, lsa_heads, window_size=window_size,
                                          proj_drop=proj_drop, attn_norm=attn_norm, **dd)
            else:
                attn = QnA(dim, dim, qna_heads, kernel_size=kernel_size, num_queries=num_queries,
                           proj_drop=proj_drop, backend=backend, **dd)
            blocks.append(Block(dim, attn, mlp_ratio=mlp_ratio, proj_drop=proj_drop,
                                drop_path=dpr[j], **dd))
        self.blocks = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NCHW -> NHWC, stored NHWC: a view for the NCHW (channels-last) outputs of earlier
        # stages, one copy after the stem; every residual sum then keeps this layout.
        x = self.downsample(x.permute(0, 2, 3, 1).contiguous())
        return self.forward_blocks(x).permute(0, 3, 1, 2)


class QnAViT(StagedModel):
    """QnA-ViT: hierarchical vision transformer of QnA and window self-attention blocks.

    Args (besides ``in_chans``, ``num_classes``, ``global_pool``, ``drop_rate``: see
    :class:`~attnzoo.models._staged.StagedModel`):
        embed_dim: channels of stage 0; stage ``i`` has ``embed_dim * 2 ** i``.
        qna_depths: QnA blocks per stage of the paper (its downsampling blocks not counted).
        lsa_depths: window self-attention blocks per stage.
        qna_heads: QnA heads per stage (a downsampling block has twice its stage's heads).
        lsa_heads: self-attention heads per stage.
        kernel_size: QnA window size, one int or one per stage.
        window_sizes: largest LSA window per stage (see the module docstring for other sizes).
        num_queries: learned queries per QnA layer.
        mlp_ratio: MLP hidden width / dim.
        proj_drop_rate: dropout after attention / MLP projections.
        drop_path_rate: stochastic depth, linear from 0 over every block in execution order.
        attn_drop_rate: attention-weight dropout, timm's argument: must be 0 (the op fuses the
            weighting; a nonzero rate raises ``ValueError``).
        backend: ``qna2d`` backend for every QnA layer (``None``: follow
            :mod:`attnzoo.backends`).
        attn_norm: ``"none"`` (QnA-ViT) or ``"quest"``: the LSA blocks normalise their keys
            and use scale 1 (QUEST, arXiv:2604.00199); same parameters, so QnA-ViT weights
            load as an initialisation. QnA's own learned-query attention is unchanged.
    """

    def __init__(
            self,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'avg',
            embed_dim: int = 64,
            qna_depths: Tuple[int, ...] = (2, 3, 2, 0),
            lsa_depths: Tuple[int, ...] = (0, 0, 4, 2),
            qna_heads: Tuple[int, ...] = (8, 16, 32, 64),
            lsa_heads: Tuple[int, ...] = (2, 4, 8, 16),
            kernel_size: Union[int, Sequence[int]] = 3,
            window_sizes: Union[int, Sequence[int]] = (7, 7, 14, 7),
            num_queries: int = 2,
            mlp_ratio: float = 4.,
            drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            drop_path_rate: float = 0.05,
            attn_drop_rate: float = 0.,
            backend: Optional[str] = None,
            attn_norm: str = "none",
            device=None, dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        check_attn_drop_rate(attn_drop_rate, "QnA-ViT",
                             "its QnA op fuses the softmax with the window sum")
        check_attn_norm(attn_norm)   # also where no stage has LSA blocks
        num_stages = len(qna_depths)
        lsa_depths = per_stage(lsa_depths, num_stages, "lsa_depths")
        qna_heads = per_stage(qna_heads, num_stages, "qna_heads")
        lsa_heads = per_stage(lsa_heads, num_stages, "lsa_heads")
        kernel_sizes = per_stage(kernel_size, num_stages, "kernel_size")
        window_sizes = per_stage(window_sizes, num_stages, "window_sizes")

        stem = Stem(in_chans, embed_dim, **dd)
        # In execution order: stage i's downsampling block (from i = 1), LSA and QnA blocks.
        dpr = calculate_drop_path_rates(drop_path_rate,
                                        sum(lsa_depths) + sum(qna_depths) + num_stages - 1)
        feature_info, stages = [], []
        dim = embed_dim
        for i in range(num_stages):
            in_dim, dim = dim, embed_dim * 2 ** i
            n = lsa_depths[i] + qna_depths[i] + (i > 0)
            stage_dpr, dpr = dpr[:n], dpr[n:]
            downsample = None if i == 0 else dict(num_heads=2 * qna_heads[i - 1],
                                                  kernel_size=kernel_sizes[i - 1])
            stages.append(QnAStage(
                in_dim, dim, qna_depths[i], lsa_depths[i], qna_heads[i], lsa_heads[i],
                kernel_sizes[i], window_sizes[i], stage_dpr, downsample=downsample,
                num_queries=num_queries, mlp_ratio=mlp_ratio, proj_drop=proj_drop_rate,
                backend=backend, attn_norm=attn_norm, **dd))
            feature_info.append(dict(num_chs=dim, reduction=4 * 2 ** i, module=f'stages.{i}'))
        super().__init__(
            stem=stem, stages=stages, norm=LayerNorm2d(dim, eps=_LN_EPS, **dd),
            feature_info=feature_info, in_chans=in_chans, min_size=1, num_classes=num_classes,
            global_pool=global_pool, drop_rate=drop_rate)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Official (Flax) init: every dense and conv kernel lecun_normal, zero biases; the QnA
        # and LSA layers initialise their own parameters.
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            lecun_normal_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        # Official: no decay on relative biases and window weights.
        return {n for n, _ in self.named_parameters()
                if n.endswith(('.rpb', '.window_weights', '.relative_position_bias_table'))}


# --------------------------------------------------------------------------------------------
# official checkpoints
# --------------------------------------------------------------------------------------------

def read_checkpoint(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """The tree of an official checkpoint: a Flax "legacy" msgpack file (``checkpoint_<step>``,
    ``flax.serialization.to_bytes`` of the training state: ``step``, ``params``,
    ``opt_state``, ...), read with msgpack and numpy, no JAX. Arrays are msgpack extension
    type 1 holding ``msgpack((shape, dtype name, C-order bytes))``, numpy scalars type 3;
    arrays over 1 GiB are stored as ``__msgpack_chunked_array__`` dicts.

    Raises ``ImportError`` naming what to install when msgpack or numpy is missing and
    ``ValueError`` for a file that is not such a checkpoint."""
    try:
        import msgpack
        import numpy as np
    except ImportError as e:
        raise ImportError(
            f"reading the official QnA-ViT Flax checkpoints needs msgpack and numpy ({e}): "
            "pip install msgpack numpy (from a checkout: pip install -e '.[convert]')") from e
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")

    def array(payload: bytes) -> "np.ndarray":
        shape, dtype, buffer = msgpack.unpackb(payload, raw=True)
        if dtype == b'bfloat16':  # JAX's bfloat16: the high half of a float32
            bits = np.frombuffer(buffer, dtype=np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(shape)
        return np.frombuffer(buffer, dtype=np.dtype(dtype.decode())).reshape(shape)

    def ext_hook(code: int, payload: bytes) -> Any:
        if code == 1:
            return array(payload)
        if code == 3:
            return array(payload)[()]
        if code == 2:
            real, imag = msgpack.unpackb(payload)
            return complex(real, imag)
        return msgpack.ExtType(code, payload)

    def unchunk(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if '__msgpack_chunked_array__' in node:
            shape = tuple(node['shape'][str(i)] for i in range(len(node['shape'])))
            chunks = [node['chunks'][str(i)] for i in range(len(node['chunks']))]
            return np.concatenate(chunks).reshape(shape)
        return {k: unchunk(v) for k, v in node.items()}

    with open(path, 'rb') as f:
        data = f.read()
    try:
        tree = msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - say what the file is not, with the cause
        raise ValueError(f"{path!r} is not a Flax msgpack checkpoint ({type(e).__name__}: {e})"
                         ) from e
    if not isinstance(tree, dict):
        raise ValueError(f"{path!r} is not a Flax checkpoint: its msgpack holds a "
                         f"{type(tree).__name__}, not a tree of named parameters")
    return unchunk(tree)


def _dense(shape):  # Flax Dense kernel (in, out) <-> Linear.weight (out, in)
    return (shape[1], shape[0]), lambda a: a.T


def _conv(shape):  # Flax conv kernel HWIO <-> OIHW
    return (shape[2], shape[3], shape[1], shape[0]), lambda a: a.transpose(3, 2, 0, 1)


def _same(shape):
    return tuple(shape), lambda a: a


def _per_offset(shape, leading=()):
    """Flax ``(k*k, L*h)`` (``leading`` singleton dims first), index ``[a*k + b, l*h + head]``
    <-> ours ``[L, h, k, k]``."""
    L, h, k, _ = shape
    return leading + (k * k, L * h), lambda a: a.reshape(k, k, L, h).transpose(2, 3, 0, 1)


def _qkv(num_heads: int):
    def layout(shape):  # Flax (C, 3C), output ordered (head, q|k|v, d); timm's is (q|k|v, head, d)
        C = shape[1]
        d = C // num_heads
        return (C, 3 * C), lambda a: a.reshape(C, num_heads, 3, d).transpose(0, 2, 1, 3).reshape(
            C, 3 * C).T
    return layout


def _flax_layout(model: QnAViT) -> List[Tuple[str, str, Callable]]:
    """``(our key, Flax leaf path, layout)`` for every parameter, in the official tree's names:
    ``QnAStage_{s}/QnA_Block_{j}`` (1-based), ``QnAStage_{s}/QnA_Block_{n+1}_stride_2`` (stage
    ``s``'s downsampling block, our ``stages.{s+1}.downsample``), ``LSAStage_{s}/MSA_Block_{j}``,
    ``StemBlock_0``, ``ClassificationHead_0``."""
    entries = [('stem.conv.weight', 'StemBlock_0/conv_1x1/kernel', _conv),
               ('norm.weight', 'ClassificationHead_0/LayerNorm_0/scale', _same),
               ('norm.bias', 'ClassificationHead_0/LayerNorm_0/bias', _same),
               ('head.fc.weight', 'ClassificationHead_0/head_logits/kernel', _dense),
               ('head.fc.bias', 'ClassificationHead_0/head_logits/bias', _same)]

    def block(ours: str, flax: str, mixer: nn.Module):
        out = [(f'{ours}.norm1.weight', f'{flax}/LayerNorm_0/scale', _same),
               (f'{ours}.norm1.bias', f'{flax}/LayerNorm_0/bias', _same),
               (f'{ours}.norm2.weight', f'{flax}/LayerNorm_1/scale', _same),
               (f'{ours}.norm2.bias', f'{flax}/LayerNorm_1/bias', _same)]
        for i, fc in enumerate(('fc1', 'fc2')):
            out += [(f'{ours}.mlp.{fc}.weight', f'{flax}/MlpBlock_0/Dense_{i}/kernel', _dense),
                    (f'{ours}.mlp.{fc}.bias', f'{flax}/MlpBlock_0/Dense_{i}/bias', _same)]
        a = f'{ours}.attn'
        if isinstance(mixer, QnA):
            f = f'{flax}/FusedKQnA_0'
            out += [(f'{a}.queries', f'{f}/query', _same), (f'{a}.k.weight', f'{f}/Wk', _dense),
                    (f'{a}.v.weight', f'{f}/to_v/kernel', _dense),
                    (f'{a}.proj.weight', f'{f}/to_out/kernel', _dense),
                    (f'{a}.rpb', f'{f}/rpe_bias', _per_offset),
                    (f'{a}.window_weights', f'{f}/attn_scale_weights',
                     lambda shape: _per_offset(shape, leading=(1, 1)))]
        else:
            f = f'{flax}/MultiHeadSelfAttention_0'
            out += [(f'{a}.qkv.weight', f'{f}/to_qkv/kernel', _qkv(mixer.num_heads)),
                    (f'{a}.proj.weight', f'{f}/to_out/kernel', _dense),
                    (f'{a}.relative_position_bias_table',
                     f'{f}/RelativePositionalEmbedding_0/rpe_bias', _same)]
        return out

    n_qna = 0  # QnA blocks of the previous stage: its downsampling block is QnA_Block_{n+1}
    for s, stage in enumerate(model.stages):
        if isinstance(stage.downsample, DownsampleBlock):
            name = f'QnAStage_{s - 1}/QnA_Block_{n_qna + 1}_stride_2'
            entries += block(f'stages.{s}.downsample', name, stage.downsample.attn)
            entries.append((f'stages.{s}.downsample.shortcut.weight', f'{name}/Conv_0/kernel',
                            _conv))
        n_lsa = n_qna = 0
        for j, blk in enumerate(stage.blocks):
            if isinstance(blk.attn, QnA):
                n_qna += 1
                name = f'QnAStage_{s}/QnA_Block_{n_qna}'
            else:
                n_lsa += 1
                name = f'LSAStage_{s}/MSA_Block_{n_lsa}'
            entries += block(f'stages.{s}.blocks.{j}', name, blk.attn)
    return entries


def _flatten_tree(tree: Dict[str, Any], prefix: str = '') -> Dict[str, Any]:
    flat = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            flat.update(_flatten_tree(v, f'{prefix}{k}/'))
        else:
            flat[f'{prefix}{k}'] = v
    return flat


# Flax-layout dims that may differ from the model: timm adapts the stem's input channels
# (in_chans) and the classifier (num_classes) after the filter.
_ADAPTED_DIM = {'stem.conv.weight': 2, 'head.fc.weight': 1, 'head.fc.bias': 0}


def _from_flax(tree: Dict[str, Any], model: QnAViT) -> Dict[str, torch.Tensor]:
    """The official Flax tree (the training state or its ``params``) -> our state dict. Raises
    ``ValueError`` naming the first leaf that is missing, mis-shaped or left over."""
    import numpy as np

    while isinstance(tree.get('params'), dict):  # training state -> params (-> params)
        tree = tree['params']
    leaves = _flatten_tree(tree)
    expected = model.state_dict()
    name = type(model).__name__
    out, used = {}, set()
    for key, path, layout in _flax_layout(model):
        if path not in leaves:
            raise ValueError(f"official checkpoint has no leaf '{path}' (needed for {key}): "
                             f"it is not a checkpoint of this {name} variant")
        leaf = np.asarray(leaves[path])
        used.add(path)
        if key not in expected:  # a classifier the model does not have (num_classes=0)
            out[key] = torch.from_numpy(np.array(leaf.T if leaf.ndim == 2 else leaf, np.float32))
            continue
        want = tuple(expected[key].shape)
        flax_shape, convert = layout(want)
        free = _ADAPTED_DIM.get(key)  # a dim timm adapts itself (in_chans, num_classes)
        fits = leaf.ndim == len(flax_shape) and all(
            a == b for i, (a, b) in enumerate(zip(leaf.shape, flax_shape)) if i != free)
        if key.endswith('.window_weights') and leaf.shape == flax_shape[2:]:
            fits = True  # also accept the rpe_bias-like (k*k, L*h) form
        if not fits:
            raise ValueError(f"official checkpoint leaf '{path}' has shape {tuple(leaf.shape)}, "
                             f"expected {flax_shape} (Flax layout of {key} {want}): it is not a "
                             f"checkpoint of this {name} variant")
        out[key] = torch.from_numpy(np.array(convert(leaf), dtype=np.float32))  # a writable copy
    extra = [p for p in leaves if p not in used]
    if extra:
        raise ValueError(f"official checkpoint leaf '{extra[0]}' has no place in this {name} "
                         f"variant ({len(extra)} unused leaves): wrong variant?")
    return out


def _is_flax_tree(state_dict: Dict[str, Any]) -> bool:
    return isinstance(state_dict.get('params'), dict) or 'StemBlock_0' in state_dict


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: QnAViT) -> Dict[str, torch.Tensor]:
    """Map a QnA-ViT checkpoint onto ``model``'s state dict.

    Accepts the official Flax tree (:func:`read_checkpoint`'s result: the training state or its
    ``params``; every leaf converted to our layout: Dense kernels transposed, HWIO convs to
    OIHW, the per-offset ``rpe_bias`` / ``attn_scale_weights`` to ``[L, heads, k, k]``, the
    LSA ``to_qkv`` output reordered from ``(head, q|k|v, d)`` to timm's ``(q|k|v, head, d)``)
    and ours (raw or wrapped). Raises ``ValueError`` naming the first official leaf that is
    missing, mis-shaped or unused, or listing our keys that do not match; the classifier and
    the stem's input channels are left for timm to adapt (``num_classes`` / ``in_chans``).
    """
    if _is_flax_tree(state_dict):
        state_dict = _from_flax(state_dict, model)
    else:
        state_dict = unwrap_checkpoint(state_dict)
    return check_state_dict(state_dict, model, adaptable=('head.fc.',), first_conv='stem.conv')


# --------------------------------------------------------------------------------------------
# model creation, pretrained configs, entrypoints
# --------------------------------------------------------------------------------------------

def _create_qna_vit(variant: str, pretrained: bool = False, **kwargs) -> QnAViT:
    return build_staged(QnAViT, variant, pretrained, len(kwargs.get('qna_depths', range(4))),
                        checkpoint_filter_fn, **kwargs)


# The official weights are Flax checkpoints behind the authors' download link; `attnzoo publish`
# converts them into the project's Hub repos (_weights), which pretrained=True loads
# once published.
_CFG = staged_cfg(
    license='mit', origin_url='https://github.com/moabarar/qna', paper_ids='arXiv:2112.11435',
    paper_name='Learned Queries for Efficient Local Attention')


default_cfgs = generate_default_cfgs({
    tag: dict(_CFG, **hub_weights(tag)) for tag in (
        'qna_vit_tiny.in1k', 'qna_vit_tiny_7x7.in1k', 'qna_vit_small.in1k', 'qna_vit_base.in1k')
})

_TINY = dict(embed_dim=64, qna_depths=(2, 3, 2, 0), lsa_depths=(0, 0, 4, 2),
             qna_heads=(8, 16, 32, 64), lsa_heads=(2, 4, 8, 16), drop_path_rate=0.05)
_SMALL = dict(_TINY, qna_depths=(2, 3, 6, 0), lsa_depths=(0, 0, 12, 2), drop_path_rate=0.2)
_BASE = dict(_SMALL, embed_dim=96, qna_heads=(6, 12, 24, 48), lsa_heads=(3, 6, 12, 24),
             drop_path_rate=0.5)


@register_model
def qna_vit_tiny(pretrained=False, **kwargs) -> QnAViT:
    """QnA-ViT-Tiny (15.7M params, 2.4 GMACs @ 224), 3x3 QnA windows."""
    model_args = _TINY
    return _create_qna_vit('qna_vit_tiny', pretrained, **dict(model_args, **kwargs))


@register_model
def qna_vit_tiny_7x7(pretrained=False, **kwargs) -> QnAViT:
    """QnA-ViT-Tiny with 7x7 QnA windows (15.8M params, 2.5 GMACs @ 224)."""
    model_args = dict(_TINY, kernel_size=7)
    return _create_qna_vit('qna_vit_tiny_7x7', pretrained, **dict(model_args, **kwargs))


@register_model
def qna_vit_small(pretrained=False, **kwargs) -> QnAViT:
    """QnA-ViT-Small (25.0M params, 4.3 GMACs @ 224)."""
    model_args = _SMALL
    return _create_qna_vit('qna_vit_small', pretrained, **dict(model_args, **kwargs))


@register_model
def qna_vit_base(pretrained=False, **kwargs) -> QnAViT:
    """QnA-ViT-Base (55.7M params, 9.5 GMACs @ 224)."""
    model_args = _BASE
    return _create_qna_vit('qna_vit_base', pretrained, **dict(model_args, **kwargs))


# leaves for torch.fx's own tracer too (timm's honours register_notrace_function only)
for _leaf in ('pad_same',):
    torch.fx.wrap(_leaf)
