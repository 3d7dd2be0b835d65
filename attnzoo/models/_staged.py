"""The timm model interface of attnzoo's hierarchical families (NAT/DiNAT, QnA-ViT, SAN).

Each of those models follows the model policy's layout (:mod:`attnzoo.models`): ``stem``,
``stages`` (an ``nn.Sequential`` of stages that take and return NCHW maps, each with a
``grad_checkpointing`` flag and ``downsample`` / ``blocks`` children), ``norm`` and a timm
``ClassifierHead`` as ``head``. Given that layout, everything timm asks of a model beyond its
constructor is the same code, which lives here once: forward, features, intermediates, pruning,
classifier reset, grad checkpointing, parameter groups.

A subclass builds its modules and hands them, with what the shared code needs to know, to
``StagedModel.__init__`` (every argument keyword-only, all required: the whole contract is that
signature); the base class registers ``stem``, ``stages``, ``norm`` and makes the ``head``.
Its stages subclass :class:`Stage`; its variants are built by :func:`build_staged` with cfgs
from :func:`staged_cfg`.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import ClassifierHead, get_device_dtype
from timm.models._features import (FeatureDictNet, FeatureHookNet, FeatureListNet,
                                   feature_take_indices)
from timm.models._features_fx import FeatureGraphNet
from timm.models._manipulate import checkpoint_seq

from .. import backends
from ..ops.neighborhood import static_size
from ._helpers import build_model, check_image_input, check_indices

# a leaf for torch.fx's own tracer too (timm's honours register_notrace_function only): the
# check reads the input's sizes
torch.fx.wrap("check_image_input")

__all__ = ["StagedModel", "Stage", "ImageStem", "build_staged", "mlp_rows", "staged_cfg"]


class ImageStem(nn.Module):
    """Base of a model's stem, which checks the images it is given (:meth:`check`, first in
    its ``forward``): every way into the model runs the stem first, timm's feature wrappers
    too ('list', 'hook', 'dict' call the modules one by one, not the model's ``forward``).
    The model sets the smallest side it takes (:meth:`StagedModel.set_min_size`)."""

    def __init__(self, in_chans: int):
        super().__init__()
        self.in_chans = in_chans
        self.min_size = 1
        self.min_size_hint = ''

    def check(self, x: torch.Tensor) -> torch.Tensor:
        return check_image_input(x, self.in_chans, self.min_size, self.min_size_hint)


class Stage(nn.Module):
    """Base of a model's stages: a subclass makes ``downsample`` and ``blocks`` (an
    ``nn.Sequential``) and calls :meth:`forward_blocks`, which checkpoints the blocks when
    timm's ``set_grad_checkpointing`` asked for it."""

    def __init__(self):
        super().__init__()
        self.grad_checkpointing = False

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.blocks, x)
        # (is_scripting() first: TorchScript compiles neither the check nor the export branch)
        if not torch.jit.is_scripting():
            if backends.exporting() and not self.training \
                    and all(hasattr(block, "forward_rows") for block in self.blocks):
                return self.blocks_on_rows(x)
        return self.blocks(x)

    def blocks_on_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks on NHWC ``x``'s rows ``[B * H * W, C]`` (each block's ``forward_rows(rows,
        (B, H, W))``), while exporting: the exporters' symbolic-shape work per node, in
        torch.export, its decompositions and the translation, grows with the symbolic dims of
        each tensor: nat_mini's dynamo export took 40 s with its blocks on maps, 30 s on rows
        (BENCHMARKS.md "ONNX export")."""
        B, H, W = x.shape[0], x.shape[1], x.shape[2]
        rows = x.reshape(-1, x.shape[3])
        for block in self.blocks:
            rows = block.forward_rows(rows, (B, H, W))
        return rows.reshape(B, H, W, rows.shape[-1])


def mlp_rows(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's ``Mlp`` in a block's ``forward_rows`` (:meth:`Stage.blocks_on_rows` runs only in
    eval), without its dropouts: identities in eval, yet each a node of the exported graph."""
    return mlp.fc2(mlp.norm(mlp.act(mlp.fc1(x))))


