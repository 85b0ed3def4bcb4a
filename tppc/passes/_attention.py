"""Recognise attention nodes and tell causal from bidirectional attention.

Attention nodes are aten SDPA ops (torch.export captures) or calls of
``torch.nn.functional.scaled_dot_product_attention`` (fx captures). An SDPA node is causal
when ``is_causal=True``, bidirectional when it has neither a mask nor ``is_causal``, and
otherwise classified by evaluating its mask (a positional value) at small *probe lengths*,
never at the example length (so classifying costs the same for a 32k-token example as for
a 16-token one): a lower-triangular pattern at every probe is causal, an all-true one
bidirectional; a causal band is a sliding window, and a mask built from an integer input
(``attention_mask``) is a padding mask (see :mod:`tppc.passes._masks`). The probes are a short length and one longer than every integer constant
the mask's computation uses (a sliding window of ``w`` tokens shows at lengths ``> w``), at
most :data:`MAX_PROBE`.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.nn import functional as F

from tppc.context import CompileContext
from tppc.errors import AnnotationError
from tppc.ir import TOKEN, AttentionKind, MaskSpec
from tppc.passes._masks import mask_spec
from tppc.passes._shapes import ancestors, call_module_of, module_path, size_expr, tensor_val

__all__ = ["ATTENTION_OPS", "MAX_PROBE", "attention_kind", "classify_attention",
           "evaluate_positional", "probe_lengths"]

_aten = torch.ops.aten
ATTENTION_OPS = {
    _aten.scaled_dot_product_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    F.scaled_dot_product_attention,
}
MAX_PROBE = 8192
"""Longest probe length at which a mask is evaluated (its ``L × L`` pattern: 64 MiB)."""
_SHORT_PROBE = 7
_SENTINEL = 1 << 30
"""Integer constants this large are slice ends and dtype limits, not window sizes."""


def attention_kind(node: fx.Node, gm: fx.GraphModule, ctx: CompileContext) -> AttentionKind:
    """Causal or bidirectional, from ``is_causal`` or the mask's values."""
    return classify_attention(node, gm, ctx)[0]


def classify_attention(node: fx.Node, gm: fx.GraphModule, ctx: CompileContext
                       ) -> tuple[AttentionKind, MaskSpec | None]:
    """The attention's kind and the structured mask (window, padding) tppc rebuilds per
    chunk, or None for plain causal or all-visible attention (see :mod:`._masks`)."""
    args = list(node.args) + [None] * 8
    mask = node.kwargs.get("attn_mask", args[3])
    is_causal = bool(node.kwargs.get("is_causal", args[5] or False))
    if is_causal:
        return "causal", None
    if mask is None:
        return "bidirectional", None
    info = mask.meta[TOKEN] if isinstance(mask, fx.Node) else None
    if info is None or not (info.role in ("positional", "const") or info.inputs):
        raise AnnotationError(
            f"attention node {node.name!r} (module {module_path(node)}) has a mask that depends "
            "on activations (hidden states), not only on positions and integer inputs such as "
            "attention_mask; it cannot be rebuilt per chunk. fix: build the mask from "
            "positions and attention_mask only"
        )
    return mask_spec(node, mask, gm, ctx, probe_lengths(mask))


def probe_lengths(mask: fx.Node) -> tuple[int, ...]:
    """Sequence lengths at which to evaluate ``mask``: a short one and one beyond every
    integer constant of its computation (capped at :data:`MAX_PROBE`)."""
    literals = [abs(a) for n in ancestors([mask]) for a in _int_args(n)]
    long = min(MAX_PROBE, max([2 * _SHORT_PROBE + 1, *(v + 2 for v in literals)]))
    return (_SHORT_PROBE, long)


def _int_args(node: fx.Node) -> list[int]:
    flat = torch.utils._pytree.tree_leaves((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, int) and not isinstance(a, bool)
            and abs(a) < _SENTINEL]



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
            env[n] = _concrete(n, ctx, length)
        elif n.op == "get_attr":
            value = operator.attrgetter(str(n.target))(gm)
            env[n] = _concrete(n, ctx, length) if value.device.type == "meta" else value
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


def _concrete(node: fx.Node, ctx: CompileContext, length: int) -> Any:
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



