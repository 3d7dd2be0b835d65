"""Argument helpers the ops share."""
from __future__ import annotations

import operator
from typing import Optional, Tuple


def as_int(value) -> Optional[int]:
    """``value`` as an int where it is one (a NumPy integer too), not a bool; else None.
    (``operator.index`` on every value: torch 2.4's Dynamo specializes a symbolic int there,
    for the backend choice's call key, where ``type(value) is int`` would pass it on.)"""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def plain_int(value):
    """An integer (a NumPy one too) as a Python int; anything else as given, for the op's
    checks to refuse."""
    one = as_int(value)
    return value if one is None else one


def as_ints(value, n: int) -> Optional[Tuple[int, ...]]:
    """``value`` (an int, or a tuple or list of ``n``) as ``n`` ints, else None."""
    one = as_int(value)
    if one is not None:
        return (one,) * n
    if isinstance(value, (tuple, list)) and len(value) == n:
        each = tuple(as_int(v) for v in value)
        if None not in each:
            return each
    return None
