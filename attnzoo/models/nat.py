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
Hub in the `transformers` layout (``shi-labs/nat-*`` / ``shi-labs/dinat-*``, MIT license); the
checkpoint filter below maps them (and the official ``.pth`` layout) onto this model, whose
state_dict keys are those of the official code.

Layout: the stem and levels run on NHWC tensors; ``forward_features`` returns the final,
normalised, UNPOOLED NHWC map (``model.output_fmt == 'NHWC'``, as timm's Swin);
``forward_head`` pools it. ``forward_intermediates`` / ``features_only`` return NCHW maps taken
after each level's blocks, before its downsampler.

Input sizes: any ``H, W >= 1``. Each stride-2 conv gives ``ceil(H / 2)``, so level ``i`` sees
``ceil(H / 2 ** (i + 2))``; where a level is smaller than ``kernel_size * dilation`` the attention
zero-pads its normalised input right/bottom up to that size and crops the result (the official
runtime's rule), so official weights give official outputs at every size.
"""
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    DropPath,
    Mlp,
    SelectAdaptivePool2d,
    calculate_drop_path_rates,
    get_device_dtype,
    trunc_normal_,
)
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models import register_notrace_function
from timm.models._features import feature_take_indices
from timm.models._manipulate import checkpoint_seq

from ..layers import NeighborhoodAttention2d

__all__ = ["NAT", "checkpoint_filter_fn"]

# Official LayerNorm eps (PyTorch's default; timm's LayerNorm defaults to 1e-6).
_LN_EPS = 1e-5


@register_notrace_function
def check_image_input(x: torch.Tensor, in_chans: int) -> torch.Tensor:
    """Reject non-image input with a clear error (a plain function: FX keeps it as a leaf)."""
    if x.dim() != 4:
        raise ValueError(f"NAT expects a 4-D NCHW image batch [B, in_chans, H, W], got a "
                         f"{x.dim()}-D tensor of shape {list(x.shape)}")
    if x.shape[1] != in_chans:
        raise ValueError(f"NAT was built with in_chans={in_chans} but the input has "
                         f"{x.shape[1]} channels (shape {list(x.shape)}); pass in_chans= "
                         f"to create_model to change it")
    return x


class ConvTokenizer(nn.Module):
    """Stem: two overlapping 3x3 stride-2 convs (no activation between), LayerNorm on NHWC."""

    def __init__(self, in_chans: int = 3, embed_dim: int = 64, device=None, dtype=None):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        self.proj = nn.Sequential(
            nn.Conv2d(in_chans, embed_dim // 2, kernel_size=3, stride=2, padding=1, **dd),
            nn.Conv2d(embed_dim // 2, embed_dim, kernel_size=3, stride=2, padding=1, **dd),
        )
        self.norm = nn.LayerNorm(embed_dim, eps=_LN_EPS, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).permute(0, 2, 3, 1))  # NCHW -> NHWC


class ConvDownsampler(nn.Module):
    """Between levels: overlapping 3x3 stride-2 conv (no bias) doubling channels, LayerNorm."""

    def __init__(self, dim: int, out_dim: Optional[int] = None, device=None, dtype=None):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        out_dim = out_dim or 2 * dim
        self.reduction = nn.Conv2d(dim, out_dim, kernel_size=3, stride=2, padding=1, bias=False,
                                   **dd)
        self.norm = nn.LayerNorm(out_dim, eps=_LN_EPS, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.reduction(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        return self.norm(x)


class NATBlock(nn.Module):
    """Pre-norm transformer block with neighborhood attention; optional layer scale."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            kernel_size: int = 7,
            dilation: int = 1,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            rel_pos_bias: bool = True,
            proj_drop: float = 0.,
            attn_drop: float = 0.,
            drop_path: float = 0.,
            layer_scale: Optional[float] = None,
            backend: Optional[str] = None,
            device=None,
            dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=_LN_EPS, **dd)
        self.attn = NeighborhoodAttention2d(
            dim, num_heads, kernel_size=kernel_size, dilation=dilation, qkv_bias=qkv_bias,
            rel_pos_bias=rel_pos_bias, attn_drop=attn_drop, proj_drop=proj_drop, backend=backend,
            **dd)
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=_LN_EPS, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop, **dd)
        # gamma1/gamma2 are plain [dim] parameters (official key names), only with layer scale.
        if layer_scale is not None:
            self.gamma1 = nn.Parameter(torch.full((dim,), float(layer_scale), **dd))
            self.gamma2 = nn.Parameter(torch.full((dim,), float(layer_scale), **dd))
        else:
            self.register_parameter('gamma1', None)
            self.register_parameter('gamma2', None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gamma1 is not None and self.gamma2 is not None:
            x = x + self.drop_path(self.gamma1 * self.attn(self.norm1(x)))
            x = x + self.drop_path(self.gamma2 * self.mlp(self.norm2(x)))
        else:
            x = x + self.drop_path(self.attn(self.norm1(x)))
            x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


class NATLevel(nn.Module):
    """A level: ``blocks`` at one resolution, then (all but the last level) ``downsample``."""

    def __init__(
            self,
            dim: int,
            depth: int,
            num_heads: int,
            kernel_size: int,
            dilations: Sequence[int],
            downsample: bool,
            mlp_ratio: float,
            qkv_bias: bool,
            rel_pos_bias: bool,
            proj_drop: float,
            attn_drop: float,
            drop_path: Sequence[float],
            layer_scale: Optional[float],
            backend: Optional[str],
            device=None,
            dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        self.grad_checkpointing = False
        self.blocks = nn.Sequential(*[
            NATBlock(
                dim, num_heads, kernel_size=kernel_size, dilation=dilations[j],
                mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, rel_pos_bias=rel_pos_bias,
                proj_drop=proj_drop, attn_drop=attn_drop, drop_path=drop_path[j],
                layer_scale=layer_scale, backend=backend, **dd)
            for j in range(depth)])
        self.downsample = ConvDownsampler(dim, 2 * dim, **dd) if downsample else nn.Identity()

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.blocks, x)
        return self.blocks(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.forward_blocks(x))


def _per_level(value: Any, num_levels: int, name: str) -> List[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != num_levels:
            raise ValueError(f"{name} needs one entry per level ({num_levels}), got {value!r}")
        return list(value)
    return [value] * num_levels


class NAT(nn.Module):
    """Neighborhood Attention Transformer; with per-block ``dilations`` it is DiNAT.

    Args:
        in_chans: input image channels.
        num_classes: classifier outputs (0: no classifier, ``forward`` returns pooled features).
        global_pool: ``'avg'`` (official), any timm ``SelectAdaptivePool2d`` type, or ``''``.
        embed_dim: channels of level 0; level ``i`` has ``embed_dim * 2 ** i``.
        depths: blocks per level.
        num_heads: heads per level.
        kernel_size: neighborhood size, one int or one per level.
        dilations: ``None`` (NAT: all 1), or per level an int or a list with one per block (DiNAT).
        mlp_ratio: MLP hidden width / dim.
        qkv_bias: bias on the fused qkv projection.
        rel_pos_bias: learn relative positional biases ``rpb``.
        drop_rate: dropout before the classifier.
        proj_drop_rate: dropout after attention / MLP projections.
        attn_drop_rate: attention-weight dropout (unsupported by the NA op: must be 0).
        drop_path_rate: stochastic depth, linear from 0 over all blocks.
        layer_scale: initial value of gamma1/gamma2 (``None``: no layer scale).
        backend: NA backend for every layer (``None``: follow :mod:`attnzoo.backends`).
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
            device=None,
            dtype=None,
    ):
        dd = {"device": device, "dtype": dtype}
        super().__init__()
        num_levels = len(depths)
        if len(num_heads) != num_levels:
            raise ValueError(
                f"num_heads needs one entry per level ({num_levels}), got {num_heads!r}")
        kernel_sizes = _per_level(kernel_size, num_levels, "kernel_size")
        dilations = _per_level(1 if dilations is None else dilations, num_levels, "dilations")
        for i, (d, depth) in enumerate(zip(dilations, depths)):
            dilations[i] = _per_level(d, depth, f"dilations[{i}]")
        self.num_classes = num_classes
        self.global_pool = global_pool  # replaced by the pooling module below
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.output_fmt = 'NHWC'
        self.grad_checkpointing = False

        self.patch_embed = ConvTokenizer(in_chans, embed_dim, **dd)
        dpr = calculate_drop_path_rates(drop_path_rate, list(depths), stagewise=False)
        self.feature_info = []
        levels = []
        dim, block = embed_dim, 0
        for i in range(num_levels):
            levels.append(NATLevel(
                dim, depths[i], num_heads[i], kernel_size=kernel_sizes[i], dilations=dilations[i],
                downsample=i < num_levels - 1, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                rel_pos_bias=rel_pos_bias, proj_drop=proj_drop_rate, attn_drop=attn_drop_rate,
                drop_path=dpr[block:block + depths[i]], layer_scale=layer_scale, backend=backend,
                **dd))
            # Taps are the blocks' output, before the level's downsampler.
            self.feature_info.append(dict(num_chs=dim, reduction=4 * 2 ** i, module=f'levels.{i}'))
            block += depths[i]
            if i < num_levels - 1:
                dim *= 2
        self.levels = nn.Sequential(*levels)
        self.num_features = self.head_hidden_size = dim
        self.norm = nn.LayerNorm(dim, eps=_LN_EPS, **dd)

        # Pooling and classifier are separate modules so the Linear keeps the official key
        # ``head.{weight,bias}`` (timm's ClassifierHead would name it ``head.fc``).
        self.global_pool = SelectAdaptivePool2d(
            pool_type=global_pool, flatten=bool(global_pool), input_fmt=self.output_fmt)
        self.head_hidden_size = self.num_features * self.global_pool.feat_mult()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.head_hidden_size, num_classes, **dd) \
            if num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Official init: Linear trunc_normal(.02) / zero bias, LayerNorm 1 / 0, convs default.
        if isinstance(module, nn.Linear):
            trunc_normal_(module.weight, std=.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {n for n, _ in self.named_parameters() if n.endswith('.rpb')}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r'^patch_embed',
            blocks=r'^levels\.(\d+)' if coarse else [
                # a level's downsampler runs after its blocks
                (r'^levels\.(\d+)\.downsample', (99998,)),
                (r'^levels\.(\d+)\.blocks\.(\d+)', None),
                (r'^norm', (99999,)),
            ],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable
        for level in self.levels:
            level.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        dd = get_device_dtype(self)
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = SelectAdaptivePool2d(
                pool_type=global_pool, flatten=bool(global_pool), input_fmt=self.output_fmt)
        self.head_hidden_size = self.num_features * self.global_pool.feat_mult()
        self.head = nn.Linear(self.head_hidden_size, num_classes, **dd) \
            if num_classes > 0 else nn.Identity()
        # new modules start in train mode: keep the model's mode
        self.global_pool.train(self.training)
        self.head.train(self.training)

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Forward returning each level's blocks output (before its downsampler).

        Args:
            x: input images, NCHW.
            indices: take the last n levels if int, all if None, or these levels.
            norm: apply the final norm to the last level's intermediate.
            stop_early: stop after the last level needed.
            output_fmt: 'NCHW' or 'NHWC' intermediates.
            intermediates_only: return only the intermediates.

        Returns:
            intermediates, or (final features as forward_features, intermediates).
        """
        assert output_fmt in ('NCHW', 'NHWC'), 'Output format must be NCHW or NHWC.'
        intermediates = []
        take_indices, max_index = feature_take_indices(len(self.levels), indices)
        x = check_image_input(x, self.in_chans)
        x = self.patch_embed(x)

        num_levels = len(self.levels)
        if torch.jit.is_scripting() or not stop_early:  # can't slice modules in torchscript
            levels = self.levels
            last = num_levels - 1
        else:
            levels = self.levels[:max_index + 1]
            last = max_index
        i = 0
        for i, level in enumerate(levels):
            x = level.forward_blocks(x)
            if i in take_indices:
                x_inter = self.norm(x) if norm and i == num_levels - 1 else x
                if output_fmt == 'NCHW':
                    x_inter = x_inter.permute(0, 3, 1, 2).contiguous()
                intermediates.append(x_inter)
            if i < last:
                x = level.downsample(x)

        if intermediates_only:
            return intermediates
        if i == num_levels - 1:
            x = self.norm(x)  # the final norm is sized for the last level only
        return x, intermediates

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the levels (and norm / head) not needed for the intermediates ``indices``."""
        take_indices, max_index = feature_take_indices(len(self.levels), indices)
        prune_end = max_index < len(self.levels) - 1
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        self.levels = self.levels[:max_index + 1]
        if prune_end:
            # features now end at the last tap: its downsampler would feed a removed level
            self.levels[-1].downsample = nn.Identity()
            self.num_features = self.head_hidden_size = self.feature_info[max_index]['num_chs']
        if prune_head or prune_end:
            self.reset_classifier(0, '')
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Final normalised feature map, NHWC and unpooled."""
        x = check_image_input(x, self.in_chans)
        x = self.patch_embed(x)
        x = self.levels(x)
        x = self.norm(x)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pool the NHWC map over H, W (official: mean), dropout, classifier."""
        x = self.global_pool(x)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(x)
        x = self.forward_head(x)
        return x


# --------------------------------------------------------------------------------------------
# checkpoint conversion
# --------------------------------------------------------------------------------------------

_HF_PREFIXES = ('nat.', 'dinat.')
# transformers' per-layer names -> official names (``attention.self.{query,key,value}`` are
# concatenated into ``attn.qkv`` and ``layer_scale_parameters`` split into gamma1/gamma2 below).
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


def _is_hf_layout(state_dict: Dict[str, Any]) -> bool:
    return any(k.startswith(_HF_PREFIXES + ('embeddings.', 'encoder.levels.')) for k in state_dict)


def _convert_hf(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers' NatForImageClassification / DinatForImageClassification layout -> official."""
    out: Dict[str, torch.Tensor] = {}
    qkv: Dict[str, Dict[str, torch.Tensor]] = {}
    for k, v in state_dict.items():
        for prefix in _HF_PREFIXES:
            if k.startswith(prefix):
                k = k[len(prefix):]
                break
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
                for src, dst in _HF_LAYER_MAP:
                    if name.startswith(src):
                        name = dst + name[len(src):]
                        break
                k = block + name
        else:
            for src, dst in _HF_TOP_MAP:
                if k.startswith(src):
                    k = dst + k[len(src):]
                    break
        out[k] = v
    for k, parts in qkv.items():
        missing = [p for p in ('query', 'key', 'value') if p not in parts]
        if missing:
            raise ValueError(f"transformers checkpoint lacks attention.self.{{{','.join(missing)}}}"
                             f" for {k} (query, key and value are needed to build qkv)")
        out[k] = torch.cat([parts['query'], parts['key'], parts['value']], dim=0)
    return out


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: NAT) -> Dict[str, torch.Tensor]:
    """Map a NAT / DiNAT checkpoint onto ``model``'s state_dict keys.

    Accepts the official raw state_dict, a ``{'state_dict': ...}`` / ``{'model': ...}`` wrapper,
    ``module.`` (DDP) prefixes, and the Hugging Face transformers layout of the ``shi-labs`` Hub
    repos. Raises ``ValueError`` listing every key that is missing, unexpected or of the wrong
    shape. The classifier (``head.*``) and the first conv's input channels are left for timm's
    ``load_pretrained`` to adapt (num_classes / in_chans changes) and are not checked here.
    """
    for wrapper in ('state_dict', 'model', 'model_state'):
        if isinstance(state_dict.get(wrapper, None), dict):
            state_dict = state_dict[wrapper]
    state_dict = {k[len('module.'):] if k.startswith('module.') else k: v
                  for k, v in state_dict.items()}
    if _is_hf_layout(state_dict):
        state_dict = _convert_hf(state_dict)

    expected = model.state_dict()
    adaptable = lambda k: k.startswith('head.')  # noqa: E731
    first_conv = 'patch_embed.proj.0.weight'
    missing = sorted(k for k in expected if k not in state_dict and not adaptable(k))
    unexpected = sorted(k for k in state_dict if k not in expected and not adaptable(k))
    mismatched = []
    for k, v in state_dict.items():
        if k not in expected or adaptable(k):
            continue
        want = tuple(expected[k].shape)
        have = tuple(v.shape)
        if have == want:
            continue
        if k == first_conv and len(have) == 4 and have[:1] + have[2:] == want[:1] + want[2:]:
            continue  # in_chans differs: timm's load_pretrained adapts the stem conv
        mismatched.append(f"{k}: checkpoint {have} vs model {want}")
    if missing or unexpected or mismatched:
        lines = []
        if missing:
            lines.append(f"missing from the checkpoint ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"not in the model ({len(unexpected)}): {', '.join(unexpected)}")
        if mismatched:
            lines.append(f"shape mismatch ({len(mismatched)}): {'; '.join(mismatched)}")
        raise ValueError(f"checkpoint does not match {type(model).__name__} "
                         "(wrong variant, kernel size or depth?):\n  " + "\n  ".join(lines))
    return state_dict


# --------------------------------------------------------------------------------------------
# model creation, pretrained configs, registration
# --------------------------------------------------------------------------------------------

def _create_nat(variant: str, pretrained: bool, model_args: Dict[str, Any], **kwargs) -> NAT:
    kwargs = dict(model_args, **kwargs)  # the caller's kwargs override the variant's config
    out_indices = kwargs.pop('out_indices', tuple(range(len(kwargs.get('depths', (3, 4, 6, 5))))))
    # features_only uses forward_intermediates (FeatureGetterNet): the taps sit inside a level
    # (before its downsampler), which module-hook / flattened-Sequential extractors cannot reach.
    return build_model_with_cfg(
        NAT, variant, pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(feature_cls='getter', out_indices=out_indices),
        **kwargs)


def _cfg(hf_hub_id: str = '', **kwargs) -> Dict[str, Any]:
    return {
        'hf_hub_id': hf_hub_id,
        # transformers-layout weights; timm tries model.safetensors first, then this file
        'hf_hub_filename': 'pytorch_model.bin',
        'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': (7, 7),
        'crop_pct': 0.875, 'interpolation': 'bicubic', 'fixed_input_size': False,
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.proj.0', 'classifier': 'head',
        'license': 'mit',
        **kwargs,
    }


_NAT_PAPER = dict(paper_ids='arXiv:2204.07143', paper_name='Neighborhood Attention Transformer',
                  origin_url='https://github.com/SHI-Labs/Neighborhood-Attention-Transformer')
_DINAT_PAPER = dict(paper_ids='arXiv:2209.15001',
                    paper_name='Dilated Neighborhood Attention Transformer',
                    origin_url='https://github.com/SHI-Labs/Neighborhood-Attention-Transformer')

default_cfgs = generate_default_cfgs({
    'nat_mini.in1k': _cfg(hf_hub_id='shi-labs/nat-mini-in1k-224', **_NAT_PAPER),
    'nat_tiny.in1k': _cfg(hf_hub_id='shi-labs/nat-tiny-in1k-224', **_NAT_PAPER),
    'nat_small.in1k': _cfg(hf_hub_id='shi-labs/nat-small-in1k-224', **_NAT_PAPER),
    'nat_base.in1k': _cfg(hf_hub_id='shi-labs/nat-base-in1k-224', **_NAT_PAPER),
    'dinat_mini.in1k': _cfg(hf_hub_id='shi-labs/dinat-mini-in1k-224', **_DINAT_PAPER),
    'dinat_tiny.in1k': _cfg(hf_hub_id='shi-labs/dinat-tiny-in1k-224', **_DINAT_PAPER),
    'dinat_small.in1k': _cfg(hf_hub_id='shi-labs/dinat-small-in1k-224', **_DINAT_PAPER),
    'dinat_base.in1k': _cfg(hf_hub_id='shi-labs/dinat-base-in1k-224', **_DINAT_PAPER),
    'dinat_large.in22k_ft_in1k': _cfg(
        hf_hub_id='shi-labs/dinat-large-in22k-in1k-224', **_DINAT_PAPER),
    # 384 fine-tunes: their own dilation schedule / kernel, so their own model names; evaluated
    # on the full 384 image (timm's convention for fine-tuned 384 weights).
    'dinat_large_384.in22k_ft_in1k': _cfg(
        hf_hub_id='shi-labs/dinat-large-in22k-in1k-384',
        input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0, **_DINAT_PAPER),
    'dinat_large_11x11_384.in22k_ft_in1k': _cfg(
        hf_hub_id='shi-labs/dinat-large-11x11-in22k-in1k-384',
        input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0, **_DINAT_PAPER),
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
def nat_mini(pretrained: bool = False, **kwargs) -> NAT:
    """NAT-Mini (20.0M params, 2.7 GMACs @ 224)."""
    return _create_nat('nat_mini', pretrained, _MINI, **kwargs)


@register_model
def nat_tiny(pretrained: bool = False, **kwargs) -> NAT:
    """NAT-Tiny (27.9M params, 4.3 GMACs @ 224)."""
    return _create_nat('nat_tiny', pretrained, _TINY, **kwargs)


@register_model
def nat_small(pretrained: bool = False, **kwargs) -> NAT:
    """NAT-Small (50.7M params, 7.8 GMACs @ 224), layer scale 1e-5."""
    return _create_nat('nat_small', pretrained,
                       dict(_SMALL, layer_scale=1e-5), **kwargs)


@register_model
def nat_base(pretrained: bool = False, **kwargs) -> NAT:
    """NAT-Base (89.8M params, 13.7 GMACs @ 224), layer scale 1e-5."""
    return _create_nat('nat_base', pretrained, _BASE, **kwargs)


@register_model
def dinat_mini(pretrained: bool = False, **kwargs) -> NAT:
    """DiNAT-Mini: NAT-Mini with dilated blocks."""
    return _create_nat('dinat_mini', pretrained,
                       dict(_MINI, dilations=_DINAT_MINI_DILATIONS), **kwargs)


@register_model
def dinat_tiny(pretrained: bool = False, **kwargs) -> NAT:
    """DiNAT-Tiny: NAT-Tiny with dilated blocks."""
    return _create_nat('dinat_tiny', pretrained,
                       dict(_TINY, dilations=_DINAT_DILATIONS), **kwargs)


@register_model
def dinat_small(pretrained: bool = False, **kwargs) -> NAT:
    """DiNAT-Small: NAT-Small with dilated blocks and, unlike NAT-Small, no layer scale."""
    return _create_nat('dinat_small', pretrained,
                       dict(_SMALL, dilations=_DINAT_DILATIONS), **kwargs)


@register_model
def dinat_base(pretrained: bool = False, **kwargs) -> NAT:
    """DiNAT-Base: NAT-Base with dilated blocks (layer scale 1e-5)."""
    return _create_nat('dinat_base', pretrained,
                       dict(_BASE, dilations=_DINAT_DILATIONS), **kwargs)


@register_model
def dinat_large(pretrained: bool = False, **kwargs) -> NAT:
    """DiNAT-Large (200.9M params, 30.5 GMACs @ 224), 224 dilation schedule."""
    return _create_nat('dinat_large', pretrained,
                       dict(_LARGE, dilations=_DINAT_DILATIONS), **kwargs)


@register_model
def dinat_large_384(pretrained: bool = False, **kwargs) -> NAT:
    """DiNAT-Large with the 384 dilation schedule (13 / 6 / 3 / 1)."""
    return _create_nat('dinat_large_384', pretrained,
                       dict(_LARGE, dilations=_DINAT_384_DILATIONS), **kwargs)


@register_model
def dinat_large_11x11_384(pretrained: bool = False, **kwargs) -> NAT:
    """DiNAT-Large with 11x11 neighborhoods at 384: dilations 8 / 4 / 2 / 1, the largest with
    11 * d <= 96 / 48 / 24 / 12 (the same schedule as the 7x7 model at 224)."""
    return _create_nat('dinat_large_11x11_384', pretrained,
                       dict(_LARGE, kernel_size=11, dilations=_DINAT_DILATIONS), **kwargs)
