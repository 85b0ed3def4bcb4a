"""ONNX translations of the elementwise ops that build masks and float attention biases.

A float bias (ALiBi, a T5-style bucketed relative-position table, a learned table sliced
``[:L, :L]``) is evaluated per chunk inside a stage graph (:mod:`tppc.passes.chunking.bias_rows`):
compares, ``where``/``masked_fill``, ``clamp``, logs and casts of positions, and ``expand``.
This table adds them to :data:`tppc.artifact.writer.onnx_ops.OPS`. Operands are cast to the type
torch promotes them to (an int position compared with a float is compared as a float).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from onnx import helper
from torch import fx

from tppc.errors import ExportError

__all__ = ["MASK_OPS"]

_aten = torch.ops.aten


def _onnx(dtype: torch.dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(str(dtype).removeprefix("torch.")))


def _as(t: Any, value: Any, dtype: torch.dtype) -> str:
    """``value`` (a translated tensor, a dynamic int or a Python number) as ``dtype``."""
    if hasattr(value, "rank"):  # a tensor
        return value.name if value.dtype == dtype else t.op("Cast", [value.name],
                                                             to=_onnx(dtype))
    if hasattr(value, "name"):  # a dynamic int
        return t.op("Cast", [value.name], to=_onnx(dtype))
    return t.const(value, dtype)


def _promoted(node: fx.Node, count: int) -> torch.dtype:
    """The dtype torch computes the node's first ``count`` operands in."""
    samples = [torch.empty(1, dtype=a.meta["val"].dtype) if isinstance(a, fx.Node) else a
               for a in node.args[:count]]
    return torch.result_type(*samples) if len(samples) > 1 else samples[0].dtype


def _out(node: fx.Node) -> torch.dtype:
    return node.meta["val"].dtype


def _compare(op_type: str, negate: bool = False) -> Callable[..., Any]:
    def fn(t: Any, node: fx.Node, a: Any, b: Any) -> Any:
        dtype = _promoted(node, 2)
        out = t.op(op_type, [_as(t, a, dtype), _as(t, b, dtype)])
        return t.tensor(node, t.op("Not", [out]) if negate else out)
    return fn


def _logical(op_type: str) -> Callable[..., Any]:
    def fn(t: Any, node: fx.Node, *xs: Any) -> Any:
        dtype = _out(node)
        if dtype != torch.bool:
            raise _not_bool(node)
        return t.tensor(node, t.op(op_type, [_as(t, x, dtype) for x in xs]))
    return fn


def _unary(op_type: str) -> Callable[..., Any]:
    def fn(t: Any, node: fx.Node, x: Any, *_: Any, **__: Any) -> Any:
        return t.tensor(node, t.op(op_type, [_as(t, x, _out(node))]))
    return fn


def _where(t: Any, node: fx.Node, cond: Any, a: Any, b: Any) -> Any:
    dtype = _out(node)
    return t.tensor(node, t.op("Where", [cond.name, _as(t, a, dtype), _as(t, b, dtype)]))


def _masked_fill(t: Any, node: fx.Node, x: Any, mask: Any, value: Any) -> Any:
    dtype = _out(node)
    return t.tensor(node, t.op("Where", [mask.name, _as(t, value, dtype), _as(t, x, dtype)]))


def _clamp(t: Any, node: fx.Node, x: Any, min: Any = None, max: Any = None) -> Any:
    dtype = _out(node)
    out = _as(t, x, dtype)
    if min is not None:
        out = t.op("Max", [out, _as(t, min, dtype)])
    if max is not None:
        out = t.op("Min", [out, _as(t, max, dtype)])
    return t.tensor(node, out)


def _reduce_max(t: Any, node: fx.Node, x: Any) -> Any:
    """``x.max()`` over every axis (a dynamic rope's ``max(position_ids)``)."""
    return t.tensor(node, t.op("ReduceMax", [_as(t, x, _out(node))], keepdims=0))


def _maximum(t: Any, node: fx.Node, a: Any, b: Any) -> Any:
    dtype = _out(node)
    return t.tensor(node, t.op("Max", [_as(t, a, dtype), _as(t, b, dtype)]))


def _expand(t: Any, node: fx.Node, x: Any, sizes: Any, *, implicit: bool = False) -> Any:
    """ONNX ``Expand`` broadcasts both ways, so torch's ``-1`` (keep) is a 1 there."""
    shape = [1 if isinstance(s, int) and s == -1 else s for s in sizes]
    return t.tensor(node, t.op("Expand", [x.name, t.i64(shape)]))


def _not_bool(node: fx.Node) -> ExportError:
    return ExportError(f"node {node.name!r} ({node.target}) is a bitwise op on non-boolean "
                       "values; tppc's ONNX export translates logical ops on masks only. "
                       "fix: run the torch backend")


MASK_OPS: dict[Any, Callable[..., Any]] = {}
"""ATen op → translation (``fn(translator, node, *args, **kwargs)``), as in ``OPS``; also the
whole-call reductions of a length-dependent rope (``max``, ``maximum``)."""
_COMPARES = {"gt": "Greater", "lt": "Less", "ge": "GreaterOrEqual", "le": "LessOrEqual",
             "eq": "Equal"}
for _name, _op in _COMPARES.items():
    MASK_OPS[getattr(_aten, _name).Tensor] = _compare(_op)
    MASK_OPS[getattr(_aten, _name).Scalar] = _compare(_op)
MASK_OPS.update({
    _aten.ne.Tensor: _compare("Equal", negate=True),
    _aten.ne.Scalar: _compare("Equal", negate=True),
    _aten.where.self: _where, _aten.where.ScalarOther: _where,
    _aten.where.ScalarSelf: _where, _aten.where.Scalar: _where,
    _aten.masked_fill.Scalar: _masked_fill, _aten.masked_fill.Tensor: _masked_fill,
    _aten.clamp.default: _clamp, _aten.clamp.Tensor: _clamp,
    _aten.log.default: _unary("Log"), _aten.abs.default: _unary("Abs"),
    _aten.floor.default: _unary("Floor"), _aten.sqrt.default: _unary("Sqrt"),
    _aten.reciprocal.default: _unary("Reciprocal"),
    _aten.__and__.Tensor: _logical("And"), _aten.bitwise_and.Tensor: _logical("And"),
    _aten.__or__.Tensor: _logical("Or"), _aten.bitwise_or.Tensor: _logical("Or"),
    _aten.logical_not.default: _logical("Not"), _aten.bitwise_not.default: _logical("Not"),
    _aten.expand.default: _expand,
    _aten.max.default: _reduce_max, _aten.maximum.default: _maximum,
})
