"""Which positional values depend on the call's whole length, not only on their rows.

Terms:
    length table: a positional value whose row ``p`` changes with the length of the call
        it is evaluated in: a dynamic-NTK rope, whose frequencies are those of
        ``max(position_ids) + 1`` (a reduction over the token axis), or a rope whose base a
        model scales by ``x.shape[1]`` (the length used as a number). A chunk reads the rows
        of the table of its whole call, so a call is exact; a generation that grows the
        sequence one token at a time evaluates it again at each step's length (what a model
        with a K/V cache does: each token's K keep the table they were computed with).
    row-local value: any other positional value (``arange``, a default rope table, a causal
        mask): row ``p`` is the same at every length, so one evaluation at the final length
        serves every decode step.

The test is structural and errs on the side of a length table (which only costs an
evaluation per decode step): a node that removes the token axis from a value that has it
(``amax``, ``sum``, a ``select`` of a row), or a number computed from the length passed as
a value (``pow(s / 16, 2)``, ``mul(t, s)``, ``full(..., s)``), not as a size.

Example:
    >>> length_reason(gm.graph.find_nodes(op="call_function")[7], ctx.seq_symbol)  # doctest: +SKIP
    "node 'max_1' (aten.max) reduces the token axis"
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch import fx

from tppc.passes.shapes import ancestors, op_name, size_expr, tensor_val

__all__ = ["length_reason"]

_aten = torch.ops.aten

_SIZE_LIKE = frozenset({_aten.arange.default, _aten.arange.start, _aten.arange.start_step,
                        _aten.linspace.default})
"""Ops whose ``Scalar`` arguments only size the result (``arange(s)``: row ``p`` is ``p``)."""


def length_reason(node: fx.Node, sym: sympy.Symbol) -> str | None:
    """Why ``node``'s value depends on the call's whole length (see the module docstring),
    or None when it is row-local."""
    for n in sorted(ancestors([node]), key=_order(node)):
        if n.op != "call_function" or tensor_val(n) is None:
            continue
        if _reduces_token_axis(n, sym):
            return f"node {n.name!r} ({op_name(n)}) removes the token axis"
        used = _length_number(n, sym)
        if used is not None:
            return f"node {n.name!r} ({op_name(n)}) reads the length as the number {used}"
    return None


def _order(node: fx.Node) -> Any:
    index = {n: i for i, n in enumerate(node.graph.nodes)}
    return lambda n: index[n]


def _has_sym(value: Any, sym: sympy.Symbol) -> bool:
    if isinstance(value, torch.SymInt | torch.SymFloat):
        return sym in size_expr(value).free_symbols if isinstance(value, torch.SymInt) \
            else sym in value.node.expr.free_symbols
    return False


def _reduces_token_axis(node: fx.Node, sym: sympy.Symbol) -> bool:
    out = tensor_val(node)
    if any(_has_sym(s, sym) for s in out.shape):
        return False
    return any(t is not None and any(_has_sym(s, sym) for s in t.shape)
               for t in (tensor_val(a) for a in node.all_input_nodes))


def _length_number(node: fx.Node, sym: sympy.Symbol) -> str | None:
    """The length-derived number ``node`` reads as a value (not a size), or None."""
    if node.target in _SIZE_LIKE:
        return None
    schema = getattr(node.target, "_schema", None)
    arguments = list(schema.arguments) if schema is not None else []
    given = [*zip(arguments, node.args), *((a, node.kwargs[a.name]) for a in arguments
                                           if a.name in node.kwargs)]
    for argument, value in given:
        if "int" in str(argument.type).lower() and "scalar" not in str(argument.type).lower():
            continue  # a size, a dim, an index (SymInt, int[])
        for item in value if isinstance(value, list | tuple) else (value,):
            val = item.meta.get("val") if isinstance(item, fx.Node) else None
            if _has_sym(val, sym):
                return str(val)
    return None
