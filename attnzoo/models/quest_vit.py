""" QUEST-ViT: Vision Transformers with Query-modulated Spherical Attention

Paper:
* `QUEST: A robust attention formulation using Query-modulated spherical attention`
  - https://arxiv.org/abs/2604.00199
@article{govindarajan2026quest,
  title   = {QUEST: A robust attention formulation using Query-modulated spherical attention},
  author  = {Hariprasath Govindarajan and Per Sid{\'e}n and Jacob Roll and Fredrik Lindsten},
  journal = {arXiv preprint arXiv:2604.00199},
  year    = {2026},
}

A QUEST ViT *is* timm's ``VisionTransformer``: the only change is its ``attn_layer``,
:class:`attnzoo.layers.QuestAttention` (keys L2-normalised per head, queries untouched, scale 1).
Each variant is built exactly like its plain timm counterpart, so the state dict is key- and
shape-identical to it (``quest_vit_*`` <-> ``deit_*`` / ``vit_large_patch16_224``,
``quest_deit3_*`` <-> ``deit3_*``), and everything timm's ViT offers works unchanged
(``dynamic_img_size=True`` for any input size, ``global_pool``, ``forward_intermediates``,
features, gradient checkpointing). ``attn_layer='qnorm' | 'qknorm' | 'standard'`` builds the
paper's compared formulations on the same ViT.

Weights: no QUEST weights have been published, so the cfgs claim none and ``pretrained=True``
raises. A standard ViT / DeiT / DeiT-3 checkpoint loads as an *initialisation* (its attention
logits change, so its accuracy does not carry over: fine-tune it)::

    model = attnzoo.models.quest_vit.from_timm_weights('quest_deit3_base_patch16_224')
    # or any timm tag of the counterpart, e.g. 'deit3_base_patch16_224.fb_in22k_ft_in1k', or a
    # local file: timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=PATH))

Drop path: the paper trains with the DeiT / DeiT-3 recipes and gives no rate, so the variants
keep timm's default of 0 like their counterparts; set it with ``drop_path_rate`` /
``--drop-path`` for training.
"""
import math
from typing import Any, Dict, Optional, Tuple

import torch
import timm
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import PatchEmbed
from timm.models import generate_default_cfgs, register_notrace_function
import timm.models.vision_transformer as timm_vit
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as _vit_checkpoint_filter_fn

from ..layers.quest import FORMULATIONS, attn_layer_for
from ._helpers import (build_model, check_image_input, check_indices, check_state_dict,
                       unwrap_checkpoint)
from ._registry import register_model

__all__ = ["checkpoint_filter_fn", "from_timm_weights", "TIMM_COUNTERPARTS"]

# Each QUEST variant's plain timm architecture: same config, same state dict.
TIMM_COUNTERPARTS = {
    'quest_vit_tiny_patch16_224': 'deit_tiny_patch16_224',
    'quest_vit_small_patch16_224': 'deit_small_patch16_224',
    'quest_vit_base_patch16_224': 'deit_base_patch16_224',
    'quest_vit_large_patch16_224': 'vit_large_patch16_224',  # timm has no deit_large
    'quest_deit3_base_patch16_224': 'deit3_base_patch16_224',
    'quest_deit3_large_patch16_224': 'deit3_large_patch16_224',
    'quest_deit3_huge_patch14_224': 'deit3_huge_patch14_224',
}

# The weight-source fields of a timm tag's cfg, and what goes with those weights (their
# classifier and input normalisation), copied onto a QUEST cfg by from_timm_weights.
_WEIGHT_FIELDS = ('url', 'file', 'state_dict', 'hf_hub_id', 'hf_hub_filename', 'source',
                  'custom_load', 'num_classes', 'label_offset', 'mean', 'std')


