""" SAN: self-attention networks (pairwise and patchwise)

Paper: `Exploring Self-attention for Image Recognition` - https://arxiv.org/abs/2004.13621
@inproceedings{zhao2020san,
  title     = {Exploring Self-attention for Image Recognition},
  author    = {Zhao, Hengshuang and Jia, Jiaya and Koltun, Vladlen},
  booktitle = {Proceedings of the IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR)},
  year      = {2020},
}

Official code and weights: https://github.com/hszhao/SAN (MIT); the trained models are on the
Google Drive folder its README links. ``attnzoo publish`` puts them in the project's Hub repos
(``attnzoo/san10_pairwise.in1k``), which ``pretrained=True`` loads; a local copy loads with
``attnzoo convert san10_pairwise model_best.pth san10_pairwise.safetensors`` and
``timm.create_model('san10_pairwise', pretrained=True,
pretrained_cfg_overlay=dict(file='san10_pairwise.safetensors'))`` (the official ``.pth`` loads
the same way directly).

Module tree (attnzoo's model policy, :mod:`attnzoo.models`), following the paper's transitions
("batch normalization, ReLU, 2x2 max pooling with stride 2, a linear mapping"):
``stem`` (1x1 conv, BN, ReLU at full resolution) -> ``stages.{0..4}`` (``downsample``: BN + ReLU
of the previous stage (none after the stem), 2x2 max pool, 1x1 conv; then pre-activation
``blocks``) -> ``norm`` (the last BN + ReLU) -> ``head`` (global average pool, ``fc``). Stage
outputs, the feature taps, are the blocks' residual stream, NCHW. :func:`checkpoint_filter_fn`
maps the official names (``conv_in``, ``bn_in``, ``conv{i}``, ``bn{i}``, ``layer{i}.{j}``,
``fc``) onto it.

Input sizes: every stage halves the map (floor), stage ``i`` sees ``H // 2 ** (i + 1)``. The
reflection padding of a ``k x k`` footprint needs maps larger than ``(k - 1) / 2``: with the
last stage's 7x7 footprint the input must be at least 128 px on both axes (a ``ValueError``
says so below that; the official CUDA ops silently read out of bounds). Every size from there up
works, non-square too. ``padding_mode='zeros'`` lowers the minimum to 32 px (not the official
models' padding).
"""
import re
from typing import Any, Dict, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn
from timm.layers import BatchNormAct2d, DropPath, calculate_drop_path_rates
from timm.models import generate_default_cfgs

from ..layers import SAM
from ._helpers import (check_attn_drop_rate, check_state_dict, per_stage, rename_key,
                       unwrap_checkpoint)
from ._registry import register_model
from ._staged import ImageStem, Stage, StagedModel, build_staged, staged_cfg
from ._weights import hub_weights

__all__ = ["SAN", "checkpoint_filter_fn"]


class Stem(ImageStem):
    """1x1 conv (no bias), BN, ReLU, at full resolution."""

    def __init__(self, in_chans: int, out_chs: int, device=None, dtype=None):
        dd = {"device": device, "dtype": dtype}
        super().__init__(in_chans)
        self.conv = nn.Conv2d(in_chans, out_chs, 1, bias=False, **dd)
        self.norm = BatchNormAct2d(out_chs, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(self.check(x)))


class Transition(nn.Module):
    """The paper's transition: BN + ReLU (``norm``; identity after the stem, which has them),
    2x2 max pool with stride 2, 1x1 conv (no bias) to the stage's width."""

    def __init__(self, in_chs: int, out_chs: int, pre_norm: bool, device=None, dtype=None):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        self.norm = BatchNormAct2d(in_chs, **dd) if pre_norm else nn.Identity()
        self.pool = nn.MaxPool2d(2, 2)
        self.conv = nn.Conv2d(in_chs, out_chs, 1, bias=False, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pool(self.norm(x)))


