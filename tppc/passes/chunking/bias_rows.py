"""The rows of an additive float attention bias for one chunk, never the bias' ``L × L`` whole.

Terms:
    bias: an attention mask (``attn_mask`` of SDPA) with float values other than 0 and
        ``-inf`` where keys are visible: ALiBi (a slope times the distance), a T5-style
        relative-position table looked up by bucketed distance, a learned absolute table
        sliced ``[:L, :L]``. Annotation proved it positional (it depends on positions,
        constants, parameters and integer inputs such as ``attention_mask`` only) and its
        visibility pattern causal, windowed or all-visible (:class:`MaskSpec` ``bias``).
    rows: the bias of the chunk's queries ``[chunk_start, chunk_start + chunk_size)`` over
        every key: ``bias[..., chunk_start:chunk_start + chunk_size, :]``.
    small value: a value with at most one axis whose size depends on the sequence length
        (an ``arange``, ALiBi's slopes × key positions, a table of ``L`` rows): ``O(L)``
        elements, evaluated whole in the chunk step at ``seq_len`` and narrowed.

The query axis (the mask's second-to-last) is followed back from the mask through the ops
that keep it: broadcasting elementwise ops (``add``, ``where``, ``masked_fill``, compares,
casts), ``expand``, ``unsqueeze``, ``permute``/``transpose``, views that keep the axis,
slices of other axes or from 0 along it, and lookups by an index value (``embedding``,
``table[index]``). An
input broadcast along the query axis is evaluated whole; a small value is evaluated whole
and narrowed to the chunk's rows. So a chunk builds ``O(chunk_size · L)`` elements (its
rows), and a call never builds the ``L × L`` bias. Any other op on the way is refused by
name (:class:`PassError`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch import fx

from tppc.errors import PassError
from tppc.ir.context import CompileContext
from tppc.ir.records import TOKEN, TokenInfo
from tppc.passes.chunking.token_rows import row_offset
from tppc.passes.shapes import ancestors, module_path, seq_axes, size_expr, tensor_val

__all__ = ["BiasRows", "value_inputs"]

_aten = torch.ops.aten
_ELEMENTWISE_EXTRA = {
    _aten.where.ScalarOther, _aten.where.ScalarSelf, _aten.where.Scalar,
    _aten.__and__.Tensor, _aten.__or__.Tensor, _aten.__xor__.Tensor, _aten._to_copy.default,
    _aten.clone.default, _aten.alias.default, _aten.to.dtype_layout, _aten.contiguous.default, _aten.detach.default,
    _aten.to.dtype, _aten.type_as.default, _aten.lift_fresh_copy.default,
}
_VIEWS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}


def value_inputs(mask: fx.Node) -> list[fx.Node]:
    """The user inputs whose values ``mask`` reads (not only their length), graph order."""
    closure = ancestors([mask])
    return [p for p in mask.graph.find_nodes(op="placeholder") if p in closure
            and any(u in closure and u.target is not _aten.sym_size.int for u in p.users)]


def _elementwise(target: Any) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.pointwise in tags or target in _ELEMENTWISE_EXTRA


class BiasRows:
    """Emits, into a chunk-step graph, the chunk's rows of float attention biases.

    Args:
        graph: the chunk-step graph being built.
        ctx: the compile context (sequence symbol, sequence inputs).
        sizes: the graph's ``(chunk_start, chunk_size, seq_len)`` placeholders.
        user_input: the chunk-step placeholder that holds user input ``p`` whole.
    """

    def __init__(self, graph: fx.Graph, ctx: CompileContext,
                 sizes: tuple[fx.Node, fx.Node, fx.Node],
                 user_input: Callable[[fx.Node], fx.Node]) -> None:
        self.graph, self.ctx, self.sym = graph, ctx, ctx.seq_symbol
        self.start, self.size, self.seq_len = sizes
        self.user_input = user_input
        self.whole_env: dict[fx.Node, Any] = {}
        self.rows_env: dict[tuple[fx.Node, int, Any], fx.Node] = {}
        self.attention: fx.Node | None = None
        self.window: tuple[Any, Any, Any] = (self.sym, self.start, self.size)
        """The query axis' extent and the chunk's rows on it: ``(extent, first, count)``."""

    def joint_rows(self, mask: fx.Node, attention: fx.Node, carry: bool) -> fx.Node:
        """The rows of a joint mask (``MaskSpec.query_rows``: Chroma's ``m[:, None, None, :]
        * m[:, None, :, None]`` over ``[text | image]``) for the chunk's queries over every
        key. The first chunk of a step (``carry``, at ``chunk_start`` 0) holds the text rows
        and its image rows, ``[0, prefix + scale · chunk_size)``; a later chunk its image rows,
        ``[prefix + scale · chunk_start, … + scale · chunk_size)``."""
        self.attention = attention
        info: TokenInfo = attention.meta[TOKEN]
        val = tensor_val(mask)
        rows = sympy.expand(size_expr(info.axis_size) - info.prefix) \
            if info.axis_size is not None else sympy.S.Zero
        scale = rows / self.sym
        scale = int(scale) if scale.is_Integer and scale > 0 else 0
        if info.suffix or not scale or val is None or val.dim() < 2 \
                or sympy.expand(size_expr(val.shape[-2]) - size_expr(info.axis_size)) != 0:
            raise self._refuse(mask, f"it is not a mask over the attention's queries "
                               f"[text | tokens] ({info.axis_size} rows, prefix {info.prefix}, "
                               f"suffix {info.suffix})")
        first = row_offset(self.graph, self.start, scale, 0 if carry else info.prefix)
        count = row_offset(self.graph, self.size, scale, info.prefix if carry else 0)
        saved, self.window = self.window, (info.axis_size, first, count)
        try:
            return self._rows(mask, val.dim() - 2)
        finally:
            self.window = saved

    def rows(self, mask: fx.Node, attention: fx.Node, kv_len: fx.Node | None) -> fx.Node:
        """The rows of ``mask`` (the bias of ``attention``) for the chunk over the keys
        ``[0, kv_len)`` (None: every key). A causal chunk's later keys are hidden from every
        row anyway."""
        self.attention = attention
        info: TokenInfo = attention.meta[TOKEN]
        if info.prefix or info.axis_size != self.sym:
            raise self._refuse(mask, "the attention's tokens are patch rows or follow a text "
                               "prefix; biases are evaluated over token positions only")
        val = tensor_val(mask)
        if val is None or val.dim() < 2:
            raise self._refuse(mask, "it has no query axis (fewer than two dimensions)")
        rows = self._rows(mask, val.dim() - 2)
        if kv_len is None or size_expr(val.shape[-1]) != self.sym:
            return rows
        return self._new(_aten.narrow.default, (rows, -1, 0, kv_len), like=mask)

    # -- the query axis, followed back ------------------------------------------------------
    def _rows(self, node: fx.Node, axis: int) -> fx.Node:
        key = (node, axis, self.window[1:])
        if key not in self.rows_env:
            self.rows_env[key] = self._rows_of(node, axis)
        return self.rows_env[key]

    def _rows_of(self, node: fx.Node, axis: int) -> fx.Node:
        val = tensor_val(node)
        if val is None:
            raise self._refuse(node, "it has no tensor metadata (meta['val'])")
        extent, first, count = self.window
        if sympy.simplify(size_expr(val.shape[axis]) - extent) != 0:
            raise self._refuse(node, f"its query axis {axis} has {val.shape[axis]} positions, "
                               f"not the attention's {extent}")
        if len(seq_axes(node, self.sym)[0]) <= 1:  # O(L): whole, then the chunk's rows
            return self._new(_aten.narrow.default, (self._whole(node), axis, first, count),
                             like=node)
        target = node.target
        if node.op == "call_function" and _elementwise(target):
            return self._new(target, *self._broadcast_args(node, axis), like=node)
        if target is _aten.expand.default:
            sizes = [self._whole(s) for s in node.args[1]]
            sizes[axis] = count
            return self._new(target, (self._arg_rows(node.args[0], node, axis), sizes), like=node)
        if target is _aten.unsqueeze.default:
            d = node.args[1] % val.dim()
            source = self._rows(node.args[0], axis if axis < d else axis - 1)
            return self._new(target, (source, d), like=node)
        if target is _aten.permute.default:
            dims = [d % val.dim() for d in node.args[1]]
            return self._new(target, (self._rows(node.args[0], dims[axis]), dims), like=node)
        if target is _aten.transpose.int:
            d0, d1 = (d % val.dim() for d in node.args[1:3])
            source = d1 if axis == d0 else d0 if axis == d1 else axis
            return self._new(target, (self._rows(node.args[0], source), d0, d1), like=node)
        if target in _VIEWS:
            return self._view(node, axis)
        if target is _aten.slice.Tensor:
            return self._slice(node, axis)
        if target is _aten.index.Tensor:
            return self._index(node, axis)
        if target is _aten.embedding.default and axis < val.dim() - 1:
            weight, index = node.args[0], node.args[1]
            args = (self._whole(weight), self._rows(index, axis), *node.args[2:])
            return self._new(target, args, like=node)
        raise self._refuse(node, f"its op {target} works across the query axis")

    def _broadcast_args(self, node: fx.Node, axis: int) -> tuple[tuple, dict]:
        def one(a: Any) -> Any:
            return self._arg_rows(a, node, axis) if isinstance(a, fx.Node) else a
        args = tuple(one(a) for a in node.args)
        kwargs = {k: one(v) for k, v in node.kwargs.items()}
        return args, kwargs

    def _arg_rows(self, arg: Any, node: fx.Node, axis: int) -> Any:
        """``arg`` of ``node`` (broadcast to its shape) restricted to the chunk's rows."""
        if not isinstance(arg, fx.Node) or tensor_val(arg) is None:
            return self._whole(arg)
        return self._arg_rows_at(arg, axis, tensor_val(node).dim())

    def _view(self, node: fx.Node, axis: int) -> fx.Node:
        source = node.args[0]
        src, out = tensor_val(source).shape, tensor_val(node).shape
        before = sympy.Mul(*(size_expr(s) for s in out[:axis]))
        for k in range(len(src)):
            if sympy.simplify(size_expr(src[k]) - self.window[0]) == 0 and \
                    sympy.simplify(sympy.Mul(*(size_expr(s) for s in src[:k])) - before) == 0:
                sizes = [self._whole(s) for s in node.args[1]]
                sizes[axis] = self.window[2]
                return self._new(node.target, (self._rows(source, k), sizes), like=node)
        raise self._refuse(node, "it is a view that does not keep the query axis")

    def _index(self, node: fx.Node, axis: int) -> fx.Node:
        """``x[i0, i1, ...]`` with adjacent index tensors (``table[distance]``): the query axis
        is one of the indices' broadcast axes, or an axis of ``x`` outside them."""
        source, indices = node.args[0], list(node.args[1])
        used = [k for k, i in enumerate(indices) if i is not None]
        if used != list(range(used[0], used[0] + len(used))):
            raise self._refuse(node, "it indexes with tensors on axes that are not adjacent")
        first = used[0]
        span = tensor_val(node).dim() - tensor_val(source).dim() + len(used)
        if first <= axis < first + span:  # the rows of every index, the source whole
            new = [None if i is None else self._arg_rows_at(i, axis - first, span)
                   for i in indices]
            return self._new(node.target, (self._whole(source), new), like=node)
        src_axis = axis if axis < first else axis - span + len(used)
        new = [None if i is None else self._whole(i) for i in indices]
        return self._new(node.target, (self._rows(source, src_axis), new), like=node)

    def _arg_rows_at(self, arg: fx.Node, axis: int, rank: int) -> Any:
        """``arg`` broadcast to ``rank`` dimensions, restricted to the chunk's rows."""
        val = tensor_val(arg)
        in_axis = axis - (rank - val.dim())
        if in_axis < 0 or size_expr(val.shape[in_axis]) == 1:
            return self._whole(arg)
        return self._rows(arg, in_axis)

    def _slice(self, node: fx.Node, axis: int) -> fx.Node:
        args = list(node.args) + [None] * (5 - len(node.args))
        source, dim, start, _end, step = args[:5]
        dim = (dim or 0) % tensor_val(node).dim()
        if dim != axis:
            rest = [self._whole(a) for a in node.args[1:]]
            return self._new(node.target, (self._rows(source, axis), *rest), like=node)
        if start not in (0, None) or step not in (1, None):
            raise self._refuse(node, f"it slices the query axis from {start} by {step}; "
                               "only leading slices ([:L]) keep row positions")
        return self._rows(source, axis)

    # -- values broadcast along the query axis, evaluated whole ------------------------------
    def whole(self, node: fx.Node) -> Any:
        """``node`` evaluated whole in the chunk step at ``seq_len`` (a key mask: one row
        over the keys, :mod:`tppc.passes.annotation.key_masks`)."""
        return self._whole(node)

    def _whole(self, node: Any) -> Any:
        if isinstance(node, list | tuple):
            return type(node)(self._whole(a) for a in node)
        if not isinstance(node, fx.Node):
            return node
        if node not in self.whole_env:
            self.whole_env[node] = self._whole_of(node)
        return self.whole_env[node]

    def _whole_of(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            return self.user_input(node)
        if node.op == "get_attr":
            new = self.graph.get_attr(str(node.target))
            new.meta.update(node.meta)
            new.meta[TOKEN] = TokenInfo("const")
            return new
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            expr = size_expr(val)
            if expr == self.sym:
                return self.seq_len
            if not expr.free_symbols:
                return int(expr)
            scale, offset = sympy.Poly(expr, self.sym).all_coeffs() \
                if expr.free_symbols == {self.sym} and expr.is_polynomial(self.sym) \
                and sympy.degree(expr, self.sym) == 1 \
                else (None, None)
            if scale is not None and scale.is_Integer and offset.is_Integer and scale > 0 \
                    and offset >= 0:  # a size k·L + c (text after the image): from seq_len
                return row_offset(self.graph, self.seq_len, int(scale), int(offset))
        elif len(seq_axes(node, self.sym)[0]) > 1:
            raise self._refuse(node, "it would be evaluated whole over query and key "
                               "positions (L x L)")
        if node.op != "call_function":
            raise self._refuse(node, f"it is a {node.op} node")
        args = fx.node.map_arg(node.args, self._whole)
        kwargs = fx.node.map_arg(node.kwargs, self._whole)
        return self._new(node.target, args, kwargs, like=node)

    def _new(self, target: Any, args: tuple, kwargs: dict[str, Any] | None = None, *,
             like: fx.Node) -> fx.Node:
        """A positional node: every stage that reads it computes it (it is never sent). Its
        ``meta["val"]`` is ``like``'s (the dtype and rank the ONNX translation reads; its
        query axis has the model's length, not the chunk's)."""
        node = self.graph.call_function(target, args, kwargs or {})
        node.meta[TOKEN] = TokenInfo("positional")
        if "val" in like.meta:
            node.meta["val"] = like.meta["val"]
        return node

    def _refuse(self, node: fx.Node, why: str) -> PassError:
        attn = self.attention
        where = module_path(attn) if attn is not None else ""
        return PassError(
            f"the float attention bias (attn_mask) of attention node "
            f"{getattr(attn, 'name', '?')!r} (module {where or '<top level>'}) cannot be "
            f"evaluated row by row at node {node.name!r} ({node.target}): {why}. tppc "
            "evaluates a bias per chunk through elementwise ops, expand, views, permutes, "
            "slices and lookups (embedding, table[index]) of positions. fix: build the bias from positions "
            "with those ops (ALiBi, relative-position tables), or pass a boolean mask")