def checkpoint_filter_fn(state_dict: Dict[str, Any], model: VisionTransformer) -> Dict[str, Any]:
    """timm's ViT filter (DeiT-3 ``gamma_1/2`` -> ``ls1/2.gamma``, position-embedding and patch
    resampling, foreign ViT layouts), then a check naming every key or shape that does not match
    ``model``; the classifier and the patch embedding's input channels are left for timm to
    adapt (``num_classes`` / ``in_chans``). A ``qknorm`` model's ``logit_scale``, which standard
    checkpoints lack, keeps its initial value."""
    state_dict = unwrap_checkpoint(state_dict)
    pos_embed = state_dict.get('pos_embed')
    if pos_embed is not None and model.pos_embed is not None:
        # timm's resampling cannot tell a DeiT layout (class token in the position embedding)
        # from a DeiT-3 one (patches only): a count that is no square grid is the wrong one.
        prefix = 0 if model.no_embed_class else model.num_prefix_tokens
        grid = pos_embed.shape[1] - prefix
        if pos_embed.shape[1] != model.pos_embed.shape[1] and math.isqrt(grid) ** 2 != grid:
            raise ValueError(
                f"checkpoint pos_embed has {pos_embed.shape[1]} positions, which is no square "
                f"patch grid plus the {prefix} prefix positions this model embeds "
                f"(no_embed_class={model.no_embed_class}): a DeiT checkpoint for a DeiT-3 model "
                "or the reverse?")
    state_dict = _vit_checkpoint_filter_fn(state_dict, model, adapt_layer_scale=True)
    for k, v in model.state_dict().items():
        if k.endswith('attn.logit_scale') and k not in state_dict:
            state_dict[k] = v  # QKNorm's own scale: standard checkpoints lack it, keep its init
    return check_state_dict(state_dict, model, adaptable=('head.',),
                            first_conv='patch_embed.proj')


def _no_weights_hint(variant: str) -> str:
    return (f"{variant}: no QUEST weights exist (the paper published none), so pretrained=True "
            "would give a randomly initialised model. A standard-attention checkpoint of the same "
            f"architecture ({TIMM_COUNTERPARTS[variant]}) loads as an initialisation for "
            "fine-tuning, not as a trained QUEST model (its logits change): "
            f"attnzoo.models.quest_vit.from_timm_weights('{variant}'), or "
            f"timm.create_model('{variant}', pretrained=True, "
            "pretrained_cfg_overlay=dict(file=CHECKPOINT)).")


@register_notrace_function
def check_patch_input(x: torch.Tensor, in_chans: int, img_size: Optional[Tuple[int, int]],
                      patch_size: Tuple[int, int], strict_img_size: bool,
                      dynamic_img_pad: bool) -> torch.Tensor:
    """The model policy's input check for a ViT: ``ValueError`` (where timm's ``PatchEmbed``
    asserts or its conv fails) for wrong channels, an image smaller than a patch, a size other
    than the one a fixed-size model was built for, or one that is no multiple of the patch."""
    x = check_image_input(x, in_chans, min(patch_size))
    H, W = x.shape[2], x.shape[3]
    whole = H % patch_size[0] == 0 and W % patch_size[1] == 0
    if img_size is not None and strict_img_size:
        if H != img_size[0] or W != img_size[1]:
            dynamic = "dynamic_img_size=True" + ("" if whole else ", dynamic_img_pad=True")
            raise ValueError(f"the model was built for img_size={img_size[0]}x{img_size[1]}, "
                             f"got {H}x{W}; create it with img_size=({H}, {W}) (the position "
                             f"embedding is resampled on loading) or {dynamic}")
        return x  # as timm's ViTs: the patch conv leaves out the rows and columns past a patch
    if not dynamic_img_pad and not whole:
        raise ValueError(f"input height and width must be multiples of the patch size "
                         f"{patch_size[0]}x{patch_size[1]}, got {H}x{W}; or create the model "
                         "with dynamic_img_pad=True")
    return x


# A leaf for any FX tracer: the hook below calls it from outside the traced ViT's module, where
# timm's autowrap list does not reach.
torch.fx.wrap('check_patch_input')


def _check_input(patch_embed: PatchEmbed, args: Tuple[torch.Tensor]) -> None:
    # A forward pre-hook on patch_embed: every entry point (forward, forward_features,
    # forward_intermediates, features_only) passes through it, and hooks script with the model,
    # unlike a subclass's super().forward.
    check_patch_input(args[0], patch_embed.proj.in_channels, patch_embed.img_size,
                      patch_embed.patch_size, patch_embed.strict_img_size,
                      patch_embed.dynamic_img_pad)


