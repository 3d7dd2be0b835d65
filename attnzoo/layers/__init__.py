"""nn.Modules built on :mod:`attnzoo.ops`."""
from .neighborhood import NeighborhoodAttention2d
from .san import SAM

__all__ = ["NeighborhoodAttention2d", "SAM"]
