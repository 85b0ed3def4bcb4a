"""Symbolic shapes of node values in (c, p, L): the token substitution and its readers.

Terms:
    c, p, L: tokens in the chunk, tokens before it, full sequence length (:data:`C`,
        :data:`P`, :data:`L`).
    sequence symbol: the graph's dynamic dimension (``s0``) that the capture left in the
        shapes of the values on the token axis.
    token substitution: ``s`` is replaced so that the canonical token count ``T(s)`` equals
        ``c`` (on token axes) or the attention key length (on key axes): ``p + c`` for causal
        attention, ``L`` for bidirectional (:class:`TokenSubstitution`).

:class:`Shapes` reads a node's value with the substitution applied (cached per node);
:func:`value_bytes` and :func:`numel` turn such shapes into bytes and element counts. The
per-node rules (:mod:`.node_costs`) and the sharded, memory and program prices read them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import sympy
import torch
from torch import fx

from tppc.errors import CostModelError
from tppc.ir.records import TOKEN, TokenInfo

__all__ = [
    "C",
    "L",
    "P",
    "Shapes",
    "TokenSubstitution",
    "arg_nodes",
    "find_seq_symbol",
    "itemsize",
    "numel",
    "tensor_vals",
    "value_bytes",
]

C, P, L = sympy.symbols("c p L", positive=True, integer=True)


@dataclass(frozen=True)
class TokenSubstitution:
    """How the graph's sequence symbol maps to c (token axes) and to the key length.

    Attributes:
        seq_symbol: the graph's sequence symbol (``s0``), or None for a static graph.
        chunk: what ``seq_symbol`` becomes on token axes (so that T = c).
        causal_key: what it becomes on key axes of causal attention (T = p + c).
        full: what it becomes on key axes of bidirectional attention (T = L).
    """

    seq_symbol: sympy.Symbol | None
    chunk: sympy.Expr
    causal_key: sympy.Expr
    full: sympy.Expr

    @classmethod
    def build(cls, seq_symbol: sympy.Symbol | None, token_count: sympy.Expr | None = None
              ) -> TokenSubstitution:
        """Solve ``token_count(seq_symbol) = x`` for x in (c, p + c, L).

        Raises:
            CostModelError: the token count cannot be inverted for the symbol.
        """
        if seq_symbol is None:
            return cls(None, C, P + C, L)
        count = seq_symbol if token_count is None else sympy.sympify(token_count)
        if count == seq_symbol:
            return cls(seq_symbol, C, P + C, L)
        x = sympy.Symbol("x", positive=True)
        sols = [s for s in sympy.solve(sympy.Eq(count, x), seq_symbol)
                if s.is_positive is not False]
        if len(sols) != 1:
            raise CostModelError(
                f"cannot solve token count {count} = x for {seq_symbol} (solutions {sols}); "
                "pass a token_count that is a monotone function of the sequence symbol"
            )
        return cls(seq_symbol, sols[0].subs(x, C), sols[0].subs(x, P + C), sols[0].subs(x, L))

    def key(self, attention: str | None) -> sympy.Expr:
        """The substitution for key axes of ``attention`` (causal unless bidirectional)."""
        return self.full if attention == "bidirectional" else self.causal_key


def tensor_vals(val: object) -> list[torch.Tensor]:
    """The tensors of a node's ``meta["val"]`` (nested lists and tuples flattened)."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, list | tuple):
        return [t for v in val for t in tensor_vals(v)]
    return []


def _dim(size: object) -> sympy.Expr:
    if isinstance(size, torch.SymInt):
        return sympy.sympify(size.node.expr)
    return sympy.Integer(int(size))


class Shapes:
    """Substituted shapes of node values, cached per node."""

    def __init__(self, subs: TokenSubstitution, default_attention: str) -> None:
        self.subs = subs
        self.default_attention = default_attention
        self._cache: dict[tuple[str, int], tuple[sympy.Expr, ...]] = {}

    def shape(self, node: fx.Node, index: int = 0) -> tuple[sympy.Expr, ...] | None:
        """Shape of the ``index``-th tensor of ``node`` (None where it has fewer)."""
        key = (node.name, index)
        if key in self._cache:
            return self._cache[key]
        tensors = tensor_vals(node.meta.get("val"))
        if index >= len(tensors):
            return None
        info = node.meta.get(TOKEN)
        other = set(info.other_axes) if isinstance(info, TokenInfo) else set()
        key_sub = self.subs.key(getattr(info, "attention", None) or self.default_attention)
        sym = self.subs.seq_symbol
        dims = []
        for axis, size in enumerate(tensors[index].shape):
            expr = _dim(size)
            if sym is not None and sym in expr.free_symbols:
                expr = expr.subs(sym, key_sub if axis in other else self.subs.chunk)
            dims.append(sympy.expand(expr))
        self._cache[key] = tuple(dims)
        return self._cache[key]


def numel(shape: Sequence[sympy.Expr]) -> sympy.Expr:
    """Elements of a (substituted) shape; 1 for a scalar."""
    return sympy.Mul(*shape) if shape else sympy.Integer(1)


def itemsize(t: torch.Tensor) -> int:
    """Bytes per element (4 for a value that does not say)."""
    return t.element_size() if hasattr(t, "element_size") else 4


def arg_nodes(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued nodes among ``node``'s arguments, once each, in order."""
    seen: dict[fx.Node, None] = {}
    for a in (*node.args, *node.kwargs.values()):
        for n in a if isinstance(a, list | tuple) else (a,):
            if isinstance(n, fx.Node) and tensor_vals(n.meta.get("val")):
                seen[n] = None
    return list(seen)


def value_bytes(shapes: Shapes, nodes: Iterable[fx.Node]) -> sympy.Expr:
    """Bytes of the values of ``nodes`` (every tensor of each), substituted."""
    total = sympy.Integer(0)
    for n in nodes:
        for i, t in enumerate(tensor_vals(n.meta.get("val"))):
            shape = shapes.shape(n, i)
            total += numel(shape) * itemsize(t)
    return total


def find_seq_symbol(gm: fx.GraphModule) -> sympy.Symbol | None:
    """The single free symbol of the placeholders' shapes (None for a static graph).

    Raises:
        CostModelError: more than one symbol (pass ``seq_symbol`` explicitly).
    """
    found: set[sympy.Symbol] = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        for t in tensor_vals(node.meta.get("val")):
            for size in t.shape:
                found |= _dim(size).free_symbols
    if len(found) > 1:
        raise CostModelError(
            f"graph has several dynamic symbols {sorted(map(str, found))}; pass seq_symbol= "
            "(the lead's ctx.seq_symbol) and make the other dimensions static"
        )
    return next(iter(found), None)

