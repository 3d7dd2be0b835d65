"""nn.Modules built on :mod:`attnzoo.ops`."""
from .neighborhood import NeighborhoodAttention2d

__all__ = ["NeighborhoodAttention2d"]
