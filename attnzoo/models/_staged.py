"""The timm model interface of attnzoo's hierarchical families (NAT/DiNAT, QnA-ViT, SAN).

Each of those models follows the model policy's layout (:mod:`attnzoo.models`): ``stem``,
``stages`` (an ``nn.Sequential`` of stages that take and return NCHW maps, each with a
``grad_checkpointing`` flag and ``downsample`` / ``blocks`` children), ``norm`` and a timm
``ClassifierHead`` as ``head``. Given that layout, everything timm asks of a model beyond its
constructor is the same code, which lives here once: forward, features, intermediates, pruning,
classifier reset, grad checkpointing, parameter groups.

A subclass sets, in ``__init__``: ``in_chans``, ``min_size`` (the smallest input side it
accepts), ``drop_rate``, ``num_classes``, ``num_features``, ``head_hidden_size``,
``feature_info`` (one entry per stage), and the four modules above.
"""
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from timm.layers import ClassifierHead, get_device_dtype
from timm.models._features import feature_take_indices

from ._helpers import check_image_input

__all__ = ["StagedModel"]


class StagedModel(nn.Module):
    """Base of the hierarchical families: timm's model interface on stem / stages / norm / head."""

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
        assert output_fmt in ('NCHW', 'NHWC'), 'Output format must be NCHW or NHWC.'
        intermediates = []
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        x = check_image_input(x, self.in_chans, self.min_size)
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
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        prune_end = max_index < len(self.stages) - 1
        self.stages = self.stages[:max_index + 1]
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        if prune_end:
            self.num_features = self.feature_info[max_index]['num_chs']
        if prune_head or prune_end:
            self.reset_classifier(0, '')
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Final normalised feature map, NCHW and unpooled."""
        x = check_image_input(x, self.in_chans, self.min_size)
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
