"""The lengths a capture holds when the model's Python branches on the sequence length.

Terms:
    length bound: a range ``[lo, hi]`` of sequence units that torch.export's guards admit
        when the model's Python compares the length with a constant (XGLM grows its
        sinusoidal table past ``max_position_embeddings``; Doge keeps every key up to
        ``keep_window_size`` tokens and top-k masks them beyond). torch.export refuses the
        default range with "Constraints violated" and suggests the bound
        (``Dim('seq', max=hi)``); tppc exports again within it. The capture's shape guards
        keep the bound (:func:`tppc.frontend.front_end.guards_hold`), so a call outside it is
        captured again at its own length, where the model's Python takes the other branch,
        as a DiT at its ``sample_size`` is.

A bound that admits no length but the example's is a pinned length (the ``specialized``
path of :mod:`tppc.frontend.torch_export`), not a bound.
"""

from __future__ import annotations

import re

import sympy

from tppc.frontend.guard_sites import describe_sites

__all__ = ["admitted_range", "bound_site"]

_SUGGESTED = re.compile(r"\b(\w+) = Dim\('(\w+)'((?:, (?:min|max)=\d+)*)\)")


def admitted_range(exc: Exception, units: int, name: str = "seq", low: int = 2,
                   high: int | None = None) -> tuple[int, int] | None:
    """The range torch.export suggests for the sequence ``Dim`` ``name`` after a
    "Constraints violated" error, when it holds the example's ``units`` and a longer length
    (``lo <= units < hi``); else None. ``low``, ``high``: the range just tried (a guard
    ``… != …`` that excludes ``high`` alone narrows it by one)."""
    text = str(exc)
    if "Constraints violated" not in text or "specialized" in text:
        return None
    for var, dim, bounds in _SUGGESTED.findall(text):
        if var != name or dim != name:
            continue
        found = dict(re.findall(r"(min|max)=(\d+)", bounds))
        lo, hi = int(found.get("min", low)), int(found.get("max", 0))
        if hi and lo <= units < hi:
            return lo, hi
    if high is not None and _excluded(text) == high and low <= units < high - 1:
        return low, high - 1  # "(40*L) != 1600" at max=40: the table's own length is out
    return None


def _excluded(text: str) -> int | None:
    """The one length a guard ``… != …`` in torch's message excludes, else None."""
    found = re.search(r"satisfy the generated guard (.+?) != (.+?)\.?$", text, re.MULTILINE)
    if found is None:
        return None
    size = re.compile(r"L\[[^\]]+\]\.size\(\)\[\d+\]")
    return _root(f"Eq({size.sub('s', found.group(1))}, {size.sub('s', found.group(2))})")


def bound_site(range_sites: list[tuple[str, tuple[str, int, str]]], hi: int) -> str:
    """The model's line whose inequality guard bounds the length at ``hi`` (its boundary,
    solved for the one size symbol, is ``hi`` or ``hi + 1``), else the first inequality
    guard's line, else "a line inside torch"."""
    for guard, site in range_sites:
        if _root(guard) in (hi, hi + 1):
            return describe_sites([site])[0]
    return describe_sites([range_sites[0][1]])[0] if range_sites else "a line inside torch"


def _root(relation: str) -> int | None:
    """The one integer where both sides of a relation in one symbol are equal
    (``s70 + 2 <= 66``: 64; ``Eq(40*s, 1600)``: 40), else None."""
    try:
        rel = sympy.sympify(relation)
        (sym,) = rel.free_symbols
        roots = sympy.solve(sympy.Eq(rel.lhs, rel.rhs), sym)
    except Exception:  # not a relation in one symbol, or not solvable: no root we can read
        return None
    return int(roots[0]) if len(roots) == 1 and roots[0].is_Integer else None