def _create_quest_vit(variant: str, pretrained: bool = False, **kwargs) -> VisionTransformer:
    feature_cls = kwargs.get('feature_cls', 'getter')
    if kwargs.get('features_only') and isinstance(feature_cls, str) and feature_cls != 'getter':
        # hooks / FX would tap the blocks' token sequences, not maps (timm's ViT fails at
        # forward there); the getter returns forward_intermediates' NCHW maps
        raise ValueError(f"{variant}: features_only supports feature_cls='getter' (the default) "
                         f"for this token model, got feature_cls={feature_cls!r}: 'hook', 'fx' "
                         "and 'dict' would return the blocks' [B, tokens, C] sequences, not maps")
    out_indices = kwargs.pop('out_indices', 3)
    if kwargs.get('features_only'):  # a feature per block (timm's ViT's default depth: 12)
        out_indices = check_indices('out_indices', out_indices, kwargs.get('depth', 12),
                                    'blocks', increasing=True)
    attn_layer = kwargs.pop('attn_layer', 'quest')
    if isinstance(attn_layer, str):
        timm_names = tuple(getattr(timm_vit, 'ATTN_LAYERS', ()))  # timm's own, if any
        if attn_layer in FORMULATIONS:
            attn_layer = attn_layer_for(attn_layer)
        elif attn_layer not in timm_names:
            raise ValueError(f"{variant}: unknown attn_layer {attn_layer!r}; accepted: "
                             f"{', '.join(map(repr, FORMULATIONS + timm_names))} or an attention "
                             "module class")
    model = build_model(
        VisionTransformer, variant, pretrained,
        filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
        no_weights_hint=_no_weights_hint(variant),
        attn_layer=attn_layer,
        **kwargs)
    # features_only wraps the model (FeatureGetterNet): its patch_embed is the same module.
    model_vit = getattr(model, 'model', model)
    model_vit.patch_embed.register_forward_pre_hook(_check_input)
    size = model_vit.patch_embed.img_size
    if size is not None and tuple(size) != tuple(model.pretrained_cfg['input_size'][1:]):
        # built for another size (img_size=): the one its position embedding is learned for
        # (the only one it takes, unless dynamic_img_size), so its data config's too; timm's
        # ViTs keep the tag's, and export, bench, publish and validate.py read it
        cfg = {**model.pretrained_cfg,
               'input_size': (model.pretrained_cfg['input_size'][0], *size)}
        for holder in {model, model_vit}:
            holder.pretrained_cfg = holder.default_cfg = cfg
    return model


def from_timm_weights(model_name: str, timm_tag: Optional[str] = None,
                      **kwargs) -> VisionTransformer:
    """``model_name`` (a QUEST-ViT) initialised from the weights of a timm tag of its standard
    counterpart (default: the counterpart's default tag, e.g. ``deit_tiny_patch16_224.fb_in1k``),
    downloaded as timm downloads them. The result is an *initialisation*: the attention logits
    change, so fine-tune it; its ``pretrained_cfg`` names the source weights and says so.

    ``kwargs`` go to ``timm.create_model`` (``num_classes``, ``attn_layer``, ``img_size``, ...)."""
    counterpart = TIMM_COUNTERPARTS.get(model_name)
    if counterpart is None:
        raise ValueError(f"model_name must be a QUEST-ViT ({', '.join(TIMM_COUNTERPARTS)}), "
                         f"got {model_name!r}")
    timm_tag = timm_tag or counterpart
    try:
        source_cfg = timm.get_pretrained_cfg(timm_tag, allow_unregistered=False)
    except RuntimeError:  # unknown architecture or tag
        source_cfg = None
    if source_cfg is None or not source_cfg.has_weights:
        raise ValueError(f"timm_tag must be a timm model tag with weights (e.g. "
                         f"{timm.list_models(counterpart, pretrained=True)[:3]}), got {timm_tag!r}")
    # The counterpart is checked by keys, not names: any timm ViT of the same structure works
    # (a different resolution or patch size is resampled by the filter).
    ours = timm.create_model(model_name, device='meta').state_dict()
    theirs = timm.create_model(timm_tag.split('.', 1)[0], device='meta').state_dict()
    differ = sorted(set(ours) ^ set(theirs))
    if differ:
        raise ValueError(f"{timm_tag} does not have {model_name}'s structure (keys that differ: "
                         f"{', '.join(differ[:8])}{' ...' if len(differ) > 8 else ''}); its "
                         f"counterpart is {counterpart}")
    source = source_cfg.to_dict()
    overlay = {k: source[k] for k in _WEIGHT_FIELDS if k in source}
    overlay['notes'] = (f"initialised from timm's {timm_tag} (standard attention): not a trained "
                        f"QUEST model, fine-tune it",)
    overlay.update(kwargs.pop('pretrained_cfg_overlay', None) or {})
    return timm.create_model(model_name, pretrained=True, pretrained_cfg_overlay=overlay,
                             **kwargs)


