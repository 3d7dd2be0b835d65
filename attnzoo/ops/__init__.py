"""Functional attention primitives with backend dispatch (see :mod:`attnzoo.backends`).

Export (ONNX, ``torch.export``): every op registers an ``export=`` formula with
:func:`attnzoo.backends.register_op`, plain tensor ops whose window, padding and index arithmetic
follow the input's shape (default: the torch reference). While a model is traced for export
(``torch.jit.trace``, which the TorchScript ONNX exporter runs, or ``torch.export``, which the
dynamo one runs: :func:`attnzoo.backends.exporting`), :func:`attnzoo.backends.dispatch` runs that
formula whatever backend is selected, so no custom op or kernel reaches an exporter; eager calls
never run it.
"""
from .neighborhood import na1d, na2d
from .qna import qna2d
from .san import san_aggregation, san_neighbours, san_subtraction, san_subtraction2

__all__ = ["na1d", "na2d", "qna2d", "san_aggregation", "san_subtraction", "san_subtraction2",
           "san_neighbours"]
