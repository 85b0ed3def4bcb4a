"""Layer times as numpy functions of ``(c, p)``, compiled once per expression.

Terms:
    layer time: a sympy expression in c, p and L (:mod:`.layer_pricer`).
    compiled time: the expression lambdified to numpy over ``(c, p, L)`` once
        (:data:`COMPILED_TIMES` kept, least recently used dropped first).
    time function (:data:`~.table.TimeFn`): a compiled time bound to a table's ``seq_len``,
        evaluated on whole ``(c, p)`` grids; a re-plan at a new length compiles nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import sympy

from tppc.cost_models.lambdify import to_numpy
from tppc.cost_models.node_shapes import C, L, P
from tppc.cost_models.table import TimeFn

__all__ = ["COMPILED_TIMES", "difference", "vectorise"]

COMPILED_TIMES = 4096
"""Distinct layer-time expressions whose compiled numpy function is kept (least recently
used dropped first): a re-plan at a new length compiles none of them again."""


@functools.lru_cache(maxsize=COMPILED_TIMES)
def _compiled(expr: sympy.Expr) -> Callable[..., np.ndarray]:
    """``expr`` (in c, p and L) lambdified over ``(c, p, L)``: one compile per distinct layer
    time, reused at every length (``lru_cache`` is thread-safe; two concurrent misses
    compile the same function twice, harmlessly)."""
    return to_numpy(expr, (C, P, L))


def vectorise(expr: sympy.Expr, seq_len: int) -> TimeFn:
    """``expr`` at ``L = seq_len`` as a numpy function of ``(c, p)``."""
    raw = _compiled(expr)
    length = float(seq_len)

    def time(c: np.ndarray, p: np.ndarray) -> np.ndarray:
        c = np.asarray(c, dtype=float)
        p = np.asarray(p, dtype=float)
        shape = np.broadcast_shapes(c.shape, p.shape)
        return np.broadcast_to(np.asarray(raw(c, p, length), dtype=float), shape).copy()

    return time


def difference(whole: TimeFn, part: TimeFn) -> TimeFn:
    """``whole - part``, pointwise (the time of a block's second part)."""

    def time(c: np.ndarray, p: np.ndarray) -> np.ndarray:
        return whole(c, p) - part(c, p)

    return time
