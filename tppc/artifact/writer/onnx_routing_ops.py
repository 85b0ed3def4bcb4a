"""ONNX translations of indexing and mixture-of-experts routing (the table :data:`ROUTING_OPS`).

Terms:
    routing: a router's ``softmax``/``topk`` picks ``k`` experts per token; transformers'
        ``grouped_mm`` experts then ``sort`` the (token, expert) pairs by expert, count them
        per expert (``histc``, ``cumsum``: the offsets), gather the tokens (``index``), run
        each expert's matmul on its rows (``transformers::grouped_mm_fallback``) and undo
        the sort (``index_put`` of an ``arange`` into ``empty_like``).
    grouped matmul: rows sorted by expert, expert ``i`` owning rows
        ``[offsets[i - 1], offsets[i])``. ONNX has no such op: a ``Loop`` over the experts
        slices each expert's rows, multiplies them by its weight and scatters them into the
        result, the grouped kernel's work (and a copy of the result per expert, which
        ``ScatterND`` makes).

An ``index``/``index_put`` with one index tensor (the other axes whole) is a
``Gather``/``ScatterND``; ``index`` with index tensors on every leading axis (transformers'
mask functions: ``mask[batch_idx, head_idx, q_idx, kv_idx]``) a ``GatherND``; other index
forms and boolean masks are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from onnx import helper
from torch import fx

from tppc.artifact.writer.graphs import ExportError
from tppc.artifact.writer.onnx_ops import Fn, Tensor, onnx_dtype

__all__ = ["ROUTING_OPS", "routing_op"]

_aten = torch.ops.aten


def _outputs(t: Any, op_type: str, inputs: list[str], count: int, **attrs: Any) -> list[str]:
    """An ONNX node with ``count`` outputs."""
    outs = [t.fresh(op_type.lower()) for _ in range(count)]
    t.nodes.append(helper.make_node(op_type, inputs, outs, **attrs))
    return outs


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _length(t: Any, x: Tensor, dim: int) -> str:
    """``x.shape[dim]`` as a 1-D int64 tensor."""
    d = _dim(dim, x.rank)
    return t.op("Shape", [x.name], start=d, end=d + 1)


def _cast_to(t: Any, x: Tensor, dtype: torch.dtype | None) -> Tensor:
    if dtype is None or dtype == x.dtype:
        return x
    return Tensor(t.op("Cast", [x.name], to=onnx_dtype(dtype)), dtype, x.rank)


def _softmax(t: Any, node: fx.Node, x: Tensor, dim: int, *_: Any) -> Tensor:
    """``softmax(x, dim)`` in the result's dtype (``softmax.int``'s ``dtype``,
    ``_softmax``'s ``half_to_float``: cast first)."""
    x = _cast_to(t, x, node.meta["val"].dtype)
    return t.tensor(node, t.op("Softmax", [x.name], axis=_dim(dim, x.rank)))


def _sum(t: Any, node: fx.Node, x: Tensor, dims: Any = None, keepdim: bool = False, *,
         dtype: torch.dtype | None = None) -> Tensor:
    x = _cast_to(t, x, dtype)
    axes = list(range(x.rank)) if not dims else [_dim(d, x.rank) for d in dims]
    return t.tensor(node, t.op("ReduceSum", [x.name, t.i64(axes)], keepdims=int(keepdim)))


def _topk(t: Any, node: fx.Node, x: Tensor, k: Any, dim: int = -1, largest: bool = True,
          sorted: bool = True) -> list[Tensor]:
    values, indices = _outputs(t, "TopK", [x.name, t.i64([k])], 2, axis=_dim(dim, x.rank),
                               largest=int(largest), sorted=1)
    return [Tensor(values, x.dtype, x.rank), Tensor(indices, torch.int64, x.rank)]


def _sort(t: Any, node: fx.Node, x: Tensor, dim: int = -1, descending: bool = False
          ) -> list[Tensor]:
    """A full ``TopK``; equal values keep their order (ONNX's rule): one permutation of
    the ones ``torch.sort`` may return."""
    values, indices = _outputs(t, "TopK", [x.name, _length(t, x, dim)], 2,
                               axis=_dim(dim, x.rank), largest=int(descending), sorted=1)
    return [Tensor(values, x.dtype, x.rank), Tensor(indices, torch.int64, x.rank)]


def _floor_divide(t: Any, node: fx.Node, a: Tensor, b: Any) -> Tensor:
    """Python's ``//``: ``(a - a mod b) / b`` on ints (``Mod`` takes the divisor's sign),
    ``Floor(a / b)`` on floats."""
    out = t.tensor(node, "")
    a_name, b_name = t.like(a, out), t.like(b, out)
    if out.dtype.is_floating_point:
        return t.tensor(node, t.op("Floor", [t.op("Div", [a_name, b_name])]))
    rest = t.op("Mod", [a_name, b_name], fmod=0)
    return t.tensor(node, t.op("Div", [t.op("Sub", [a_name, rest]), b_name]))