class Bottleneck(nn.Module):
    """Pre-activation residual block: ``x + conv(relu(bn2(SAM(relu(bn1(x))))))``, identity
    shortcut; the SAM reduces ``dim`` to ``dim / mid_ratio`` channels, ``conv`` (1x1, bias)
    expands them back."""

    def __init__(
            self,
            dim: int,
            kernel_size: int = 7,
            sa_type: str = 'pairwise',
            relation: Optional[str] = None,
            rel_ratio: int = 16,
            mid_ratio: int = 4,
            share_planes: int = 8,
            padding_mode: str = 'reflect',
            drop_path: float = 0.,
            backend: Optional[str] = None,
            device=None, dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        mid = dim // mid_ratio
        self.norm1 = BatchNormAct2d(dim, **dd)
        self.attn = SAM(dim, dim // rel_ratio, mid, share_planes, kernel_size=kernel_size,
                        sa_type=sa_type, relation=relation, padding_mode=padding_mode,
                        backend=backend, **dd)
        self.norm2 = BatchNormAct2d(mid, **dd)
        self.conv = nn.Conv2d(mid, dim, 1, **dd)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop_path(self.conv(self.norm2(self.attn(self.norm1(x)))))


class SANStage(Stage):
    """``downsample`` (a :class:`Transition`), then ``blocks``; NCHW in and out."""

    def __init__(self, in_chs: int, dim: int, depth: int, pre_norm: bool,
                 drop_path: Sequence[float], device=None, dtype=None, **block_kwargs):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        self.downsample = Transition(in_chs, dim, pre_norm, **dd)
        self.blocks = nn.Sequential(*[
            Bottleneck(dim, drop_path=drop_path[j], **block_kwargs, **dd) for j in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_blocks(self.downsample(x))


def min_input_size(kernel_sizes: Sequence[int], padding_mode: str) -> int:
    """The smallest input side every stage can run on: stage ``i`` sees ``H // 2 ** (i + 1)``
    pixels, which reflection padding by ``(k - 1) / 2`` needs to exceed."""
    return max((((k - 1) // 2 + 1) if padding_mode == 'reflect' else 1) * 2 ** (i + 1)
               for i, k in enumerate(kernel_sizes))


class SAN(StagedModel):
    """Self-attention network (SAN10 / 15 / 19, pairwise or patchwise).

    Args (besides ``in_chans``, ``num_classes``, ``global_pool``, ``drop_rate``: see
    :class:`~attnzoo.models._staged.StagedModel`):
        sa_type: ``'pairwise'`` or ``'patchwise'``.
        depths: blocks per stage.
        widths: channels per stage.
        kernel_sizes: footprint per stage (int or one per stage).
        stem_width: stem channels.
        relation: the SAM's relation function (:mod:`attnzoo.layers.san`); ``None``: the
            paper's (pairwise subtraction, patchwise concatenation).
        rel_ratio: ``r1``: ``phi`` / ``psi`` have ``width / r1`` channels.
        mid_ratio: ``r2``: ``beta`` and the aggregation have ``width / r2`` channels.
        share_planes: channels sharing one attention weight.
        padding_mode: ``'reflect'`` (official; inputs >= 128 px) or ``'zeros'``.
        drop_path_rate: stochastic depth, linear from 0 over all blocks (official: none).
        attn_drop_rate: attention-weight dropout, timm's argument: must be 0 (the op fuses the
            weighting; a nonzero rate raises ``ValueError``).
        backend: backend of the SAN ops for every layer (``None``: follow
            :mod:`attnzoo.backends`).
    """

    def __init__(
            self,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'avg',
            sa_type: str = 'pairwise',
            depths: Tuple[int, ...] = (2, 1, 2, 4, 1),
            widths: Tuple[int, ...] = (64, 256, 512, 1024, 2048),
            kernel_sizes: Union[int, Sequence[int]] = (3, 7, 7, 7, 7),
            stem_width: int = 64,
            relation: Optional[str] = None,
            rel_ratio: int = 16,
            mid_ratio: int = 4,
            share_planes: int = 8,
            padding_mode: str = 'reflect',
            drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            attn_drop_rate: float = 0.,
            backend: Optional[str] = None,
            device=None, dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        check_attn_drop_rate(attn_drop_rate, "SAN",
                             "its aggregation op fuses the weighting with the footprint sum")
        num_stages = len(depths)
        widths = per_stage(widths, num_stages, "widths")
        kernel_sizes = per_stage(kernel_sizes, num_stages, "kernel_sizes")

        stem = Stem(in_chans, stem_width, **dd)
        dpr = calculate_drop_path_rates(drop_path_rate, list(depths), stagewise=True)
        feature_info, stages = [], []
        in_chs = stem_width
        for i in range(num_stages):
            stages.append(SANStage(
                in_chs, widths[i], depths[i], pre_norm=i > 0, drop_path=dpr[i],
                kernel_size=kernel_sizes[i], sa_type=sa_type, relation=relation,
                rel_ratio=rel_ratio, mid_ratio=mid_ratio, share_planes=share_planes,
                padding_mode=padding_mode, backend=backend, **dd))
            feature_info.append(
                dict(num_chs=widths[i], reduction=2 ** (i + 1), module=f'stages.{i}'))
            in_chs = widths[i]
        super().__init__(
            stem=stem, stages=stages, norm=BatchNormAct2d(in_chs, **dd),
            feature_info=feature_info, in_chans=in_chans,
            min_size=min_input_size(kernel_sizes, padding_mode), num_classes=num_classes,
            global_pool=global_pool, drop_rate=drop_rate)
        # for use_stages
        self.kernel_sizes = kernel_sizes
        self.padding_mode = padding_mode
        self.use_stages(num_stages)
        # Official init: PyTorch's defaults everywhere (nothing to do).

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return set()  # the official recipe decays every parameter

    def use_stages(self, n: int) -> None:
        # Fewer stages, a smaller footprint at the last one: a smaller minimum input.
        kernel_sizes = self.kernel_sizes[:n]
        hint = ''
        if self.padding_mode == 'reflect':
            hint = (f"; padding_mode='zeros' (timm.create_model(..., padding_mode='zeros')) "
                    f"lowers it to {min_input_size(kernel_sizes, 'zeros')} px, but is not the "
                    "official models' padding")
        self.set_min_size(min_input_size(kernel_sizes, self.padding_mode), hint)


# --------------------------------------------------------------------------------------------
# checkpoint conversion
# --------------------------------------------------------------------------------------------

# The official names (hszhao/SAN model/san.py) -> ours: (pattern, replacement) on whole keys.
# bn{i} closes stage i in the official forward; here it opens stage i + 1's transition, and
# the last one is the final norm (``_official_to_timm`` handles both).
_OFFICIAL_MAP = (
    (r'^conv_in\.', 'stem.conv.'),
    (r'^bn_in\.', 'stem.norm.'),
    (r'^conv(\d+)\.', r'stages.\1.downsample.conv.'),
    (r'^layer(\d+)\.(\d+)\.bn1\.', r'stages.\1.blocks.\2.norm1.'),
    (r'^layer(\d+)\.(\d+)\.sam\.', r'stages.\1.blocks.\2.attn.'),
    (r'^layer(\d+)\.(\d+)\.bn2\.', r'stages.\1.blocks.\2.norm2.'),
    (r'^layer(\d+)\.(\d+)\.conv\.', r'stages.\1.blocks.\2.conv.'),
    (r'^fc\.', 'head.fc.'),
)


def _official_to_timm(state_dict: Dict[str, torch.Tensor],
                      num_stages: int) -> Dict[str, torch.Tensor]:
    out = {}
    for k, v in state_dict.items():
        m = re.match(r'^bn(\d+)\.(.+)$', k)
        if m:
            i = int(m.group(1))
            k = f'norm.{m.group(2)}' if i == num_stages - 1 else \
                f'stages.{i + 1}.downsample.norm.{m.group(2)}'
        else:
            k = rename_key(k, _OFFICIAL_MAP)
        out[k] = v
    return out


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: SAN) -> Dict[str, torch.Tensor]:
    """Map a SAN checkpoint onto ``model``'s state dict.

    Accepts ours and the official training code's (``{'epoch', 'state_dict': {'module.' + key}
    , 'optimizer', ...}`` as ``tool/train.py`` saves it, or the bare / unprefixed state dict).
    Raises ``ValueError`` listing every key that is missing, unexpected or of the wrong shape
    (e.g. a pairwise checkpoint for a patchwise model); the classifier and the stem's input
    channels are left for timm to adapt (``num_classes`` / ``in_chans``).
    """
    state_dict = unwrap_checkpoint(state_dict)
    if any(k.startswith(('conv_in.', 'layer0.')) for k in state_dict):
        state_dict = _official_to_timm(state_dict, len(model.stages))
    return check_state_dict(state_dict, model, adaptable=('head.fc.',), first_conv='stem.conv')


# --------------------------------------------------------------------------------------------
# model creation, pretrained configs, entrypoints
# --------------------------------------------------------------------------------------------

def _create_san(variant: str, pretrained: bool = False, **kwargs) -> SAN:
    return build_staged(SAN, variant, pretrained, len(kwargs.get('depths', (0,) * 5)),
                        checkpoint_filter_fn, **kwargs)


# The official checkpoints are on the Google Drive folder origin_url's README links; `attnzoo
# publish` converts them into the project's Hub repos (_weights), which pretrained=True loads
# once published.
_CFG = staged_cfg(
    # reflection padding in the last stage (7x7, pad 3) needs a 4x4 map
    min_input_size=(3, 128, 128), interpolation='bilinear', license='mit',
    paper_ids='arXiv:2004.13621', paper_name='Exploring Self-attention for Image Recognition',
    origin_url='https://github.com/hszhao/SAN')


default_cfgs = generate_default_cfgs({
    tag: dict(_CFG, **hub_weights(tag))
    for tag in (f'san{n}_{t}.in1k' for n in (10, 15, 19) for t in ('pairwise', 'patchwise'))
})

_DEPTHS = {10: (2, 1, 2, 4, 1), 15: (3, 2, 3, 5, 2), 19: (3, 3, 4, 6, 3)}


@register_model
def san10_pairwise(pretrained=False, **kwargs) -> SAN:
    """SAN10, pairwise (subtraction): 10.5M params, 2.2 GMACs (official counter), 74.9% top-1."""
    model_args = dict(depths=_DEPTHS[10], sa_type='pairwise')
    return _create_san('san10_pairwise', pretrained, **dict(model_args, **kwargs))


@register_model
def san10_patchwise(pretrained=False, **kwargs) -> SAN:
    """SAN10, patchwise (concatenation): 11.8M params, 1.9 GMACs, 77.1% top-1."""
    model_args = dict(depths=_DEPTHS[10], sa_type='patchwise')
    return _create_san('san10_patchwise', pretrained, **dict(model_args, **kwargs))


@register_model
def san15_pairwise(pretrained=False, **kwargs) -> SAN:
    """SAN15, pairwise attention: 14.1M params, 3.0 GMACs, 76.6% top-1."""
    model_args = dict(depths=_DEPTHS[15], sa_type='pairwise')
    return _create_san('san15_pairwise', pretrained, **dict(model_args, **kwargs))


@register_model
def san15_patchwise(pretrained=False, **kwargs) -> SAN:
    """SAN15, patchwise attention: 16.2M params, 2.6 GMACs, 78.0% top-1."""
    model_args = dict(depths=_DEPTHS[15], sa_type='patchwise')
    return _create_san('san15_patchwise', pretrained, **dict(model_args, **kwargs))


@register_model
def san19_pairwise(pretrained=False, **kwargs) -> SAN:
    """SAN19, pairwise attention: 17.6M params, 3.8 GMACs, 76.9% top-1."""
    model_args = dict(depths=_DEPTHS[19], sa_type='pairwise')
    return _create_san('san19_pairwise', pretrained, **dict(model_args, **kwargs))


@register_model
def san19_patchwise(pretrained=False, **kwargs) -> SAN:
    """SAN19, patchwise attention: 20.5M params, 3.3 GMACs, 78.2% top-1."""
    model_args = dict(depths=_DEPTHS[19], sa_type='patchwise')
    return _create_san('san19_patchwise', pretrained, **dict(model_args, **kwargs))
