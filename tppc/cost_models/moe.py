"""Prices of the ops a mixture-of-experts layer runs: grouped expert matmuls and routing.

Terms:
    rows: ``(token, expert)`` pairs of a chunk, ``R = c · top_k`` (the grouped matmul's first
        input has R rows, already sorted by expert).
    experts touched: experts with at least one row. Under uniform, independent routing the
        expected count is ``E · (1 − (1 − 1/E)^R)``; that expectation is what is priced
        (``min(E, R)`` is an upper bound on it; skewed routing touches fewer). The weights
        read are those of the touched experts, not all E.

Rules (by op semantics, not by model name):
    * a grouped matmul ``(R, K) @ (E, K, N)`` grouped by offsets (``transformers::
      grouped_mm_fallback``, ``aten._grouped_mm``) does ``2·R·K·N`` matrix FLOPs as one
      skinny matmul of ``R / touched`` rows per touched expert (so the roofline's per-matmul
      row overhead is paid per expert), and reads R rows, writes R outputs and reads the
      touched experts' weights; transformers' ``grouped_mm_fallback`` (CPU) loops over the
      experts in Python: ``2 + 4·touched`` launches (output zeros, offsets to a list; per
      touched expert two row slices, the expert's weight, one ``mm``), each paying the op
      overhead, so small chunks pay the expert loop many times; a native ``_grouped_mm``
      is one launch;
    * ``sort`` does ``n·log2(n)`` comparisons per sorted row of n, ``topk`` ``n·log2(k)``,
      ``histc`` one per input element, each reading its input and writing its outputs.
The ``batched_mm`` implementation needs no rule here: it gathers one weight matrix per row
(``index``, priced as the memory it moves) and runs ``bmm`` (2·R·K·N FLOPs).

Example:
    >>> expected_experts(8, sympy.Integer(1))
    1
"""

from __future__ import annotations

import sympy
from torch import fx

from tppc.cost_models.node_costs import NodeCost
from tppc.cost_models.node_shapes import Shapes, itemsize, numel, tensor_vals, value_bytes
from tppc.ir.op_rules import op_rule

__all__ = ["FALLBACK_LAUNCHES_PER_EXPERT", "expected_experts", "moe_node_cost"]

FALLBACK_LAUNCHES_PER_EXPERT = 4
"""Ops ``grouped_mm_fallback`` runs per touched expert: input rows, weight, output rows, mm."""


def expected_experts(experts: int, rows: sympy.Expr) -> sympy.Expr:
    """Expected experts hit by ``rows`` uniform independent draws out of ``experts``."""
    e = sympy.Integer(experts)
    return e * (1 - (1 - 1 / e) ** rows)


def _name(node: fx.Node) -> str:
    name = getattr(node.target, "_opname", "") if node.op == "call_function" else ""
    return name.rstrip("_") if name.endswith("_") and not name.startswith("__") else name


def moe_node_cost(node: fx.Node, shapes: Shapes, dtype: str) -> NodeCost | None:
    """The price of a grouped expert matmul or a routing op (None for any other node): the
    ops whose price in :mod:`tppc.ir.op_rules` is ``grouped_matmul`` or ``routing``."""
    if node.op != "call_function":
        return None
    op, price = _name(node), op_rule(node.target).price
    if price == "grouped_matmul" and len(node.args) >= 2:
        return _grouped_mm(node, op, shapes, dtype)
    if price != "routing" or not isinstance(node.args[0], fx.Node):
        return None
    src = shapes.shape(node.args[0]) or ()
    count = numel(src)
    if op == "histc":
        vector = count
    else:
        dim = node.args[2 if op == "topk" else 1] if len(node.args) > (2 if op == "topk" else 1) \
            else node.kwargs.get("dim", -1)
        n = src[int(dim)] if src else sympy.Integer(1)
        k = sympy.Integer(int(node.args[1])) if op == "topk" else n
        vector = count * sympy.Max(sympy.log(k, 2), 1)
    nbytes = value_bytes(shapes, [node.args[0]]) + value_bytes(shapes, [node])
    return NodeCost(node.name, op, "vector", sympy.Integer(0), (), sympy.expand(vector),
                    sympy.expand(nbytes), dtype)


def _grouped_mm(node: fx.Node, op: str, shapes: Shapes, dtype: str) -> NodeCost:
    x_node, w_node = node.args[0], node.args[1]
    x, w = shapes.shape(x_node), shapes.shape(w_node)
    rows, k = x[0], x[-1]
    experts, n = int(w[0]), w[-1]
    touched = expected_experts(experts, rows)
    w_item = itemsize(tensor_vals(w_node.meta["val"])[0])
    nbytes = (value_bytes(shapes, [x_node]) + value_bytes(shapes, [node])
              + touched * k * n * w_item
              + value_bytes(shapes, [a for a in node.args[2:3] if isinstance(a, fx.Node)]))
    matmuls = ((touched, rows / touched, n, k),)
    launches = 2 + FALLBACK_LAUNCHES_PER_EXPERT * touched if op == "grouped_mm_fallback" \
        else sympy.S.One
    return NodeCost(node.name, op, "matrix", sympy.expand(2 * rows * k * n), matmuls,
                    sympy.Integer(0), nbytes, dtype, launches=launches)
