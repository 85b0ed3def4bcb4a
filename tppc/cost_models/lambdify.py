"""Sympy expressions of the cost model → numpy functions, torch's shape functions included.

Shapes captured by ``torch.export`` hold torch's own sympy functions (``FloorDiv``,
``CeilDiv``, ``ModularIndexing``, ``PythonMod``, ``Max``/``Min``, ``Where``...; see
``torch.utils._sympy.functions``) that sympy's numpy printer does not know: a DiT's patch
count is ``FloorDiv(s, 2)**2``. :func:`to_numpy` prints them by name and binds each name to
a vectorised numpy implementation.

Example:
    >>> from torch.utils._sympy.functions import FloorDiv
    >>> c = sympy.Symbol("c")
    >>> to_numpy(FloorDiv(c, 2) * 3, (c,))(np.array([5.0]))
    array([6.])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import sympy

__all__ = ["NUMPY_NAMESPACE", "to_numpy"]


def _reduce(fn: Callable) -> Callable:
    return lambda *args: functools.reduce(fn, args)


NUMPY_NAMESPACE: dict[str, Callable] = {
    "FloorDiv": np.floor_divide,
    "CeilDiv": lambda a, b: -np.floor_divide(-np.asarray(a), b),
    "CleanDiv": np.floor_divide,
    "IntTrueDiv": np.true_divide,
    "FloatTrueDiv": np.true_divide,
    "ModularIndexing": lambda x, div, mod: np.mod(np.floor_divide(x, div), mod),
    "PythonMod": np.mod,
    "Mod": np.mod,
    "PowByNatural": np.power,
    "FloatPow": np.power,
    "TruncToInt": np.trunc,
    "TruncToFloat": np.trunc,
    "FloorToInt": np.floor,
    "CeilToInt": np.ceil,
    "RoundToInt": np.round,
    "RoundDecimal": lambda x, n: np.round(x, int(n)),
    "ToFloat": lambda x: np.asarray(x, dtype=float),
    "Identity": lambda x: x,
    "Where": np.where,
    "Max": _reduce(np.maximum),
    "Min": _reduce(np.minimum),
    "LShift": np.left_shift,
    "RShift": np.right_shift,
}
"""Numpy implementations of torch's sympy functions, keyed by their printed names."""


def to_numpy(expr: sympy.Expr, symbols: Sequence[sympy.Symbol]) -> Callable[..., np.ndarray]:
    """Lambdify ``expr`` over ``symbols`` for numpy arrays, torch's shape functions included."""
    return sympy.lambdify(tuple(symbols), expr, modules=[NUMPY_NAMESPACE, "numpy"])
