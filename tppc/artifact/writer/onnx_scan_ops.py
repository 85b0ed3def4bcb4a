"""ONNX translations of the ops recurrent layers add (the table :data:`SCAN_OPS`).

Terms as in :mod:`tppc.passes.annotation.recurrent` (scan, causal convolution). ``cumsum``
is ONNX's ``CumSum`` (:mod:`tppc.artifact.writer.onnx_routing_ops`); the scans ONNX lacks
run as an ONNX ``Scan`` over the token axis, one step per row, in the order torch's CPU
kernels combine them:

- ``logcumsumexp``: ``h_t = max(h, x) + log(1 + exp(−|h − x|))`` from ``h = −inf`` (no
  global shift, so no row underflows however far the values spread along a long chunk);
- ``cumprod``: ``h_t = h · x`` from ``h = 1``.

16-bit floats are scanned in float32 and rounded back. ``softplus`` keeps torch's
threshold (``x`` where ``β·x > threshold``); ``pad`` (a sequence padded to whole blocks of a
block scan, by a size computed from the length) is ONNX's ``Pad`` with the constant.
"""

from __future__ import annotations

from typing import Any

import torch
from onnx import helper
from torch import fx

from tppc.artifact.writer.graphs import ExportError
from tppc.artifact.writer.onnx_ops import Fn, Tensor, onnx_dtype

__all__ = ["SCAN_OPS"]

_aten = torch.ops.aten


def _softplus(t: Any, node: fx.Node, x: Tensor, beta: float = 1.0,
              threshold: float = 20.0) -> Tensor:
    """``softplus(x) = log(1 + exp(β·x)) / β``, ``x`` where ``β·x > threshold``."""
    bx = x.name if beta == 1 else t.op("Mul", [x.name, t.const(beta, x.dtype)])
    soft = t.op("Softplus", [bx])
    if beta != 1:
        soft = t.op("Div", [soft, t.const(beta, x.dtype)])
    linear = t.op("Greater", [bx, t.const(threshold, x.dtype)])
    return t.tensor(node, t.op("Where", [linear, x.name, soft]))


def _pad(t: Any, node: fx.Node, x: Tensor, pad: Any, mode: str = "constant",
         value: float | None = None) -> Tensor:
    """``F.pad`` with a constant (a sequence padded to whole blocks: sizes may be dynamic)."""
    if mode != "constant":
        raise ExportError(f"node {node.name!r} pads in mode {mode!r}; tppc exports constant "
                          "padding only. fix: report the model")
    pairs = [(pad[i], pad[i + 1]) for i in range(0, len(pad), 2)]  # last axis first
    begin = [0] * (x.rank - len(pairs)) + [p[0] for p in reversed(pairs)]
    end = [0] * (x.rank - len(pairs)) + [p[1] for p in reversed(pairs)]
    fill = t.const(0.0 if value is None else value, x.dtype)
    return t.tensor(node, t.op("Pad", [x.name, t.i64([*begin, *end]), fill], mode="constant"))


def _triangle(upper: int) -> Fn:
    """``tril``/``triu`` (a block scan's causal masks): ONNX's ``Trilu``."""
    def fn(t: Any, node: fx.Node, x: Tensor, diagonal: Any = 0) -> Tensor:
        return t.tensor(node, t.op("Trilu", [x.name, t.scalar(diagonal)], upper=upper))
    return fn


def _scan(t: Any, node: fx.Node, x: Tensor, dim: int, start: float,
          step: Any) -> Tensor:
    """An ONNX ``Scan`` of ``x`` along ``dim`` from the state ``start``:
    ``step(t, h, row)`` emits the body's nodes and returns the new state (= the output row)."""
    out_dtype = node.meta["val"].dtype
    work = torch.float32 if out_dtype in (torch.float16, torch.bfloat16) else out_dtype
    name = x.name if x.dtype == work else t.op("Cast", [x.name], to=onnx_dtype(work))
    axis = dim + x.rank if dim < 0 else dim
    first = t.op("Gather", [name, t.const(0)], axis=axis)  # the shape of one row
    init = t.op("Expand", [t.const(start, work), t.op("Shape", [first])])
    h, row = t.fresh("state"), t.fresh("row")
    outer, t.nodes = t.nodes, []
    new = step(t, h, row, work)
    state_out, row_out = t.op("Identity", [new]), t.op("Identity", [new])
    body_nodes, t.nodes = t.nodes, outer
    kind = onnx_dtype(work)
    body = helper.make_graph(
        body_nodes, t.fresh("scan"),
        [helper.make_tensor_value_info(h, kind, None),
         helper.make_tensor_value_info(row, kind, None)],
        [helper.make_tensor_value_info(state_out, kind, None),
         helper.make_tensor_value_info(row_out, kind, None)])
    last, scanned = t.fresh("last"), t.fresh("scanned")
    t.nodes.append(helper.make_node("Scan", [init, name], [last, scanned], body=body,
                                    num_scan_inputs=1, scan_input_axes=[axis],
                                    scan_output_axes=[axis]))
    if work != out_dtype:
        scanned = t.op("Cast", [scanned], to=onnx_dtype(out_dtype))
    return t.tensor(node, scanned)


def _log_add_exp(t: Any, h: str, row: str, dtype: torch.dtype) -> str:
    """``max(h, x) + log(1 + exp(−|h − x|))``; ``max`` itself where it is infinite."""
    top = t.op("Max", [h, row])
    gap = t.op("Neg", [t.op("Abs", [t.op("Sub", [h, row])])])
    total = t.op("Add", [top, t.op("Log", [t.op("Add", [t.const(1.0, dtype),
                                                         t.op("Exp", [gap])])])])
    return t.op("Where", [t.op("IsInf", [top]), top, total])


def _logcumsumexp(t: Any, node: fx.Node, x: Tensor, dim: int) -> Tensor:
    return _scan(t, node, x, dim, float("-inf"), _log_add_exp)


def _cumprod(t: Any, node: fx.Node, x: Tensor, dim: int, *, dtype: Any = None) -> Tensor:
    return _scan(t, node, x, dim, 1.0, lambda t, h, row, _: t.op("Mul", [h, row]))


SCAN_OPS: dict[Any, Fn] = {
    _aten.softplus.default: _softplus, _aten.logcumsumexp.default: _logcumsumexp,
    _aten.cumprod.default: _cumprod, _aten.pad.default: _pad,
    _aten.tril.default: _triangle(0), _aten.triu.default: _triangle(1),
}
"""ATen op → translation (``fn(translator, node, *args, **kwargs)``), as in ``OPS``."""
