"""What timm's ``train.py`` builds from a config, made with timm's own library factories.

``train.py`` is in timm's repository, not in its wheel. These helpers take its arguments (its
defaults from ``timm_train_options.json``, the YAML's values over them, a test's overrides over
those), derive the lr as it does, and call the factories it calls with the arguments it passes
them: ``create_model``, ``optimizer_kwargs`` -> ``create_optimizer_v2``, ``scheduler_kwargs`` ->
``create_scheduler_v2``, ``resolve_data_config``, ``create_loader``, ``Mixup`` and the loss. So a
test checks the objects a run would use. ``TINY`` are the tiny widths the training tests give each
family's smallest model (as ``--model-kwargs``).
"""
import argparse
import copy
import functools
from pathlib import Path
from typing import Any, Dict, Optional

import timm
import torch
import yaml
from timm.data import Mixup, create_loader, resolve_data_config
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs

from timm_train_options import load_table

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# model_kwargs shrinking each family's smallest model for the training tests (32 px input)
TINY = {
    "nat_mini": dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), mlp_ratio=2.),
    "qna_vit_tiny": dict(embed_dim=16, qna_depths=(1, 1, 1, 0), lsa_depths=(0, 0, 1, 1)),
    "san10_pairwise": dict(depths=(1, 1, 1, 1, 1), widths=(16, 32, 32, 64, 64), stem_width=8,
                           share_planes=2, padding_mode="zeros"),
    "quest_vit_tiny_patch16_224": dict(img_size=32, patch_size=8, embed_dim=24, depth=2,
                                       num_heads=3),
}


def config_paths():
    return sorted(CONFIGS.glob("*.yaml"))


def read_config(path) -> Dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())


@functools.lru_cache(maxsize=None)
def _defaults() -> Dict[str, Any]:
    return {dest: option["default"] for dest, option in load_table()["options"].items()}


def train_args(config: Dict[str, Any], world_size: int = 1, **overrides) -> argparse.Namespace:
    """train.py's arguments for ``--config`` plus ``overrides`` on ``world_size`` processes,
    with the lr it derives from lr_base when no lr is given."""
    args = argparse.Namespace(**copy.deepcopy({**_defaults(), **config, **overrides}))
    args.world_size = world_size
    args.grad_accum_steps = max(1, args.grad_accum_steps)
    if not args.lr:
        ratio = args.batch_size * world_size * args.grad_accum_steps / args.lr_base_size
        scale = args.lr_base_scale or (
            "sqrt" if any(name in args.opt.lower() for name in ("ada", "lamb")) else "linear")
        args.lr = args.lr_base * (ratio ** 0.5 if scale == "sqrt" else ratio)
    return args


def create_model(args: argparse.Namespace, **kwargs) -> torch.nn.Module:
    return timm.create_model(
        args.model, pretrained=args.pretrained, num_classes=args.num_classes, drop_rate=args.drop,
        drop_path_rate=args.drop_path, drop_block_rate=args.drop_block, global_pool=args.gp,
        bn_momentum=args.bn_momentum, bn_eps=args.bn_eps, scriptable=args.torchscript,
        checkpoint_path=args.initial_checkpoint, **args.model_kwargs, **kwargs)


def create_optimizer(args: argparse.Namespace, model: torch.nn.Module):
    return create_optimizer_v2(model, **optimizer_kwargs(cfg=args), **args.opt_kwargs)


def create_scheduler(args: argparse.Namespace, optimizer, updates_per_epoch: int):
    """(scheduler, number of epochs to train)"""
    return create_scheduler_v2(optimizer, **scheduler_kwargs(args, decreasing_metric=False),
                               updates_per_epoch=updates_per_epoch)


def data_config(args: argparse.Namespace, model: torch.nn.Module) -> Dict[str, Any]:
    return resolve_data_config(vars(args), model=model)


def create_train_loader(args, dataset, cfg: Dict[str, Any]):
    """train.py's training loader, without its prefetcher (``--no-prefetcher``: random erasing
    then sits at the end of the transform instead of in the prefetcher)."""
    interpolation = args.train_interpolation
    if args.no_aug or not interpolation:
        interpolation = cfg["interpolation"]
    return create_loader(
        dataset, input_size=cfg["input_size"], batch_size=args.batch_size, is_training=True,
        no_aug=args.no_aug, re_prob=args.reprob, re_mode=args.remode, re_count=args.recount,
        re_split=args.resplit, train_crop_mode=args.train_crop_mode, scale=args.scale,
        ratio=args.ratio, hflip=args.hflip, vflip=args.vflip, color_jitter=args.color_jitter,
        color_jitter_prob=args.color_jitter_prob, grayscale_prob=args.grayscale_prob,
        gaussian_blur_prob=args.gaussian_blur_prob, auto_augment=args.aa,
        num_aug_repeats=args.aug_repeats, interpolation=interpolation, mean=cfg["mean"],
        std=cfg["std"], num_workers=args.workers, use_prefetcher=False)


def create_eval_loader(args, dataset, cfg: Dict[str, Any]):
    return create_loader(
        dataset, input_size=cfg["input_size"], batch_size=args.batch_size, is_training=False,
        interpolation=cfg["interpolation"], crop_pct=cfg["crop_pct"], mean=cfg["mean"],
        std=cfg["std"], num_workers=args.workers, use_prefetcher=False)


def _mixup_active(args: argparse.Namespace) -> bool:
    return args.mixup > 0 or args.cutmix > 0 or args.cutmix_minmax is not None


def create_mixup(args: argparse.Namespace) -> Optional[Mixup]:
    if not _mixup_active(args):
        return None
    return Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix,
                 cutmix_minmax=args.cutmix_minmax, prob=args.mixup_prob,
                 switch_prob=args.mixup_switch_prob, mode=args.mixup_mode,
                 label_smoothing=args.smoothing, num_classes=args.num_classes)


def create_loss(args: argparse.Namespace) -> torch.nn.Module:
    """The training loss train.py picks (no JSD: no config uses augmentation splits)."""
    bce = dict(target_threshold=args.bce_target_thresh, sum_classes=args.bce_sum,
               pos_weight=args.bce_pos_weight)
    if _mixup_active(args):  # mixup's soft targets carry the smoothing
        return BinaryCrossEntropy(**bce) if args.bce_loss else SoftTargetCrossEntropy()
    if args.smoothing:
        return (BinaryCrossEntropy(smoothing=args.smoothing, **bce) if args.bce_loss
                else LabelSmoothingCrossEntropy(smoothing=args.smoothing))
    return torch.nn.CrossEntropyLoss()