# No weights: no url / hf_hub_id / tag. Data config as timm's DeiT cfgs.
_CFG = {
    'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': None,
    'crop_pct': .9, 'interpolation': 'bicubic', 'fixed_input_size': True,
    'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
    'first_conv': 'patch_embed.proj', 'classifier': 'head',
    'paper_ids': 'arXiv:2604.00199',
    'paper_name': 'QUEST: A robust attention formulation using Query-modulated spherical attention',
}

default_cfgs = generate_default_cfgs({name: dict(_CFG) for name in TIMM_COUNTERPARTS})

# DeiT-3 style: LayerScale 1e-6, no position embedding on the class token
_DEIT3 = dict(no_embed_class=True, init_values=1e-6)


@register_model
def quest_vit_tiny_patch16_224(pretrained=False, **kwargs) -> VisionTransformer:
    """QUEST ViT-Ti/16 (DeiT-Ti config; paper: DeiT 300 ep, 73.4 top-1)."""
    model_args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
    return _create_quest_vit('quest_vit_tiny_patch16_224', pretrained, **dict(model_args, **kwargs))


@register_model
def quest_vit_small_patch16_224(pretrained=False, **kwargs) -> VisionTransformer:
    """QUEST ViT-S/16 (DeiT-S config; paper: DeiT 200 ep, 80.2 top-1)."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_quest_vit(
        'quest_vit_small_patch16_224', pretrained, **dict(model_args, **kwargs))


@register_model
def quest_vit_base_patch16_224(pretrained=False, **kwargs) -> VisionTransformer:
    """QUEST ViT-B/16 (DeiT-B config; paper: DeiT 100 ep, 79.7 top-1)."""
    model_args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return _create_quest_vit('quest_vit_base_patch16_224', pretrained, **dict(model_args, **kwargs))


@register_model
def quest_vit_large_patch16_224(pretrained=False, **kwargs) -> VisionTransformer:
    """QUEST ViT-L/16 (class token and position embedding as DeiT; paper: DeiT 100 ep, 74.9)."""
    model_args = dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16)
    return _create_quest_vit(
        'quest_vit_large_patch16_224', pretrained, **dict(model_args, **kwargs))


@register_model
def quest_deit3_base_patch16_224(pretrained=False, **kwargs) -> VisionTransformer:
    """QUEST ViT-B/16, DeiT-3 style (paper: DeiT-3 400+20 ep, 83.2 top-1)."""
    model_args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, **_DEIT3)
    return _create_quest_vit(
        'quest_deit3_base_patch16_224', pretrained, **dict(model_args, **kwargs))


@register_model
def quest_deit3_large_patch16_224(pretrained=False, **kwargs) -> VisionTransformer:
    """QUEST ViT-L/16, DeiT-3 style (paper: DeiT-3 400+20 ep, 84.1 top-1)."""
    model_args = dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16, **_DEIT3)
    return _create_quest_vit(
        'quest_deit3_large_patch16_224', pretrained, **dict(model_args, **kwargs))


@register_model
def quest_deit3_huge_patch14_224(pretrained=False, **kwargs) -> VisionTransformer:
    """QUEST ViT-H/14, DeiT-3 style (paper: DeiT-3 400+20 ep, 83.4 top-1)."""
    model_args = dict(patch_size=14, embed_dim=1280, depth=32, num_heads=16, **_DEIT3)
    return _create_quest_vit(
        'quest_deit3_huge_patch14_224', pretrained, **dict(model_args, **kwargs))
