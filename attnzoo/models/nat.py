""" NAT and DiNAT

Papers:
* `Neighborhood Attention Transformer` - https://arxiv.org/abs/2204.07143
@inproceedings{hassani2023neighborhood,
  title     = {Neighborhood Attention Transformer},
  author    = {Ali Hassani and Steven Walton and Jiachen Li and Shen Li and Humphrey Shi},
  booktitle = {Proceedings of the IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR)},
  year      = {2023},
}

* `Dilated Neighborhood Attention Transformer` - https://arxiv.org/abs/2209.15001
@article{hassani2022dilated,
  title   = {Dilated Neighborhood Attention Transformer},
  author  = {Ali Hassani and Humphrey Shi},
  journal = {arXiv preprint arXiv:2209.15001},
  year    = {2022},
}

Pretrained weights are the official ImageNet weights as published by SHI Labs on the Hugging Face
Hub in the `transformers` layout (``shi-labs/nat-*`` / ``shi-labs/dinat-*``, MIT license).

Module tree (attnzoo's model policy, :mod:`attnzoo.models`): ``stem`` (two overlapping stride-2
convs and a LayerNorm) -> ``stages.{0..3}`` (``downsample``, identity in stage 0, then
``blocks``; NCHW in and out, NHWC inside) -> ``norm`` -> ``head`` (timm's ``ClassifierHead``).
:func:`checkpoint_filter_fn` converts the official layouts (the original training code's
``.pth`` and the transformers layout of the Hub repos) onto it.

Input sizes: any ``H, W >= 1``. Each stride-2 conv gives ``ceil(H / 2)``, so stage ``i`` sees
``ceil(H / 2 ** (i + 2))``; where a stage is smaller than ``kernel_size * dilation`` the attention
zero-pads its normalised input right/bottom up to that size and crops the result (the official
runtime's rule), so official weights give official outputs at every size.
"""
import re
from typing import Any, Dict, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn
from timm.layers import (
    DropPath,
    LayerNorm2d,
    LayerScale,
    Mlp,
    calculate_drop_path_rates,
    trunc_normal_,
)
from timm.models import generate_default_cfgs

from ..layers import NeighborhoodAttention2d
from ._helpers import (check_attn_drop_rate, check_state_dict, per_stage, rename_key,
                       replace_prefix, unwrap_checkpoint)
from ._registry import register_model
from ._staged import ImageStem, Stage, StagedModel, build_staged, mlp_rows, staged_cfg
from ._weights import hub_weights

__all__ = ["NAT", "checkpoint_filter_fn"]

# Official LayerNorm eps (PyTorch's default; timm's LayerNorm defaults to 1e-6).
_LN_EPS = 1e-5


