"""Which axes of a reshape's input and output cover the same elements (the cut flow through
views: :func:`tppc.passes.sharding.cuts.flow`).

Example:
    >>> reshape_groups((1, 8, 64), (1, 8, 4, 16))
    [([1], [1]), ([2], [2, 3])]
"""

from __future__ import annotations

from typing import Any

import sympy

__all__ = ["divides", "reshape_groups"]


def reshape_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """Input and output axes that cover the same elements, in order; axes of size 1 belong
    to no group (they hold no part of a cut)."""
    a_axes = [i for i, s in enumerate(src) if s != 1]
    b_axes = [j for j, s in enumerate(dst) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a_axes) and j < len(b_axes):
        ins, outs = [a_axes[i]], [b_axes[j]]
        a, b = src[a_axes[i]], dst[b_axes[j]]
        i, j = i + 1, j + 1
        while not _same(a, b):
            if divides(a, b) and i < len(a_axes):
                a, i = a * src[a_axes[i]], i + 1
                ins.append(a_axes[i - 1])
            elif divides(b, a) and j < len(b_axes):
                b, j = b * dst[b_axes[j]], j + 1
                outs.append(b_axes[j - 1])
            else:
                return groups
        groups.append((ins, outs))
    return groups


def _same(a: Any, b: Any) -> bool:
    """Equal sizes; or two sizes of the token axis that differ by a constant (a later patch's
    graph keeps the text rows of the first patch's in the shapes it recorded)."""
    if a == b:
        return True
    diff = sympy.sympify(a) - sympy.sympify(b)
    return bool(sympy.sympify(a).free_symbols) and not diff.free_symbols


def divides(a: Any, b: Any) -> bool:
    """Whether ``a`` is a proper factor of ``b`` (sizes: ints or sympy expressions)."""
    ratio = sympy.sympify(b) / sympy.sympify(a)
    if ratio.is_Integer:
        return int(ratio) > 1
    return bool(ratio.free_symbols) and sympy.denom(ratio) == 1
