"""ONNX translation of a re-rolled loop (:class:`tppc.ir.loop_scan.LoopScan`): an ONNX ``Loop``.

Terms as in :mod:`tppc.ir.loop_scan` (step, carries, rows, invariants, outputs). The chunk
step calls the loop's stateful form ``(carries, *xs, *invariants) -> (outputs, *finals)``
(:mod:`tppc.passes.chunking.carried_state`); its translation is one ``Loop`` whose trip
count is the size of the first sliced input along its token axis and whose body is the step
graph translated by the same op table: each iteration gathers its rows (``Gather(x, i,
axis)``, torch's ``select``; for a loop over blocks of ``b`` rows ``Slice`` of rows
``[i·b, (i+1)·b)``), reads the invariants from the enclosing graph, passes the carries on and
emits the step's output as the loop's scan output, stacked on a new first axis and moved to
the loop's stacking axis after the loop (merged with the block's rows there for blocks). The ops run in the unrolled
loop's order, position by position.

Example:
    >>> loop_op(node.target)(translator, node, *args)         # doctest: +SKIP
    (<Tensor outputs>, <Tensor final carry>)
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from onnx import TensorProto, helper
from torch import fx

from tppc.artifact.writer.onnx_ops import Fn, Tensor, onnx_dtype
from tppc.errors import ExportError
from tppc.ir.loop_scan import LoopScan

__all__ = ["loop_op"]

_BODIES = itertools.count()


def loop_op(target: object) -> Fn | None:
    """The translation of a loop's stateful form, or None for any other target."""
    if isinstance(target, LoopScan) and target.with_state:
        return _loop
    return None


def _loop(t: Any, node: fx.Node, *args: Any) -> tuple[Tensor, ...]:
    loop: LoopScan = node.target
    carries, xs, invariants = loop.split(args)
    if not all(isinstance(a, Tensor) for a in (*carries, *xs, *invariants)):
        raise ExportError(f"re-rolled loop {node.name!r} ({loop.source}) reads a value that is "
                          "no tensor; tppc exports loops over tensors only. fix: run this "
                          "model with backend='torch'")
    body = _body(t, loop, xs, invariants)
    size = t.op("Shape", [xs[0].name], start=loop.xs_dims[0], end=loop.xs_dims[0] + 1)
    trips = t.op("Squeeze", [size, t.const([0])])
    if loop.block > 1:  # steps of a block of rows each
        trips = t.op("Div", [trips, t.const(loop.block)])
    true = t.const(True, torch.bool)
    outs = [t.fresh("loop_carry") for _ in carries] + [t.fresh("loop_rows")]
    t.nodes.append(helper.make_node("Loop", [trips, true, *(c.name for c in carries)], outs,
                                    body=body))
    val = node.meta["val"]
    rank = val[0].dim()
    stacked = _collected(t, outs[-1], loop, rank)
    finals = [Tensor(name, v.dtype, v.dim()) for name, v in zip(outs[:-1], val[1:],
                                                                strict=True)]
    return (Tensor(stacked, val[0].dtype, rank), *finals)


def _collected(t: Any, scanned: str, loop: LoopScan, rank: int) -> str:
    """The loop's outputs ``(steps, *output)`` as the node's value: the steps moved to the
    stacking axis (``stack``), and merged with the block's rows there (``cat``)."""
    inner = rank if loop.block == 1 else rank + 1  # the scanned value's rank
    perm = list(range(1, inner))
    perm.insert(loop.out_dim, 0)
    moved = scanned if perm == list(range(inner)) else t.op("Transpose", [scanned], perm=perm)
    if loop.block == 1:
        return moved
    parts = [t.op("Shape", [moved], start=0, end=loop.out_dim)] if loop.out_dim else []
    parts.append(t.const([-1]))
    if loop.out_dim + 2 < inner:
        parts.append(t.op("Shape", [moved], start=loop.out_dim + 2))
    shape = parts[0] if len(parts) == 1 else t.op("Concat", parts, axis=0)
    return t.op("Reshape", [moved, shape])


def _rows(sub: Any, x: Tensor, axis: int, step: str, block: int) -> str:
    """Step ``i``'s rows of ``x``: ``Gather(x, i)`` (a position), or the ``i``-th block of
    ``block`` rows (``Slice``)."""
    if block == 1:
        return sub.op("Gather", [x.name, step], axis=axis)
    start = sub.op("Unsqueeze", [sub.op("Mul", [step, sub.const(block)]), sub.const([0])])
    end = sub.op("Add", [start, sub.const([block])])
    return sub.op("Slice", [x.name, start, end, sub.const([axis])])


def _body(t: Any, loop: LoopScan, xs: list[Tensor], invariants: list[Tensor]) -> Any:
    """The step graph as the ``Loop`` body: ``(i, cond, *carries) -> (cond, *carries, y)``."""
    sub = type(t)(loop.step, t.sym, {}, "loop_body")
    sub.prefix = f"b{next(_BODIES)}_"
    placeholders = [n for n in loop.step.graph.nodes if n.op == "placeholder"]
    k, m = loop.carries, len(loop.xs_dims)
    step = sub.fresh("step")
    inputs = [helper.make_tensor_value_info(step, TensorProto.INT64, []),
              helper.make_tensor_value_info(sub.fresh("cond"), TensorProto.BOOL, [])]
    for i, ph in enumerate(placeholders):
        val = ph.meta["val"]
        if i < k:
            name = sub.fresh(f"carry{i}")
            inputs.append(helper.make_tensor_value_info(name, onnx_dtype(val.dtype), None))
        elif i < k + m:
            name = _rows(sub, xs[i - k], loop.xs_dims[i - k], step, loop.block)
        else:  # an invariant: the enclosing graph's value, read by name
            name = invariants[i - k - m].name
        sub.env[ph] = Tensor(name, val.dtype, val.dim())
    output = next(n for n in loop.step.graph.nodes if n.op == "output")
    for n in loop.step.graph.nodes:
        if n.op == "call_function":
            sub.env[n] = sub.call(n)
        elif n.op not in ("placeholder", "output"):
            raise ExportError(f"re-rolled loop ({loop.source}): its step holds a {n.op} node; "
                              "tppc exports steps of ATen calls only. fix: run the torch "
                              "backend")
    results = [sub.env[a] for a in output.args[0]]
    names = [sub.op("Identity", [sub.const(True, torch.bool)], "cond_out")]
    infos = [helper.make_tensor_value_info(names[0], TensorProto.BOOL, [])]
    for value, arg in zip(results, output.args[0], strict=True):
        name = sub.op("Identity", [value.name], "out")
        names.append(name)
        val = arg.meta["val"]
        infos.append(helper.make_tensor_value_info(name, onnx_dtype(val.dtype), None))
    return helper.make_graph(sub.nodes, f"loop_body{sub.prefix}", inputs, infos,
                             initializer=list(sub.inits.values()))