def _leading_indices(t: Any, node: fx.Node, x: Tensor, indices: list[Any]) -> Tensor:
    """``x[i0, i1, ...]`` with integer index tensors on the leading axes (broadcast
    together, as torch does): one ``GatherND`` over their stacked positions."""
    if not all(isinstance(i, Tensor) and i.dtype != torch.bool for i in indices):
        raise _index_error(node, len(indices))
    shape = None
    for i in indices:  # the broadcast shape: Max of the shapes, padded to one rank
        rank = max(j.rank for j in indices)
        dims = t.op("Shape", [i.name])
        if i.rank < rank:
            dims = t.op("Concat", [t.const([1] * (rank - i.rank)), dims], axis=0)
        shape = dims if shape is None else t.op("Max", [shape, dims])
    stacked = [t.op("Unsqueeze", [t.op("Expand", [t.op("Cast", [i.name],
                                                          to=onnx_dtype(torch.int64)), shape]),
                                  t.i64([-1])]) for i in indices]
    positions = t.op("Concat", stacked, axis=-1)
    return t.tensor(node, t.op("GatherND", [x.name, positions]))


def _index_error(node: fx.Node, count: int) -> ExportError:
    return ExportError(f"node {node.name!r} ({node.target}) indexes with {count} index "
                       "tensors not all on the leading axes, or a boolean mask; tppc's ONNX "
                       "export translates integer index tensors on the leading axes, or one "
                       "on any axis (the others whole). fix: run the torch backend, or "
                       "report the model")


def _diff(t: Any, node: fx.Node, x: Tensor, n: int = 1, dim: int = -1, prepend: Any = None,
          append: Any = None) -> Tensor:
    """``torch.diff`` (``n = 1``): ``y[k + 1] - y[k]`` of ``prepend ∥ x ∥ append``."""
    if n != 1:
        raise ExportError(f"node {node.name!r}: diff with n={n}; tppc's ONNX export "
                          "translates n=1. fix: run the torch backend")
    d = _dim(dim, x.rank)
    parts = [p.name for p in (prepend, x, append) if isinstance(p, Tensor)]
    y = t.op("Concat", parts, axis=d) if len(parts) > 1 else x.name
    big = 2**62
    later = t.op("Slice", [y, t.i64([1]), t.i64([big]), t.i64([d])])
    earlier = t.op("Slice", [y, t.i64([0]), t.i64([-1]), t.i64([d])])
    return t.tensor(node, t.op("Sub", [later, earlier]))


def _one_index(node: fx.Node, indices: Any) -> tuple[int, Tensor]:
    """The axis and tensor of the only index of ``x[..., idx, ...]``; refuses others."""
    given = [(d, i) for d, i in enumerate(indices) if i is not None]
    if len(given) != 1 or not isinstance(given[0][1], Tensor) \
            or given[0][1].dtype == torch.bool:
        raise _index_error(node, len(given))
    return given[0]


def _index(t: Any, node: fx.Node, x: Tensor, indices: Any) -> Tensor:
    if len(indices) > 1 and all(i is not None for i in indices):
        return _leading_indices(t, node, x, list(indices))
    axis, idx = _one_index(node, indices)
    return t.tensor(node, t.op("Gather", [x.name, idx.name], axis=axis))


def _index_put(t: Any, node: fx.Node, x: Tensor, indices: Any, values: Any,
               accumulate: bool = False) -> Tensor:
    axis, idx = _one_index(node, indices)
    if axis != 0:
        raise ExportError(f"node {node.name!r}: index_put on axis {axis}; tppc's ONNX export "
                          "writes rows of the first axis only. fix: run the torch backend")
    rows = t.op("Unsqueeze", [t.op("Cast", [idx.name], to=onnx_dtype(torch.int64)),
                              t.i64([-1])])
    shape = t.op("Concat", [t.op("Shape", [idx.name]), t.op("Shape", [x.name], start=1)],
                 axis=0)
    update = t.op("Expand", [t.like(values, x), shape])
    attrs = {"reduction": "add"} if accumulate else {}
    return t.tensor(node, t.op("ScatterND", [x.name, rows, update], **attrs))


def _empty_like(t: Any, node: fx.Node, x: Tensor, **_: Any) -> Tensor:
    """Zeros (every element an ``empty_like`` result is read at is written first)."""
    out = t.tensor(node, "")
    value = helper.make_tensor("value", onnx_dtype(out.dtype), [1], [0])
    return t.tensor(node, t.op("ConstantOfShape", [t.op("Shape", [x.name])], value=value))


