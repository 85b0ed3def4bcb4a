"""Ops the cost model has no rule for: priced as memory traffic only, and warned about once.

The rules themselves live in :mod:`tppc.ir.op_rules`, the table the annotation pass reads too.
"""

from __future__ import annotations

import warnings

__all__ = ["UnpricedOpWarning", "warn_unpriced"]


class UnpricedOpWarning(UserWarning):
    """An op has no pricing rule; it was priced as memory traffic only."""


_WARNED: set[str] = set()


def warn_unpriced(op: str, node_name: str) -> None:
    """Warn (once per op name in this process) that ``op`` has no pricing rule."""
    if op in _WARNED:
        return
    _WARNED.add(op)
    warnings.warn(
        f"tppc cost model: no pricing rule for op {op!r} (first seen at node {node_name}); "
        "priced as memory traffic only (its FLOPs count as 0). Add its rule to the op table "
        "in tppc/ir/op_rules.py if it does real arithmetic.",
        UnpricedOpWarning, stacklevel=4)