def build_staged(model_cls: type, variant: str, pretrained: bool, num_stages: int,
                 filter_fn: Callable[[Dict[str, Any], nn.Module], Dict[str, Any]],
                 **kwargs) -> nn.Module:
    """:func:`build_model` for a :class:`StagedModel` of ``num_stages`` stages: by default
    ``features_only`` returns every stage's output (``out_indices`` overrides)."""
    out_indices = kwargs.pop('out_indices', tuple(range(num_stages)))
    feature_cfg = dict(flatten_sequential=True, out_indices=out_indices)
    if kwargs.get('features_only'):
        feature_cfg['out_indices'] = check_indices('out_indices', out_indices, num_stages,
                                                   increasing=True)
        feature_cfg['feature_cls'] = _staged_feature_cls(kwargs.pop('feature_cls', 'list'))
    return build_model(model_cls, variant, pretrained, filter_fn=filter_fn,
                       feature_cfg=feature_cfg, **kwargs)


def _using_stages(feature_cls: type) -> type:
    """timm's feature wrapper ``feature_cls``, first telling the model which stages it will run
    (:meth:`StagedModel.use_stages`: up to the last ``out_indices``), so that its stem checks
    the minimum input of those (SAN's is smaller with fewer stages), as
    ``prune_intermediate_layers`` does."""
    def __init__(self, model, out_indices, **kwargs):
        _, last = feature_take_indices(len(model.stages), out_indices)
        model.use_stages(last + 1)
        feature_cls.__init__(self, model, out_indices=out_indices, **kwargs)
    name = f"Staged{feature_cls.__name__}"  # (a module global: a pickled model finds it)
    cls = globals()[name] = type(name, (feature_cls,), dict(
        __init__=__init__, __module__=__name__, __qualname__=name, __doc__=feature_cls.__doc__))
    return cls


_FEATURE_CLASSES = {cls: _using_stages(cls) for cls in (
    FeatureListNet, FeatureHookNet, FeatureDictNet, FeatureGraphNet)}


def _staged_feature_cls(feature_cls: Any) -> Any:
    """``feature_cls`` (a name, as timm reads it, or one of timm's classes) as its
    :func:`_using_stages` class; anything else (a class of the user's, 'getter') as given."""
    if isinstance(feature_cls, str):
        name = feature_cls.lower()
        feature_cls = (FeatureHookNet if 'hook' in name else {
            'list': FeatureListNet, 'dict': FeatureDictNet, 'fx': FeatureGraphNet}.get(
                name, feature_cls))
    return _FEATURE_CLASSES.get(feature_cls, feature_cls)


def staged_cfg(**kwargs) -> Dict[str, Any]:
    """A pretrained cfg for an ImageNet-1k model at 224 with a 7x7 final map (timm's fields;
    ``kwargs`` add to or override them)."""
    return {
        'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': (7, 7),
        'crop_pct': 0.875, 'interpolation': 'bicubic', 'fixed_input_size': False,
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'stem.conv', 'classifier': 'head.fc',
        **kwargs,
    }