def _histc(t: Any, node: fx.Node, x: Tensor, bins: int = 100, min: Any = 0,
           max: Any = 0) -> Tensor:
    """``torch.histc`` with fixed bounds: bin ``floor((v - min) · bins / (max - min))``,
    ``v = max`` in the last bin, values outside ``[min, max]`` not counted."""
    if not (isinstance(min, int | float) and isinstance(max, int | float)) or min >= max:
        raise ExportError(f"node {node.name!r}: histc with bounds [{min!r}, {max!r}]; tppc's "
                          "ONNX export needs fixed bounds min < max. fix: run the torch "
                          "backend")
    bins = int(bins)

    def c(v: float) -> str:
        return t.const(v, x.dtype)

    scaled = t.op("Div", [t.op("Mul", [t.op("Sub", [x.name, c(min)]), c(bins)]),
                          c(max - min)])
    slot = t.op("Min", [t.op("Cast", [t.op("Floor", [scaled])], to=onnx_dtype(torch.int64)),
                        t.const(bins - 1)])
    inside = t.op("And", [t.op("GreaterOrEqual", [x.name, c(min)]),
                          t.op("LessOrEqual", [x.name, c(max)])])
    hits = t.op("And", [t.op("Equal", [t.op("Unsqueeze", [slot, t.i64([-1])]),
                                       t.op("Range", [t.const(0), t.const(bins),
                                                      t.const(1)])]),
                        t.op("Unsqueeze", [inside, t.i64([-1])])])
    flat = t.op("Reshape", [hits, t.i64([-1, bins])])
    counts = t.op("ReduceSum", [t.op("Cast", [flat], to=onnx_dtype(x.dtype)), t.i64([0])],
                  keepdims=0)
    return t.tensor(node, counts)


def _cumsum(t: Any, node: fx.Node, x: Tensor, dim: int, *, dtype: Any = None) -> Tensor:
    """``torch.cumsum`` in its result's dtype (booleans count as int64)."""
    x = _cast_to(t, x, node.meta["val"].dtype)
    return t.tensor(node, t.op("CumSum", [x.name, t.const(_dim(dim, x.rank))]))


def _grouped_mm(t: Any, node: fx.Node, rows: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """``transformers::grouped_mm_fallback(rows, weight, offs)`` (module docstring): an ONNX
    ``Loop`` over the experts, expert ``i`` multiplying its rows ``[offsets[i - 1],
    offsets[i])`` by ``weight[i]`` and scattering them into the result (rows past the last
    offset stay 0, as the fallback leaves them)."""
    experts = int(node.args[1].meta["val"].shape[0])
    out_dim = int(node.args[1].meta["val"].shape[2])
    bounds = t.op("Concat", [t.const([0]), t.op("Cast", [offs.name],
                                                 to=onnx_dtype(torch.int64))], axis=0)
    shape = t.op("Concat", [t.op("Shape", [rows.name], start=0, end=1), t.const([out_dim])],
                 axis=0)
    value = helper.make_tensor("value", onnx_dtype(rows.dtype), [1], [0])
    zeros = t.op("ConstantOfShape", [shape], value=value)
    step, cond, before = t.fresh("expert"), t.fresh("cond"), t.fresh("before")
    outer, t.nodes = t.nodes, []
    start = t.op("Gather", [bounds, step], axis=0)
    end = t.op("Gather", [bounds, t.op("Add", [step, t.const(1)])], axis=0)
    own = t.op("Slice", [rows.name, t.op("Unsqueeze", [start, t.i64([0])]),
                         t.op("Unsqueeze", [end, t.i64([0])]), t.i64([0])])
    product = t.op("MatMul", [own, t.op("Gather", [weight.name, step], axis=0)])
    where = t.op("Unsqueeze", [t.op("Range", [start, end, t.const(1)]), t.i64([-1])])
    after = t.op("ScatterND", [before, where, product])
    cond_out = t.op("Identity", [cond])
    body_nodes, t.nodes = t.nodes, outer
    dtype = onnx_dtype(rows.dtype)
    body = helper.make_graph(
        body_nodes, t.fresh("experts"),
        [helper.make_tensor_value_info(step, onnx_dtype(torch.int64), []),
         helper.make_tensor_value_info(cond, onnx_dtype(torch.bool), []),
         helper.make_tensor_value_info(before, dtype, [None, out_dim])],
        [helper.make_tensor_value_info(cond_out, onnx_dtype(torch.bool), []),
         helper.make_tensor_value_info(after, dtype, [None, out_dim])])
    out = t.fresh("grouped_mm")
    t.nodes.append(helper.make_node("Loop", [t.const(experts), "", zeros], [out], body=body))
    return t.tensor(node, out)


ROUTING_OPS: dict[Any, Fn] = {
    _aten.softmax.int: _softmax, _aten._softmax.default: _softmax,
    _aten.sum.dim_IntList: _sum, _aten.topk.default: _topk, _aten.sort.default: _sort,
    _aten.floor_divide.default: _floor_divide, _aten.index.Tensor: _index,
    _aten.index_put.default: _index_put, _aten.empty_like.default: _empty_like,
    _aten.histc.default: _histc, _aten.cumsum.default: _cumsum, _aten.diff.default: _diff,
}
"""ATen op → translation (``fn(translator, node, *args, **kwargs)``), as in ``OPS``."""

_BY_NAME: dict[str, Fn] = {"transformers.grouped_mm_fallback.default": _grouped_mm}


def routing_op(target: Any) -> Fn | None:
    """The translation of another library's op (registered when that library is imported,
    so named here, not held): transformers' grouped expert matmul; None for any other."""
    return _BY_NAME.get(str(target))
