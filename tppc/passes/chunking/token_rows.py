"""Helpers of ``chunk_attention`` for diffusion transformers: rows per unit, prefixes, patches.

Terms:
    unit: one step of the sequence symbol. For an LLM a unit is a token; for a DiT it is a
        patch row (the symbol counts patch rows), so the chunk ``[chunk_start, chunk_end)``
        is a band of whole patch rows.
    rows per unit (``scale``): how many positions of a value's token axis one unit holds: 1
        for LLM tokens, the patch-grid columns for DiT tokens (``cols · s``), the patch size
        for a latent's pixel rows (``p · s``), ``batch`` for tokens merged with the batch.
    prefix, suffix: the unsplit text segments before and after the split tokens (joint
        attention, see :mod:`tppc.passes.annotation.segments`). The first chunk of a step
        (``chunk_start == 0``) carries them: its value is ``[prefix | its rows | suffix]``;
        a later chunk's value is its rows alone. A K/V buffer holds
        ``[prefix | scale · seq_len rows | suffix]``: a chunk writes its rows at
        ``prefix + scale · chunk_start``, the first chunk the suffix after the last row.

In a ``specialized`` capture the graph runs only at the captured resolution: the scale is
read from the example's sizes (``s**2`` patches at ``s = 4`` rows: 4 per row), and constant
tensors as long as the token axis there (a positional table baked in as a buffer, a rope
table passed in) are cut to the chunk's rows like positional values.
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
from torch import fx

from tppc.errors import PassError
from tppc.ir.context import CompileContext
from tppc.ir.records import LAYER, PART, TOKEN, TokenInfo
from tppc.passes.annotation.segments import split_tokens
from tppc.passes.shapes import size_expr, tensor_val

__all__ = ["ABSENT", "REST_CHUNK", "baked_table_axis", "chunk_rows_size", "prefixed_size", "rest_of_step", "row_offset",
           "rows_per_unit", "split_size", "table_rows"]

_aten = torch.ops.aten
_SPLITS = {_aten.split_with_sizes.default, _aten.split.Tensor}

REST_CHUNK = "tppc.rest_chunk"
"""``GraphModule.meta`` key of the chunk step for the chunks after the first of a step, in a
model with a prefix segment (joint attention): it takes and computes only image tokens; the
text segment is carried by the first chunk."""


class _Absent:
    """A value the chunk step of a later chunk does not compute (text tokens only)."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT = _Absent()


def split_size(info: TokenInfo) -> sympy.Expr | None:
    """The size of the split part of a value's token axis (its axis size less the context
    segments: the prefix and the suffix)."""
    if info.axis_size is None:
        return None
    return sympy.expand(info.axis_size - info.prefix - info.suffix)


def rows_per_unit(size: sympy.Expr | None, ctx: CompileContext) -> int | None:
    """Positions per unit of an axis of the split ``size``, or None when not constant.

    Dynamic graphs need ``size = k · s`` with a constant ``k ≥ 1``; specialised graphs run
    at the example only, so ``size(example) / example`` must be a whole number.
    """
    if size is None or not size.free_symbols:
        return None
    sym, example = ctx.seq_symbol, ctx.example_seq
    if ctx.capture_mode == "specialized":
        at = size.xreplace({s: sympy.Integer(example) for s in size.free_symbols})
        ratio = sympy.Rational(int(at), example) if at.is_Integer else None
    else:
        ratio = sympy.simplify(size / sym)
    if ratio is None or not ratio.is_Integer or ratio < 1:
        return None
    return int(ratio)


def baked_table_axis(node: fx.Node, arg: fx.Node, ctx: CompileContext) -> int | None:
    """The axis of ``arg`` (a constant read by pointwise token op ``node``) along ``node``'s
    token axis, in a specialised graph; None when ``arg`` is not such a table.

    The constant broadcasts against ``node``'s value (aligned from the right) and is exactly
    as long as the token axis at the captured resolution (at least 2 positions).
    """
    if ctx.capture_mode != "specialized" or torch.Tag.pointwise not in getattr(node.target,
                                                                             "tags", ()):
        return None  # only a pointwise op broadcasts a table against the tokens
    info: TokenInfo = node.meta[TOKEN]
    out, val = tensor_val(node), tensor_val(arg)
    if info.axis is None or out is None or val is None or arg.meta[TOKEN].role != "const":
        return None
    j = info.axis - (out.dim() - val.dim())
    if j < 0 or j >= val.dim():
        return None
    length = int(info.axis_size.xreplace({s: sympy.Integer(ctx.example_seq)
                                          for s in info.axis_size.free_symbols}))
    return j if length >= 2 and int(size_expr(val.shape[j])) == length else None