class StagedModel(nn.Module):
    """Base of the hierarchical families: timm's model interface on stem / stages / norm / head.

    A subclass builds its modules first, as locals (``nn.Module`` takes no attribute before
    its ``__init__``), then calls ``super().__init__`` with them; after that it sets only its own
    attributes (its weight init, what its :meth:`use_stages` needs).

    Args:
        stem: image -> the first stage's input (NCHW), an :class:`ImageStem`.
        stages: the stages in order, each a :class:`Stage` taking and returning NCHW maps;
            registered as the ``nn.Sequential`` ``stages``.
        norm: the final norm, sized for the last stage's output.
        feature_info: one dict per stage, timm's ``num_chs`` / ``reduction`` / ``module``
            (``'stages.{i}'``); the last ``num_chs`` is ``num_features``.
        in_chans: input image channels (checked on every forward).
        min_size: the smallest input side the architecture accepts (a subclass whose minimum
            depends on its stages updates it in :meth:`use_stages`; a subclass whose minimum
            an option lowers says so through :meth:`set_min_size`).
        num_classes: classifier outputs (0: no classifier, ``forward`` returns pooled features).
        global_pool: ``'avg'`` (the official models), any timm ``SelectAdaptivePool2d`` type, or
            ``''`` (no pooling).
        drop_rate: dropout before the classifier.

    Every subclass takes ``in_chans``, ``num_classes``, ``global_pool`` and ``drop_rate`` as
    constructor arguments of its own, with these meanings.
    """

    def __init__(
            self,
            *,
            stem: nn.Module,
            stages: Sequence[nn.Module],
            norm: nn.Module,
            feature_info: List[Dict[str, Any]],
            in_chans: int,
            min_size: int,
            num_classes: int,
            global_pool: str,
            drop_rate: float,
    ):
        super().__init__()
        if not isinstance(stem, ImageStem):
            raise TypeError(f"stem must be an ImageStem (it checks the input), got "
                            f"{type(stem).__name__}")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.output_fmt = 'NCHW'
        self.feature_info = feature_info
        self.stem = stem
        self.set_min_size(min_size)
        self.stages = nn.Sequential(*stages)
        self.num_features = feature_info[-1]['num_chs']
        self.norm = norm
        self.reset_classifier(num_classes, global_pool)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r'^stem',
            blocks=r'^stages\.(\d+)' if coarse else [
                (r'^stages\.(\d+)\.downsample', (0,)),
                (r'^stages\.(\d+)\.blocks\.(\d+)', None),
                (r'^norm', (99999,)),
            ],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        # A new head (not ClassifierHead.reset): its input width changes when stages are pruned.
        if global_pool is None:
            global_pool = self.head.global_pool.pool_type
        self.num_classes = num_classes
        self.head = ClassifierHead(self.num_features, num_classes, pool_type=global_pool,
                                   drop_rate=self.drop_rate, **get_device_dtype(self))
        self.head.train(self.training)
        self.head_hidden_size = self.num_features * self.head.global_pool.feat_mult()

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Forward returning each stage's output.

        Args:
            x: input images, NCHW.
            indices: take the last n stages if int, all if None, or these stages.
            norm: apply the final ``norm`` to the last stage's intermediate.
            stop_early: stop after the last stage needed.
            output_fmt: 'NCHW' or 'NHWC' intermediates.
            intermediates_only: return only the intermediates.

        Returns:
            intermediates, or (final features as forward_features, intermediates).
        """
        if output_fmt not in ('NCHW', 'NHWC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NHWC', got {output_fmt!r}")
        intermediates = []
        if not torch.jit.is_scripting():
            indices = check_indices('indices', indices, len(self.stages))
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        x = self._check_input(x)
        x = self.stem(x)
        last_idx = len(self.stages) - 1
        if torch.jit.is_scripting() or not stop_early:  # can't slice modules in torchscript
            stages = self.stages
        else:
            stages = self.stages[:max_index + 1]
        feat_idx = 0
        for feat_idx, stage in enumerate(stages):
            x = stage(x)
            if feat_idx in take_indices:
                x_inter = self.norm(x) if norm and feat_idx == last_idx else x
                intermediates.append(x_inter if output_fmt == 'NCHW'
                                     else x_inter.permute(0, 2, 3, 1))
        if intermediates_only:
            return intermediates
        if feat_idx == last_idx:
            x = self.norm(x)  # the final norm is sized for the last stage only
        return x, intermediates

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the stages (and norm / head) not needed for the intermediates ``indices``."""
        indices = check_indices('indices', indices, len(self.stages))
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        prune_end = max_index < len(self.stages) - 1
        self.stages = self.stages[:max_index + 1]
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        if prune_end:
            self.num_features = self.feature_info[max_index]['num_chs']
        if prune_head or prune_end:
            self.reset_classifier(0, '')
        self.use_stages(len(self.stages))
        return take_indices

    def use_stages(self, n: int) -> None:
        """Only the first ``n`` stages will run (:meth:`prune_intermediate_layers`, or a
        feature wrapper that stops there): where the model's minimum input depends on its
        stages, a subclass updates it here (:meth:`set_min_size`)."""

    def set_min_size(self, min_size: int, hint: str = '') -> None:
        """The smallest input side the model takes (``min_size``, as hub.smallest_size reads
        it), and what ends the too-small-input message (how to lower the minimum): the stem
        checks both."""
        self.min_size = self.stem.min_size = min_size
        self.stem.min_size_hint = hint

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        """Under a compiled training step, the image size made static (the stem checks the
        images themselves: :class:`ImageStem`)."""
        if not torch.jit.is_scripting():  # alone in its test: TorchScript 2.4 skips only that
            if torch.compiler.is_compiling() and torch.is_grad_enabled() and (
                    not backends.exporting()):
                # Inductor (torch 2.14) fails to compile these models' training step at a
                # symbolic image size (a relation of sizes it cannot decide), where timm's
                # ResNet does not: a compiled training step specializes on the image size
                # instead, one graph per size, as with dynamic=False.
                static_size(x.shape[-2])
                static_size(x.shape[-1])
        return x

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Final normalised feature map, NCHW and unpooled."""
        x = self._check_input(x)
        x = self.stem(x)
        x = self.stages(x)
        x = self.norm(x)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Global pool (the official models: mean), dropout, classifier."""
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(x)
        x = self.forward_head(x)
        return x
