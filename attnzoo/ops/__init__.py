"""Functional attention primitives with backend dispatch (see :mod:`attnzoo.backends`).

Export (ONNX, ``torch.export``): every op registers an ``export=`` formula with
:func:`attnzoo.backends.register_op`, plain tensor ops whose window, padding and index arithmetic
follow the input's shape (default: the torch reference). While a model is traced for export
(``torch.jit.trace``, which the TorchScript ONNX exporter runs, or ``torch.export``, which the
dynamo one runs: :func:`attnzoo.backends.exporting`), :func:`attnzoo.backends.dispatch` runs that
formula whatever backend is selected, so no custom op or kernel reaches an exporter; eager calls
never run it. The index tensors a formula derives from sizes alone go through
:func:`attnzoo.backends.export_memo`: a ``torch.export`` trace builds them once per size, and a
stage's blocks share them (the dynamo exporter's time follows the graph's size).
"""
from .neighborhood import (na1d, na1d_av, na1d_qk, na1d_qkv, na2d, na2d_av, na2d_qk, na2d_qkv,
                           na_window_positions)
from .qna import qna2d, qna2d_weights, qna_window_positions
from .san import san_aggregation, san_neighbours, san_subtraction, san_subtraction2

__all__ = ["na1d", "na2d", "na1d_qkv", "na2d_qkv", "na1d_qk", "na1d_av", "na2d_qk", "na2d_av",
           "na_window_positions", "qna2d", "qna2d_weights", "qna_window_positions",
           "san_aggregation", "san_subtraction", "san_subtraction2", "san_neighbours"]
