"""Whether an op keeps every token's row, in order: the shape rules of ``annotate_seq_dims``.

A node that reads a token value stays ``token`` (row-wise) only when its output holds one row
per input token, in the same order; these predicates read that off the symbolic shapes and
the op's arguments. Any of them failing makes the node ``global`` (see
:func:`tppc.passes.annotation.annotate_seq_dims.annotate_seq_dims_pass`).

Terms:
    token order: the rows of a value along its token axis, one per token (or one per
        (batch, token, head) when constant axes before or after the token axis are merged
        into it: :attr:`tppc.ir.records.TokenInfo.runs`).
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch import fx

from tppc.ir.op_rules import op_rule
from tppc.ir.records import TOKEN, TokenInfo
from tppc.passes.shapes import op_name, size_expr, tensor_val

__all__ = [
    "binary_elementwise",
    "full_slice",
    "getitem_keeps_tokens",
    "pinned_shape",
    "resizes_tokens",
    "token_runs",
]


def resizes_tokens(node: fx.Node, src: TokenInfo, sizes: list[sympy.Expr]) -> bool:
    """A row-wise op keeps the token count; one that pads, repeats or crops it is global.

    Reshapes and (patchify) convolutions change the axis' extent legitimately and are checked
    by their own rules.
    """
    if op_rule(node.target).role in ("reshape", "conv"):
        return False
    if src.axis_size is None or not sizes:
        return False
    return sympy.simplify(sizes[0] - src.axis_size) != 0


def token_runs(node: fx.Node, src: fx.Node, out_axes: list[int]) -> tuple[int, int] | None:
    """The ``(outer, inner)`` runs of a reshape's token axis when it keeps token order, else
    None (:attr:`TokenInfo.runs`).

    Constant axes before or after the token axis may be merged into it or split off it
    again (GPT-2's ``Conv1D`` flattening the batch with the tokens, a video's frames, a
    gated norm over ``(b·L·h, d)`` rows reshaped back to ``(b, L, h·d)``): the rows before the
    tokens (``outer`` runs of them times the axes before) and each token's rows must match.
    """
    info: TokenInfo = src.meta[TOKEN]
    if info.axis is None or info.axis_size is None or not out_axes:
        return None
    in_shape, out_shape = tensor_val(src).shape, tensor_val(node).shape
    if len(out_axes) > 1:  # queries and keys (a mask's (…, q, k)): only the axes before move
        return info.runs if _keeps_trailing(info, in_shape, out_shape, out_axes) else None
    before_in = sympy.Mul(*[size_expr(s) for s in in_shape[: info.axis]])
    before_out = sympy.Mul(*[size_expr(s) for s in out_shape[: out_axes[0]]])
    outer_in, inner_in = info.runs
    tokens = info.axis_size / (outer_in * inner_in)
    same = sympy.simplify(before_in - before_out) == 0
    if not same and (before_in.free_symbols or before_out.free_symbols):
        return None
    groups = sympy.simplify(before_in * outer_in / before_out)
    inner = sympy.simplify(size_expr(out_shape[out_axes[0]]) / (groups * tokens))
    if groups.is_Integer and inner.is_Integer and groups > 0 and inner > 0:
        return int(groups), int(inner)
    return (outer_in, 1) if same else None  # the rows before the tokens alone kept


def _keeps_trailing(info: TokenInfo, in_shape: Any, out_shape: Any, out_axes: list[int]
                    ) -> bool:
    """A reshape of a value with several token axes (a mask over queries and keys) keeps
    them when it reshapes only constant axes before the first: ``repeat_kv``'s
    ``(b, kv, groups, q, k) → (b, heads, q, k)``."""
    shift = out_axes[0] - info.axis
    trailing_in = [size_expr(s) for s in in_shape[info.axis:]]
    trailing_out = [size_expr(s) for s in out_shape[out_axes[0]:]]
    before_in = sympy.Mul(*[size_expr(s) for s in in_shape[: info.axis]])
    before_out = sympy.Mul(*[size_expr(s) for s in out_shape[: out_axes[0]]])
    return (len(trailing_in) == len(trailing_out)
            and all(sympy.simplify(a - b) == 0 for a, b in zip(trailing_in, trailing_out))
            and not before_in.free_symbols and sympy.simplify(before_in - before_out) == 0
            and sorted(a + shift for a in (info.axis, *info.other_axes)) == sorted(out_axes))


def pinned_shape(node: fx.Node) -> bool:
    """A reshape to a literal size where its value's size depends on the sequence symbol.

    A specialised capture keeps the sizes the model's Python computed from the example
    (DiT's ``int(sqrt(tokens))`` grid: ``reshape(x, [-1, 4, 4, ...])``) while the traced
    shape stays symbolic (``(1, 4, s, ...)``): the op runs on the whole sequence only.
    """
    shape = node.args[1] if len(node.args) > 1 else None
    val = tensor_val(node)
    if not isinstance(shape, list | tuple) or val is None or len(shape) != val.dim():
        return False
    return any(isinstance(a, int) and a != -1 and size_expr(s).free_symbols
               for a, s in zip(shape, val.shape))


def getitem_keeps_tokens(node: fx.Node) -> bool:
    """``x[...]`` on a tensor keeps the tokens unless it indexes or slices the token axis."""
    base = node.args[0]
    if not isinstance(base, fx.Node) or isinstance(base.meta.get("val"), list | tuple):
        return True  # picks one value of a tuple (chunk, split, max...)
    src: TokenInfo = base.meta[TOKEN]
    if src.axis is None or tensor_val(base) is None:
        return True
    items = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    rank = tensor_val(node.args[0]).dim()
    axis = 0
    for item in items:
        if item is Ellipsis:
            axis += rank - sum(1 for i in items if i is not None and i is not Ellipsis)
        elif isinstance(item, fx.Node) and axis <= src.axis:
            return False  # advanced indexing before or at the token axis
        elif item is not None:
            if axis == src.axis:
                return isinstance(item, slice) and item.start in (0, None) and \
                    item.step in (1, None) and (item.stop is None or
                                                (isinstance(item.stop, int) and item.stop >= 2**62))
            axis += 1
    return True


def binary_elementwise(node: fx.Node) -> bool:
    """``torch.max(a, b)`` and friends: elementwise, not a reduction."""
    tensors = [a for a in node.args if isinstance(a, fx.Node) and tensor_val(a) is not None]
    return len(tensors) > 1


def full_slice(node: fx.Node, src: TokenInfo) -> bool:
    """A ``slice`` that keeps every row: start 0 or minus the axis' length (HF's
    ``attention_mask[:, -inputs_embeds.shape[1]:]``), step 1, an end past the axis (a huge
    int, or the node of the sequence length itself)."""
    if op_name(node) != "slice":
        return False
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    big = end is None or (isinstance(end, int) and end >= 2**62)
    if isinstance(end, fx.Node):  # x[:, :n], n the length
        big = _is_length(end, src, 1)
    return (start in (0, None) or _is_length(start, src, -1)) and bool(big) and step == 1


def _is_length(value: Any, src: TokenInfo, sign: int) -> bool:
    """Whether ``value`` is a node of the symbolic size ``sign`` × the token axis' length."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(val, torch.SymInt) and src.axis_size is not None \
        and bool(src.axis_size.free_symbols) \
        and sympy.simplify(size_expr(val) - sign * src.axis_size) == 0
