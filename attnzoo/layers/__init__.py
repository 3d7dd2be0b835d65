"""nn.Modules built on :mod:`attnzoo.ops`."""
from .attention_map import AttentionMap, attention_layers, attention_maps, record_attention
from .neighborhood import NeighborhoodAttention2d
from .qna import LocalSelfAttention, QnA, QnAUpsample
from .quest import (QKNormAttention, QNormAttention, QuestAttention, StandardAttention,
                    l2_normalize)
from .san import SAM

__all__ = ["NeighborhoodAttention2d", "QnA", "QnAUpsample", "LocalSelfAttention", "SAM",
           "QuestAttention", "QNormAttention", "QKNormAttention", "StandardAttention",
           "l2_normalize", "AttentionMap", "attention_layers", "attention_maps",
           "record_attention"]