def table_rows(graph: fx.Graph, env: dict[fx.Node, Any], node: fx.Node, table: fx.Node,
               axis: int, offset: Any) -> fx.Node:
    """The chunk's rows (from ``offset``) of a ``table`` baked in at the captured resolution,
    as many as the token input of ``node`` has."""
    info: TokenInfo = node.meta[TOKEN]
    token = next(a for a in node.all_input_nodes if a.meta[TOKEN].role in ("token", "mixing")
                 and a.meta[TOKEN].axis_size == info.axis_size)
    size = graph.call_function(_aten.sym_size.int, (env[token], token.meta[TOKEN].axis))
    rows = graph.call_function(_aten.narrow.default, (table, axis, offset, size))
    for new in (size, rows):
        new.meta[TOKEN], new.meta[LAYER] = TokenInfo("token"), node.meta.get(LAYER, "")
        if PART in node.meta:
            new.meta[PART] = node.meta[PART]
    return rows


def row_offset(graph: fx.Graph, start: Any, scale: int, prefix: int) -> Any:
    """``prefix + scale · start`` as a graph value (``start`` an int placeholder)."""
    value = start
    if scale != 1:
        value = graph.call_function(operator.mul, (value, scale))
        value.meta[TOKEN] = TokenInfo("positional")
    if prefix:
        value = graph.call_function(operator.add, (value, prefix))
        value.meta[TOKEN] = TokenInfo("positional")
    return value


def chunk_rows_size(expr: Any, ctx: CompileContext) -> bool:
    """A size of whole rows per unit after a constant prefix (``k·s + P``): read from the
    chunk's own shape, it is that chunk's size."""
    prefix = expr.as_coeff_Add()[0] if hasattr(expr, "as_coeff_Add") else 0
    return rows_per_unit(expr - prefix, ctx) is not None


def prefixed_size(node: fx.Node, ctx: CompileContext) -> int | None:
    """``k`` when ``node`` is a size ``P + k·s`` with a text prefix ``P > 0`` (a later chunk
    has ``k · chunk_size`` rows there), else None."""
    val = node.meta.get("val")
    if not isinstance(val, torch.SymInt):
        return None
    expr = size_expr(val)
    prefix = expr.as_coeff_Add()[0]
    if not prefix.is_Integer or prefix <= 0:
        return None
    return rows_per_unit(expr - prefix, ctx)


def rest_of_step(node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """How a later chunk's step (image tokens only) computes ``node``, or None (as usual).

    Text-only values are :data:`ABSENT`; a ``cat`` of text segments before the image tokens
    is the image tokens; a slice or split piece that keeps the image tokens is its source's
    image tokens; a split of a prefixed value is only a container of its pieces.
    """
    info: TokenInfo = node.meta[TOKEN]
    if info.role in ("token", "mixing") and info.prefix_only:
        return ABSENT
    if node.op != "call_function":
        return None
    base = node.args[0] if node.args else None
    src = base.meta[TOKEN] if isinstance(base, fx.Node) else None
    if node.target is _aten.cat.default and (info.prefix or info.suffix) and split_tokens(info) \
            and _dim(node, 1) == info.axis:
        dim = _dim(node, 1)
        return next(env[t] for t in node.args[0] if isinstance(t, fx.Node)
                    and size_expr(tensor_val(t).shape[dim]).free_symbols)
    context = src is not None and bool(src.prefix or src.suffix)
    if context and node.target in _SPLITS and _dim(node, 2, base) \
            == src.axis:
        return ABSENT
    if context and node.target is _aten.slice.Tensor \
            and _dim(node, 1, base) == src.axis and split_tokens(info):
        return env[base]
    if context and node.target is _aten.slice_scatter.default:
        written = _written_image_tokens(node, src)
        if written is not None:
            return env[written]
    if isinstance(base, fx.Node) and env.get(base) is ABSENT and base.target in _SPLITS:
        return env[base.args[0]] if split_tokens(info) else ABSENT
    if any(env.get(a) is ABSENT for a in node.all_input_nodes):
        raise PassError(
            f"node {node.name!r} ({node.target}) mixes text-only values with the image "
            "tokens outside joint attention; a later patch of a step carries no text tokens. "
            "fix: join text and image tokens with cat([text, image]) before attention")
    return None


def _written_image_tokens(node: fx.Node, src: TokenInfo) -> fx.Node | None:
    """The value a ``slice_scatter`` writes over every image token of its prefixed base
    (``x[:, k:] = y`` with ``k <= prefix``, functionalised): a later chunk's result is that
    value's image tokens; None for any other write."""
    args = list(node.args) + [None] * 6
    written, dim, start, end = args[1], args[2] or 0, args[3] or 0, args[4]
    if dim % tensor_val(node).dim() != src.axis or not isinstance(start, int) \
            or not isinstance(written, fx.Node) or args[5] not in (None, 1):
        return None
    info: TokenInfo = written.meta[TOKEN]
    whole = end is None or (isinstance(end, int) and end >= 2**62) or (
        isinstance(end, fx.Node) and src.axis_size is not None
        and sympy.simplify(size_expr(end.meta.get("val")) - src.axis_size) == 0)
    if whole and start <= src.prefix and split_tokens(info) and info.axis == src.axis \
            and info.prefix == src.prefix - start and info.suffix == src.suffix:
        return written
    return None


def _dim(node: fx.Node, index: int, of: fx.Node | None = None) -> int:
    dim = node.args[index] if len(node.args) > index else node.kwargs.get("dim", 0)
    return int(dim) % tensor_val(of if of is not None else node).dim()
