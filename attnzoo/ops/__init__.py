"""Functional attention primitives with backend dispatch (see :mod:`attnzoo.backends`)."""
from .neighborhood import na1d, na2d
from .qna import qna2d

__all__ = ["na1d", "na2d", "qna2d"]
