"""Helpers shared by the passes: symbolic shapes, module paths, op dimensions."""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

__all__ = ["module_path", "op_dims", "seq_axes", "size_expr", "tensor_val"]


def tensor_val(node: Any) -> Any:
    """The node's (first) tensor value from ``meta["val"]``, or None."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, list | tuple):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val if isinstance(val, torch.Tensor) else None


def size_expr(size: int | torch.SymInt) -> sympy.Expr:
    """A tensor size as a sympy expression."""
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


def seq_axes(node: fx.Node, sym: sympy.Symbol) -> tuple[list[int], list[sympy.Expr]]:
    """Axes of the node's tensor value whose size depends on ``sym``, and those sizes."""
    val = tensor_val(node)
    if val is None:
        return [], []
    axes, sizes = [], []
    for i, size in enumerate(val.shape):
        expr = size_expr(size)
        if sym in expr.free_symbols:
            axes.append(i)
            sizes.append(expr)
    return axes, sizes


def module_path(node: fx.Node) -> str:
    """Innermost module path of the node (``"model.layers.0.self_attn"``), or ``""``."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _cls in reversed(list(stack.values())):
        if path and not path.startswith("_"):
            return path
    return ""


def op_dims(node: fx.Node, src: fx.Node) -> set[int]:
    """The dimensions of ``src`` that the op works along (normalised to be non-negative)."""
    val = tensor_val(src)
    rank = val.dim() if val is not None else 0
    dims: Any = None
    if isinstance(node.target, torch._ops.OpOverload):
        try:
            norm = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                                      normalize_to_only_use_kwargs=True)
        except Exception:
            norm = None
        if norm is not None:
            kwargs = norm.kwargs
            dims = kwargs.get("dim", kwargs.get("dims"))
    if dims is None:
        return set()
    if isinstance(dims, int):
        dims = [dims]
    out = set()
    for d in dims:
        if isinstance(d, int) and rank:
            out.add(d % rank)
    return out
