"""Recognise attention nodes and tell causal from bidirectional attention.

Attention nodes are aten SDPA ops (torch.export captures) or calls of
``torch.nn.functional.scaled_dot_product_attention`` (fx captures). An SDPA node is causal
when ``is_causal=True``, bidirectional when it has neither a mask nor ``is_causal``, and
otherwise classified by evaluating its mask (a positional value) at the
example length: a lower-triangular pattern is causal, an all-true one bidirectional.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.nn import functional as F

from tppc.context import CompileContext
from tppc.errors import AnnotationError
from tppc.ir import TOKEN, AttentionKind
from tppc.passes._shapes import call_module_of, module_path, size_expr, tensor_val

__all__ = ["ATTENTION_OPS", "attention_kind", "evaluate_positional"]

_aten = torch.ops.aten
ATTENTION_OPS = {
    _aten.scaled_dot_product_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    F.scaled_dot_product_attention,
}


def attention_kind(node: fx.Node, gm: fx.GraphModule, ctx: CompileContext) -> AttentionKind:
    """Causal or bidirectional, from ``is_causal`` or the mask's values."""
    args = list(node.args) + [None] * 8
    mask = node.kwargs.get("attn_mask", args[3])
    is_causal = bool(node.kwargs.get("is_causal", args[5] or False))
    if is_causal:
        return "causal"
    if mask is None:
        return "bidirectional"
    if not isinstance(mask, fx.Node) or mask.meta[TOKEN].role not in ("positional", "const"):
        raise AnnotationError(
            f"attention node {node.name!r} (module {module_path(node)}) has a mask that depends "
            "on token values, not only on positions; tppc supports causal and unmasked "
            "attention. fix: drop the padding mask (pass one sequence without padding)"
        )
    allowed = _allowed(evaluate_positional(mask, gm, ctx))
    n_q, n_k = allowed.shape[-2], allowed.shape[-1]
    causal = torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q)
    if bool(allowed.all()):  # first: a broadcast (1, S) mask of ones is not causal
        return "bidirectional"
    if bool((allowed == causal).all()):
        return "causal"
    raise AnnotationError(
        f"attention node {node.name!r} (module {module_path(node)}) has a mask that is neither "
        f"causal nor all-visible (first row allows {allowed.reshape(-1, n_k)[0].sum()} of "
        f"{n_k} keys: a sliding window or padding?); tppc cannot chunk it yet. fix: use "
        "full causal or bidirectional attention"
    )


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask > torch.finfo(mask.dtype).min / 2
    return allowed.reshape(-1, *allowed.shape[-2:]).all(dim=0)


def evaluate_positional(target: fx.Node, gm: fx.GraphModule, ctx: CompileContext) -> Any:
    """Evaluate a positional value at the example length on CPU.

    Inputs take the example's values where capture kept them (``ctx.example_values``: text
    masks, ids), else zeros.
    """
    needed: set[fx.Node] = set()
    todo = [target]
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(n.all_input_nodes)
    env: dict[fx.Node, Any] = {}
    for n in gm.graph.nodes:
        if n not in needed:
            continue
        if n.op == "placeholder":
            env[n] = _concrete(n, ctx)
        elif n.op == "get_attr":
            value = operator.attrgetter(str(n.target))(gm)
            env[n] = _concrete(n, ctx) if value.device.type == "meta" else value
        elif n.op in ("call_function", "call_method", "call_module"):
            args = _on_cpu(fx.node.map_arg(n.args, lambda a: env[a]))
            kwargs = _on_cpu(fx.node.map_arg(n.kwargs, lambda a: env[a]))
            env[n] = _call(n, args, kwargs)
        else:
            raise AnnotationError(f"cannot evaluate {n.op} node {n.name!r} of a mask")
        if n is target:
            return env[n]
    raise AssertionError("unreachable")


def _call(node: fx.Node, args: Any, kwargs: Any) -> Any:
    if node.op == "call_method":
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)
    if node.op == "call_module":
        return call_module_of(node)(*args, **kwargs)
    return node.target(*args, **kwargs)


def _on_cpu(tree: Any) -> Any:
    """Replace device arguments (meta models build their masks on ``meta``) with the CPU."""
    def fix(v: Any) -> Any:
        return torch.device("cpu") if isinstance(v, torch.device) else v
    return torch.utils._pytree.tree_map(fix, tree)


def _concrete(node: fx.Node, ctx: CompileContext) -> Any:
    val = tensor_val(node)
    if val is None:
        return node.meta.get("val")
    shape = [int(size_expr(s).subs(ctx.seq_symbol, ctx.example_seq)) for s in val.shape]
    value = _example_value(node, ctx, shape)
    return torch.zeros(shape, dtype=val.dtype) if value is None else value


def _example_value(node: fx.Node, ctx: CompileContext, shape: list[int]) -> Any:
    """The example's value of an input of that shape (a text mask of ones), or None."""
    value = ctx.example_values.get(str(node.target), ctx.example_values.get(node.name))
    if value is None or list(value.shape) != shape:
        return None
    return value



