"""Functional attention primitives with backend dispatch (see :mod:`attnzoo.backends`)."""
from .neighborhood import na1d, na2d
from .qna import qna2d
from .san import san_aggregation, san_neighbours, san_subtraction, san_subtraction2

__all__ = ["na1d", "na2d", "qna2d", "san_aggregation", "san_subtraction", "san_subtraction2",
           "san_neighbours"]
