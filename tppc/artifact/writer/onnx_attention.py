"""ONNX translation of :func:`tppc.artifact.writer.graphs.split_attention`: MatMul-Softmax-MatMul.

The scores of the key segments (the buffer's prefix, the chunk's own K/V, a bidirectional
suffix) are concatenated, soft-capped (``cap · tanh(s / cap)``), masked (an offset-causal
mask built from ``Range``/``Greater`` on the chunk's rows only, a sliding window's last
keys or a chunked attention's own block, a padding mask, an additive bias), extended by the sinks column, and one ``Softmax``
weighs the segments' values. Grouped-query heads are regrouped ``(kv_heads, group)``
rather than repeated. The table :data:`ATTENTION_OPS` joins the other tables in
:func:`tppc.artifact.writer.to_onnx.to_onnx`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from onnx import TensorProto
from torch import fx

from tppc.artifact.writer.graphs import ExportError, split_attention
from tppc.artifact.writer.onnx_ops import Fn, Int, Tensor

__all__ = ["ATTENTION_OPS"]


def _attention(t: Any, node: fx.Node, q: Tensor, kb: Tensor, vb: Tensor,
               k: Tensor, v: Tensor, start: Any, kv_len: Any, causal: bool,
               scale: float | None, gqa: bool, mask: Any, key_valid: Any = None,
               window: int | None = None, softcap: float | None = None,
               sinks: Any = None, block: int | None = None) -> Tensor:
    """:func:`split_attention` in ONNX ops (see its docstring)."""
    val = node.meta["val"]
    heads, d = int(_q_shape(node)[-3]), int(_q_shape(node)[-1])
    kv = node.args[3].meta.get("val")  # none on a video's rows of every frame (no GQA there)
    kv_heads = int(kv.shape[-3]) if kv is not None else heads
    if kv is None and gqa:
        raise ExportError(f"attention {node.name!r} groups its K/V heads and its keys "
                          f"{node.args[3].name!r} have no shape record; tppc cannot tell the "
                          "groups. fix: report the model")
    axis = kb.rank - 2
    c = t.op("Squeeze", [t.op("Shape", [q.name], start=-2, end=-1), t.const([0])])
    end = Int(t.op("Add", [t.scalar(start), c]))
    lo: Any = 0 if window is None else Int(t.op("Max", [t.const(0), t.op(
        "Sub", [t.scalar(start), t.const(int(window) - 1)])]))
    if block is not None and causal:  # the chunk's first block start (int64 Div: floor)
        first = t.op("Mul", [t.op("Div", [t.scalar(start), t.const(int(block))]),
                             t.const(int(block))])
        lo = Int(first if lo == 0 else t.op("Max", [t.scalar(lo), first]))
    keys = [t.op("Slice", [kb.name, t.i64([lo]), t.i64([start]), t.i64([axis])]), k.name]
    vals = [t.op("Slice", [vb.name, t.i64([lo]), t.i64([start]), t.i64([axis])]), v.name]
    if not causal:
        keys.append(t.op("Slice", [kb.name, t.i64([end]), t.i64([kv_len]), t.i64([axis])]))
        vals.append(t.op("Slice", [vb.name, t.i64([end]), t.i64([kv_len]), t.i64([axis])]))
    query = q.name
    grouped = gqa and heads != kv_heads
    if grouped:  # (B, Hkv, G, c, d) against (B, Hkv, 1, n, d)
        lead = [int(s) for s in _q_shape(node)[:-3]]
        query = t.op("Reshape", [q.name, t.i64([*lead, kv_heads, heads // kv_heads, -1, d])])
        keys = [t.op("Unsqueeze", [x, t.i64([axis])]) for x in keys]
        vals = [t.op("Unsqueeze", [x, t.i64([axis])]) for x in vals]
    rank = q.rank + int(grouped)
    perm = [*range(rank - 2), rank - 1, rank - 2]
    s = t.const(float(scale if scale is not None else 1 / np.sqrt(d)), val.dtype)
    scores = [t.op("Mul", [t.op("MatMul", [query, t.op("Transpose", [x], perm=perm)]), s])
              for x in keys]
    full = t.op("Concat", scores, axis=-1)
    if softcap is not None:
        cap = t.const(float(softcap), val.dtype)
        full = t.op("Mul", [t.op("Tanh", [t.op("Div", [full, cap])]), cap])
    hi = end if causal else kv_len
    visible = _visible(t, start, end, lo, hi, window, block) if causal else None
    if key_valid is not None:  # (B, ≥ kv_len) → (B, 1, .., 1, keys)
        rows = t.op("Slice", [key_valid.name, t.i64([lo]), t.i64([hi]), t.i64([1])])
        valid = t.op("Unsqueeze", [t.op("Cast", [rows], to=TensorProto.BOOL),
                                   t.i64(list(range(1, rank - 1)))])
        visible = valid if visible is None else t.op("And", [visible, valid])
    hidden = t.const(-np.inf, val.dtype)
    if mask is not None:
        m = mask.name if not grouped else t.op("Unsqueeze", [mask.name, t.i64([-3])])
        full = t.op("Where", [m, full, hidden]) if mask.dtype == torch.bool \
            else t.op("Add", [full, t.like(mask, Tensor("", val.dtype, 0))])
    if visible is not None:
        full = t.op("Where", [visible, full, hidden])
    if sinks is not None:
        full = t.op("Concat", [full, _sink_column(t, node, q, sinks, grouped, kv_heads)],
                    axis=-1)
    probs = t.op("Softmax", [full], axis=-1)
    if key_valid is not None or mask is not None:  # a row that sees no key gives 0
        empty = t.op("Equal", [t.op("ReduceMax", [full, t.i64([-1])], keepdims=1), hidden])
        probs = t.op("Where", [empty, t.const(0.0, val.dtype), probs])
    out = None
    bounds = [0, _minus(t, start, lo), _minus(t, end, lo), _minus(t, kv_len, lo)]
    for i, x in enumerate(vals):  # segments of the concatenated key axis
        p = t.op("Slice", [probs, t.i64([bounds[i]]), t.i64([bounds[i + 1]]), t.i64([-1])])
        part = t.op("MatMul", [p, x])
        out = part if out is None else t.op("Add", [out, part])
    if grouped:
        lead = [int(s) for s in _q_shape(node)[:-3]]
        out = t.op("Reshape", [out, t.i64([*lead, heads, -1, d])])
    return Tensor(out, val.dtype, val.dim())


def _sink_column(t: Any, node: fx.Node, q: Tensor, sinks: Tensor, grouped: bool,
                 kv_heads: int) -> str:
    """The sinks as one more key column of the scores: ``(..., heads, c, 1)``, or
    ``(..., kv_heads, group, c, 1)`` in the grouped layout."""
    val = node.meta["val"]
    rows = t.op("Shape", [q.name], end=-1)  # (..., heads, c)
    shape = t.op("Concat", [rows, t.const([1])], axis=0)
    column = t.op("Expand", [t.like(sinks, Tensor("", val.dtype, 0)), shape])
    if not grouped:
        return column
    lead = [int(s) for s in _q_shape(node)[:-3]]
    heads = int(_q_shape(node)[-3])
    return t.op("Reshape", [column, t.i64([*lead, kv_heads, heads // kv_heads, -1, 1])])


def _minus(t: Any, a: Any, b: Any) -> Any:
    """``a - b`` of ints and dynamic ints."""
    if isinstance(b, int) and b == 0:
        return a
    return Int(t.op("Sub", [t.scalar(a), t.scalar(b)]))


def _visible(t: Any, start: Any, end: Any, lo: Any, hi: Any, window: int | None,
             block: int | None = None) -> str:
    """``(c, keys)`` bool: key ``j`` (positions ``[lo, hi)``) visible from query ``i``
    (positions ``[start, end)``) when ``j ≤ i`` and, with a window, ``j > i - window``, with
    a block, ``j // block == i // block``."""
    rows = t.op("Unsqueeze", [t.op("Range", [t.scalar(start), t.scalar(end), t.const(1)]),
                              t.const([1])])
    cols = t.op("Unsqueeze", [t.op("Range", [t.scalar(lo), t.scalar(hi), t.const(1)]),
                              t.const([0])])
    seen = t.op("Not", [t.op("Greater", [cols, rows])])
    if window is not None:
        near = t.op("Greater", [cols, t.op("Sub", [rows, t.const(int(window))])])
        seen = t.op("And", [seen, near])
    if block is not None:
        size = t.const(int(block))
        same = t.op("Equal", [t.op("Div", [cols, size]), t.op("Div", [rows, size])])
        seen = t.op("And", [seen, same])
    return seen


def _q_shape(node: fx.Node) -> tuple[Any, ...]:
    return tuple(node.args[0].meta["val"].shape)


ATTENTION_OPS: dict[Any, Fn] = {split_attention: _attention}