class Stem(ImageStem):
    """Two overlapping 3x3 stride-2 convs (no activation between), LayerNorm; NCHW out (with
    channels-last strides)."""

    def __init__(self, in_chans: int = 3, embed_dim: int = 64, device=None, dtype=None):
        dd = {"device": device, "dtype": dtype}
        super().__init__(in_chans)
        self.conv1 = nn.Conv2d(in_chans, embed_dim // 2, 3, stride=2, padding=1, **dd)
        self.conv2 = nn.Conv2d(embed_dim // 2, embed_dim, 3, stride=2, padding=1, **dd)
        self.norm = LayerNorm2d(embed_dim, eps=_LN_EPS, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The blocks work on NHWC anyway; these two convs train ~1.5x faster channels-last on
        # CPU (oneDNN), measured at nat_tiny's shapes.
        x = self.check(x).contiguous(memory_format=torch.channels_last)
        return self.norm(self.conv2(self.conv1(x)))


class Downsample(nn.Module):
    """Between stages: overlapping 3x3 stride-2 conv (no bias) doubling channels, LayerNorm."""

    def __init__(self, dim: int, out_dim: int, device=None, dtype=None):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        self.conv = nn.Conv2d(dim, out_dim, 3, stride=2, padding=1, bias=False, **dd)
        self.norm = LayerNorm2d(out_dim, eps=_LN_EPS, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class NATBlock(nn.Module):
    """Pre-norm transformer block with neighborhood attention on NHWC maps; optional layer
    scale. ``attn_kwargs`` go to :class:`attnzoo.layers.NeighborhoodAttention2d`
    (``kernel_size``, ``dilation``, ``qkv_bias``, ``rel_pos_bias``, ``attn_drop``, ``backend``,
    ``attn_norm``)."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            mlp_ratio: float = 4.,
            proj_drop: float = 0.,
            drop_path: float = 0.,
            layer_scale: Optional[float] = None,
            device=None, dtype=None,
            **attn_kwargs,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=_LN_EPS, **dd)
        self.attn = NeighborhoodAttention2d(dim, num_heads, proj_drop=proj_drop, **attn_kwargs,
                                            **dd)
        self.ls1 = LayerScale(dim, layer_scale, **dd) if layer_scale is not None else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=_LN_EPS, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop, **dd)
        self.ls2 = LayerScale(dim, layer_scale, **dd) if layer_scale is not None else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x

    def forward_rows(self, x: torch.Tensor, layout: Tuple[int, int, int]) -> torch.Tensor:
        """``forward`` on the map's rows while exporting (:meth:`Stage.blocks_on_rows`)."""
        x = x + self.drop_path1(self.ls1(self.attn.forward_rows(self.norm1(x), layout)))
        x = x + self.drop_path2(self.ls2(mlp_rows(self.mlp, self.norm2(x))))
        return x


class NATStage(Stage):
    """``downsample`` (identity in stage 0), then ``blocks`` on NHWC; takes and returns NCHW, so
    a stage's output is its feature tap for every feature extractor (hooks and FX included)."""

    def __init__(
            self,
            in_dim: int,
            dim: int,
            depth: int,
            downsample: bool,
            dilations: Sequence[int],
            drop_path: Sequence[float],
            device=None, dtype=None,
            **block_kwargs,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        self.downsample = Downsample(in_dim, dim, **dd) if downsample else nn.Identity()
        self.blocks = nn.Sequential(*[
            NATBlock(dim, dilation=dilations[j], drop_path=drop_path[j], **block_kwargs, **dd)
            for j in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.downsample(x).permute(0, 2, 3, 1)  # NCHW -> NHWC (a view: channels-last strides)
        return self.forward_blocks(x).permute(0, 3, 1, 2)


class NAT(StagedModel):
    """Neighborhood Attention Transformer; with per-block ``dilations`` it is DiNAT.

    Args (besides ``in_chans``, ``num_classes``, ``global_pool``, ``drop_rate``: see
    :class:`~attnzoo.models._staged.StagedModel`):
        embed_dim: channels of stage 0; stage ``i`` has ``embed_dim * 2 ** i``.
        depths: blocks per stage.
        num_heads: heads per stage.
        kernel_size: neighborhood size, one int or one per stage.
        dilations: ``None`` (NAT: all 1), or per stage an int or a list with one per block
            (DiNAT).
        mlp_ratio: MLP hidden width / dim.
        qkv_bias: bias on the fused qkv projection.
        rel_pos_bias: learn relative positional biases ``rpb``.
        proj_drop_rate: dropout after attention / MLP projections.
        attn_drop_rate: attention-weight dropout (unsupported by the NA op: must be 0).
        drop_path_rate: stochastic depth, linear from 0 over all blocks.
        layer_scale: initial value of the layer-scale gammas (``None``: no layer scale).
        backend: NA backend for every layer (``None``: follow :mod:`attnzoo.backends`).
        attn_norm: ``"none"`` (NAT / DiNAT) or ``"quest"``: every block's attention normalises
            its keys and uses scale 1 (QUEST, arXiv:2604.00199); same parameters, so NAT / DiNAT
            weights load as an initialisation
            (``timm.create_model('nat_mini.in1k', pretrained=True, attn_norm='quest')``).
    """

    def __init__(
            self,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'avg',
            embed_dim: int = 64,
            depths: Tuple[int, ...] = (3, 4, 6, 5),
            num_heads: Tuple[int, ...] = (2, 4, 8, 16),
            kernel_size: Union[int, Sequence[int]] = 7,
            dilations: Optional[Sequence[Union[int, Sequence[int]]]] = None,
            mlp_ratio: float = 3.,
            qkv_bias: bool = True,
            rel_pos_bias: bool = True,
            drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.2,
            layer_scale: Optional[float] = None,
            backend: Optional[str] = None,
            attn_norm: str = "none",
            device=None, dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        check_attn_drop_rate(attn_drop_rate, "NAT", "its neighborhood-attention op fuses the "
                                                    "softmax")
        num_stages = len(depths)
        heads = per_stage(num_heads, num_stages, "num_heads")
        kernel_sizes = per_stage(kernel_size, num_stages, "kernel_size")
        dilations = per_stage(1 if dilations is None else dilations, num_stages, "dilations")
        dilations = [per_stage(d, depth, f"dilations[{i}]")
                     for i, (d, depth) in enumerate(zip(dilations, depths))]

        stem = Stem(in_chans, embed_dim, **dd)
        dpr = calculate_drop_path_rates(drop_path_rate, list(depths), stagewise=True)
        feature_info, stages = [], []
        in_dim = dim = embed_dim
        for i in range(num_stages):
            dim = embed_dim * 2 ** i
            stages.append(NATStage(
                in_dim, dim, depths[i], downsample=i > 0, dilations=dilations[i],
                drop_path=dpr[i], num_heads=heads[i], kernel_size=kernel_sizes[i],
                mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, rel_pos_bias=rel_pos_bias,
                proj_drop=proj_drop_rate, attn_drop=attn_drop_rate, layer_scale=layer_scale,
                backend=backend, attn_norm=attn_norm, **dd))
            feature_info.append(dict(num_chs=dim, reduction=4 * 2 ** i, module=f'stages.{i}'))
            in_dim = dim
        super().__init__(
            stem=stem, stages=stages, norm=LayerNorm2d(dim, eps=_LN_EPS, **dd),
            feature_info=feature_info, in_chans=in_chans,
            min_size=1,  # any size: small levels are padded (see the layer)
            num_classes=num_classes, global_pool=global_pool, drop_rate=drop_rate)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Official init: Linear trunc_normal(.02) / zero bias, LayerNorm 1 / 0, convs default.
        if isinstance(module, nn.Linear):
            trunc_normal_(module.weight, std=.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {n for n, _ in self.named_parameters() if n.endswith('.rpb')}


# --------------------------------------------------------------------------------------------
# checkpoint conversion
# --------------------------------------------------------------------------------------------

# transformers' per-layer names -> official names (``attention.self.{query,key,value}`` are
# concatenated into ``attn.qkv`` and ``layer_scale_parameters`` split into gamma1/gamma2 below).
_HF_PREFIXES = ('nat.', 'dinat.')
_HF_LAYER_MAP = (
    ('layernorm_before.', 'norm1.'),
    ('layernorm_after.', 'norm2.'),
    ('attention.self.rpb', 'attn.rpb'),
    ('attention.output.dense.', 'attn.proj.'),
    ('intermediate.dense.', 'mlp.fc1.'),
    ('output.dense.', 'mlp.fc2.'),
)
_HF_TOP_MAP = (
    ('embeddings.patch_embeddings.projection.', 'patch_embed.proj.'),
    ('embeddings.norm.', 'patch_embed.norm.'),
    ('layernorm.', 'norm.'),
    ('classifier.', 'head.'),
)


def _transformers_to_official(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers' NatForImageClassification / DinatForImageClassification layout -> the
    original training code's layout."""
    out: Dict[str, torch.Tensor] = {}
    qkv: Dict[str, Dict[str, torch.Tensor]] = {}
    for k, v in state_dict.items():
        k = replace_prefix(k, [(prefix, '') for prefix in _HF_PREFIXES])
        if k.startswith('encoder.levels.'):
            k = 'levels.' + k[len('encoder.levels.'):]
            if '.layers.' in k:
                head, rest = k.split('.layers.', 1)
                j, name = rest.split('.', 1)
                block = f'{head}.blocks.{j}.'
                if name.startswith('attention.self.') and name.split('.')[2] in (
                        'query', 'key', 'value'):
                    which, param = name.split('.')[2:4]
                    qkv.setdefault(f'{block}attn.qkv.{param}', {})[which] = v
                    continue
                if name == 'layer_scale_parameters':
                    if v.dim() != 2 or v.shape[0] != 2:
                        raise ValueError(f"{k}: expected layer_scale_parameters of shape "
                                         f"[2, dim], got {tuple(v.shape)}")
                    out[block + 'gamma1'], out[block + 'gamma2'] = v[0], v[1]
                    continue
                k = block + replace_prefix(name, _HF_LAYER_MAP)
        else:
            k = replace_prefix(k, _HF_TOP_MAP)
        out[k] = v
    for k, parts in qkv.items():
        missing = [p for p in ('query', 'key', 'value') if p not in parts]
        if missing:
            raise ValueError(f"transformers checkpoint lacks attention.self.{{{','.join(missing)}}}"
                             f" for {k} (query, key and value are needed to build qkv)")
        out[k] = torch.cat([parts['query'], parts['key'], parts['value']], dim=0)
    return out


# The original training code's names -> ours: (pattern, replacement) on whole keys.
_OFFICIAL_MAP = (
    (r'^patch_embed\.proj\.0\.', 'stem.conv1.'),
    (r'^patch_embed\.proj\.1\.', 'stem.conv2.'),
    (r'^patch_embed\.norm\.', 'stem.norm.'),
    (r'^levels\.(\d+)\.blocks\.(\d+)\.gamma1$', r'stages.\1.blocks.\2.ls1.gamma'),
    (r'^levels\.(\d+)\.blocks\.(\d+)\.gamma2$', r'stages.\1.blocks.\2.ls2.gamma'),
    (r'^levels\.(\d+)\.blocks\.', r'stages.\1.blocks.'),
    (r'^head\.', 'head.fc.'),
)


def _official_to_timm(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    out = {}
    for k, v in state_dict.items():
        # level i's trailing downsampler is stage i + 1's leading one
        m = re.match(r'^levels\.(\d+)\.downsample\.(reduction|norm)\.(.+)$', k)
        if m:
            part = 'conv' if m.group(2) == 'reduction' else 'norm'
            out[f'stages.{int(m.group(1)) + 1}.downsample.{part}.{m.group(3)}'] = v
            continue
        out[rename_key(k, _OFFICIAL_MAP)] = v
    return out


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: NAT) -> Dict[str, torch.Tensor]:
    """Map a NAT / DiNAT checkpoint onto ``model``'s state dict.

    Accepts ours, the original training code's (``patch_embed.*``, ``levels.*``, ``gamma1``),
    and the transformers layout of the ``shi-labs`` Hub repos, each raw or wrapped
    (``{'state_dict' | 'model': ...}``, ``module.`` prefixes). Raises ``ValueError`` listing
    every key that is missing, unexpected or of the wrong shape; the classifier and the stem's
    input channels are left for timm to adapt (``num_classes`` / ``in_chans``).
    """
    state_dict = unwrap_checkpoint(state_dict)
    if any(k.startswith(_HF_PREFIXES + ('embeddings.', 'encoder.levels.')) for k in state_dict):
        state_dict = _transformers_to_official(state_dict)
    if any(k.startswith(('patch_embed.', 'levels.')) for k in state_dict):
        state_dict = _official_to_timm(state_dict)
    return check_state_dict(state_dict, model, adaptable=('head.fc.',), first_conv='stem.conv1')


# --------------------------------------------------------------------------------------------
# model creation, pretrained configs, entrypoints
# --------------------------------------------------------------------------------------------

def _create_nat(variant: str, pretrained: bool = False, **kwargs) -> NAT:
    return build_staged(NAT, variant, pretrained, len(kwargs.get('depths', (3, 4, 6, 5))),
                        checkpoint_filter_fn, **kwargs)


def _cfg(tag: str, paper: Dict[str, str], **kwargs) -> Dict[str, Any]:
    # the authors' transformers-layout uploads (_weights); timm tries model.safetensors first
    return staged_cfg(**hub_weights(tag), first_conv='stem.conv1', license='mit', **paper,
                      **kwargs)


_NAT_PAPER = dict(paper_ids='arXiv:2204.07143', paper_name='Neighborhood Attention Transformer',
                  origin_url='https://github.com/SHI-Labs/Neighborhood-Attention-Transformer')
_DINAT_PAPER = dict(paper_ids='arXiv:2209.15001',
                    paper_name='Dilated Neighborhood Attention Transformer',
                    origin_url='https://github.com/SHI-Labs/Neighborhood-Attention-Transformer')
# 384 fine-tunes: their own dilation schedule / kernel, so their own model names; evaluated on
# the full 384 image (timm's convention for fine-tuned 384 weights).
_AT_384 = dict(input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0)

default_cfgs = generate_default_cfgs({
    **{tag: _cfg(tag, _NAT_PAPER) for tag in (
        'nat_mini.in1k', 'nat_tiny.in1k', 'nat_small.in1k', 'nat_base.in1k')},
    **{tag: _cfg(tag, _DINAT_PAPER) for tag in (
        'dinat_mini.in1k', 'dinat_tiny.in1k', 'dinat_small.in1k', 'dinat_base.in1k',
        'dinat_large.in22k_ft_in1k')},
    **{tag: _cfg(tag, _DINAT_PAPER, **_AT_384) for tag in (
        'dinat_large_384.in22k_ft_in1k', 'dinat_large_11x11_384.in22k_ft_in1k')},
})

# DiNAT dilation schedules (per level, per block): dilated blocks alternate with d=1 blocks;
# d is the largest value with kernel_size * d <= that level's size at the training resolution.
_DINAT_MINI_DILATIONS = ((1, 8, 1), (1, 4, 1, 4), (1, 2, 1, 2, 1, 2), (1, 1, 1, 1, 1))
_DINAT_DILATIONS = ((1, 8, 1), (1, 4, 1, 4), (1, 2) * 9, (1,) * 5)
_DINAT_384_DILATIONS = ((1, 13, 1), (1, 6, 1, 6), (1, 3) * 9, (1,) * 5)

_MINI = dict(depths=(3, 4, 6, 5), num_heads=(2, 4, 8, 16), embed_dim=64, mlp_ratio=3.,
             drop_path_rate=0.2)
_TINY = dict(depths=(3, 4, 18, 5), num_heads=(2, 4, 8, 16), embed_dim=64, mlp_ratio=3.,
             drop_path_rate=0.2)
_SMALL = dict(depths=(3, 4, 18, 5), num_heads=(3, 6, 12, 24), embed_dim=96, mlp_ratio=2.,
              drop_path_rate=0.3)
_BASE = dict(depths=(3, 4, 18, 5), num_heads=(4, 8, 16, 32), embed_dim=128, mlp_ratio=2.,
             drop_path_rate=0.5, layer_scale=1e-5)
_LARGE = dict(depths=(3, 4, 18, 5), num_heads=(6, 12, 24, 48), embed_dim=192, mlp_ratio=2.,
              drop_path_rate=0.35)


@register_model
def nat_mini(pretrained=False, **kwargs) -> NAT:
    """NAT-Mini (20.0M params, 2.7 GMACs @ 224)."""
    model_args = _MINI
    return _create_nat('nat_mini', pretrained, **dict(model_args, **kwargs))


@register_model
def nat_tiny(pretrained=False, **kwargs) -> NAT:
    """NAT-Tiny (27.9M params, 4.3 GMACs @ 224)."""
    model_args = _TINY
    return _create_nat('nat_tiny', pretrained, **dict(model_args, **kwargs))


@register_model
def nat_small(pretrained=False, **kwargs) -> NAT:
    """NAT-Small (50.7M params, 7.8 GMACs @ 224), layer scale 1e-5."""
    model_args = dict(_SMALL, layer_scale=1e-5)
    return _create_nat('nat_small', pretrained, **dict(model_args, **kwargs))


@register_model
def nat_base(pretrained=False, **kwargs) -> NAT:
    """NAT-Base (89.8M params, 13.7 GMACs @ 224), layer scale 1e-5."""
    model_args = _BASE
    return _create_nat('nat_base', pretrained, **dict(model_args, **kwargs))


@register_model
def dinat_mini(pretrained=False, **kwargs) -> NAT:
    """DiNAT-Mini: NAT-Mini with dilated blocks."""
    model_args = dict(_MINI, dilations=_DINAT_MINI_DILATIONS)
    return _create_nat('dinat_mini', pretrained, **dict(model_args, **kwargs))


@register_model
def dinat_tiny(pretrained=False, **kwargs) -> NAT:
    """DiNAT-Tiny: NAT-Tiny with dilated blocks."""
    model_args = dict(_TINY, dilations=_DINAT_DILATIONS)
    return _create_nat('dinat_tiny', pretrained, **dict(model_args, **kwargs))


@register_model
def dinat_small(pretrained=False, **kwargs) -> NAT:
    """DiNAT-Small: NAT-Small with dilated blocks and, unlike NAT-Small, no layer scale."""
    model_args = dict(_SMALL, dilations=_DINAT_DILATIONS)
    return _create_nat('dinat_small', pretrained, **dict(model_args, **kwargs))


@register_model
def dinat_base(pretrained=False, **kwargs) -> NAT:
    """DiNAT-Base: NAT-Base with dilated blocks (layer scale 1e-5)."""
    model_args = dict(_BASE, dilations=_DINAT_DILATIONS)
    return _create_nat('dinat_base', pretrained, **dict(model_args, **kwargs))


@register_model
def dinat_large(pretrained=False, **kwargs) -> NAT:
    """DiNAT-Large (200.9M params, 30.5 GMACs @ 224), 224 dilation schedule."""
    model_args = dict(_LARGE, dilations=_DINAT_DILATIONS)
    return _create_nat('dinat_large', pretrained, **dict(model_args, **kwargs))


@register_model
def dinat_large_384(pretrained=False, **kwargs) -> NAT:
    """DiNAT-Large with the 384 dilation schedule (13 / 6 / 3 / 1)."""
    model_args = dict(_LARGE, dilations=_DINAT_384_DILATIONS)
    return _create_nat('dinat_large_384', pretrained, **dict(model_args, **kwargs))


@register_model
def dinat_large_11x11_384(pretrained=False, **kwargs) -> NAT:
    """DiNAT-Large with 11x11 neighborhoods at 384, dilations 8 / 4 / 2 / 1."""
    # the largest d with 11 * d <= 96 / 48 / 24 / 12: the 7x7 model's schedule at 224
    model_args = dict(_LARGE, kernel_size=11, dilations=_DINAT_DILATIONS)
    return _create_nat('dinat_large_11x11_384', pretrained, **dict(model_args, **kwargs))
