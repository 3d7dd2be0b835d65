"""nn.Modules built on :mod:`attnzoo.ops`."""
from .neighborhood import NeighborhoodAttention2d
from .quest import (QKNormAttention, QNormAttention, QuestAttention, StandardAttention,
                    l2_normalize)

__all__ = ["NeighborhoodAttention2d", "QuestAttention", "QNormAttention", "QKNormAttention",
           "StandardAttention", "l2_normalize"]
