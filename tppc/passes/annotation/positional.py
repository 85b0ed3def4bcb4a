"""Evaluate a positional value (a mask, position ids, a rope table) at a concrete length.

The annotation passes call this to classify masks at small probe lengths and to check a
value's token rows; inputs take given overrides, the example's values where capture kept
them, else zeros. Devices in the graph (a meta model builds its masks on ``meta``) are
replaced by the CPU.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from tppc.errors import AnnotationError
from tppc.ir.context import CompileContext
from tppc.passes.shapes import ancestors, call_module_of, size_expr, tensor_val

__all__ = ["call_target", "concrete_value", "evaluate_positional", "on_cpu"]


def evaluate_positional(target: fx.Node, gm: fx.GraphModule, ctx: CompileContext,
                        length: int | None = None,
                        overrides: dict[fx.Node, Any] | None = None) -> Any:
    """Evaluate a positional value on CPU, the sequence length set to ``length`` (default:
    the example's).

    Inputs take the value in ``overrides``, else the example's values where capture kept
    them and the shape matches (``ctx.example_values``: text masks, ids), else zeros.
    """
    overrides = overrides or {}
    needed = ancestors([target])
    length = ctx.example_seq if length is None else length
    env: dict[fx.Node, Any] = {}
    for n in gm.graph.nodes:
        if n not in needed:
            continue
        if n in overrides:
            env[n] = overrides[n]
        elif n.op == "placeholder":
            env[n] = concrete_value(n, ctx, length)
        elif n.op == "get_attr":
            value = operator.attrgetter(str(n.target))(gm)
            env[n] = concrete_value(n, ctx, length) if value.device.type == "meta" else value
        elif n.op in ("call_function", "call_method", "call_module"):
            args = on_cpu(fx.node.map_arg(n.args, lambda a: env[a]))
            kwargs = on_cpu(fx.node.map_arg(n.kwargs, lambda a: env[a]))
            env[n] = call_target(n, args, kwargs)
        else:
            raise AnnotationError(f"cannot evaluate {n.op} node {n.name!r} of a mask")
        if n is target:
            return env[n]
    raise AssertionError("unreachable")


_UNINITIALISED = {"empty", "new_empty", "empty_like", "empty_strided", "empty_permuted"}


def call_target(node: fx.Node, args: Any, kwargs: Any) -> Any:
    """Run ``node``'s target on concrete ``args``; an uninitialised tensor (``new_empty``,
    ``empty_like``...) comes back zero-filled, so that a probe never reads whatever memory
    held (a classification or exactness check that changed from run to run)."""
    if node.op == "call_method":
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)
    if node.op == "call_module":
        return call_module_of(node)(*args, **kwargs)
    value = node.target(*args, **kwargs)
    packet = getattr(node.target, "overloadpacket", node.target)
    if getattr(packet, "__name__", "") in _UNINITIALISED and isinstance(value, torch.Tensor):
        value = value.zero_()
    return value


def on_cpu(tree: Any) -> Any:
    """Replace device arguments (meta models build their masks on ``meta``) with the CPU."""
    def fix(v: Any) -> Any:
        return torch.device("cpu") if isinstance(v, torch.device) else v
    return torch.utils._pytree.tree_map(fix, tree)


def concrete_value(node: fx.Node, ctx: CompileContext, length: int) -> Any:
    val = tensor_val(node)
    if val is None:
        return node.meta.get("val")
    shape = [int(size_expr(s).subs(ctx.seq_symbol, length)) for s in val.shape]
    value = _example_value(node, ctx, shape)
    return torch.zeros(shape, dtype=val.dtype) if value is None else value


def _example_value(node: fx.Node, ctx: CompileContext, shape: list[int]) -> Any:
    """The example's value of an input of that shape (a text mask of ones), or None."""
    value = ctx.example_values.get(str(node.target), ctx.example_values.get(node.name))
    if value is None or list(value.shape) != shape:
        return None
    return value
