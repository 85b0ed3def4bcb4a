"""ONNX translations of the ATen ops diffusion transformers add to stage graphs (:data:`DIT_OPS`).

Cross-attention to the text states (a plain ``scaled_dot_product_attention`` whose keys are
not split: PixArt), RMS norm, rope tables built from position ids (``outer``, ``stack``,
``unbind``, ``unflatten``: Flux), splits into segments of computed sizes (joint attention's
text and image tokens), ``squeeze``, and functional writes (``copy``, ``slice_scatter``: CogView4;
``select_scatter``: Gated DeltaNet's rows of a block) and identity matrices (``eye``). Each takes the translator ``t``, the fx node and its
arguments as in :mod:`tppc.artifact.writer.onnx_ops`; :mod:`tppc.artifact.writer.to_onnx`
reads both tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import fx

from tppc.artifact.writer.graphs import ExportError
from tppc.artifact.writer.onnx_ops import Int, Tensor

__all__ = ["DIT_OPS"]

_aten = torch.ops.aten


def _axis(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _out(t: Any, node: fx.Node, name: str) -> Any:
    return t.tensor(node, name)


def _part(name: str, val: torch.Tensor) -> Tensor:
    return Tensor(name, val.dtype, val.dim())


def _squeeze(t: Any, node: fx.Node, x: Any, dim: Any) -> Any:
    """torch drops only the named axes of size 1 (others stay); ONNX's Squeeze refuses them."""
    dims = [dim] if isinstance(dim, int) else list(dim)
    shape = node.args[0].meta["val"].shape
    ones = [_axis(d, x.rank) for d in dims if not isinstance(shape[d], torch.SymInt)
            and int(shape[d]) == 1]
    return x if not ones else _out(t, node, t.op("Squeeze", [x.name, t.i64(ones)]))


def _split_sizes(t: Any, node: fx.Node, x: Any, sizes: Any, dim: int = 0) -> list[Any]:
    """Segments of sizes that may be computed (joint attention's text and image tokens)."""
    axis, out, start = _axis(dim, x.rank), [], 0
    for size, val in zip(sizes, node.meta["val"]):
        end = start + size if isinstance(start, int) and isinstance(size, int) else \
            Int(t.op("Add", [t.scalar(start), t.scalar(size)]))
        name = t.op("Slice", [x.name, t.i64([start]), t.i64([end]), t.i64([axis])])
        out.append(_part(name, val))
        start = end
    return out


def _unbind(t: Any, node: fx.Node, x: Any, dim: int = 0) -> list[Any]:
    axis = _axis(dim, x.rank)
    return [_part(t.op("Gather", [x.name, t.const(i)], axis=axis), val)
            for i, val in enumerate(node.meta["val"])]


def _stack(t: Any, node: fx.Node, xs: list[Any], dim: int = 0) -> Any:
    ref = t.tensor(node, "")
    axis = t.i64([_axis(dim, ref.rank)])
    parts = [t.op("Unsqueeze", [t.like(x, ref), axis]) for x in xs]
    return _out(t, node, t.op("Concat", parts, axis=_axis(dim, ref.rank)))


def _unflatten(t: Any, node: fx.Node, x: Any, dim: int, sizes: Any) -> Any:
    axis = _axis(dim, x.rank)
    shape = t.op("Shape", [x.name])
    parts = [t.op("Slice", [shape, t.i64([0]), t.i64([axis])]), t.i64(list(sizes)),
             t.op("Slice", [shape, t.i64([axis + 1]), t.i64([x.rank])])]
    return _out(t, node, t.op("Reshape", [x.name, t.op("Concat", parts, axis=0)]))


def _outer(t: Any, node: fx.Node, a: Any, b: Any) -> Any:
    ref = t.tensor(node, "")
    col = t.op("Unsqueeze", [t.like(a, ref), t.i64([1])])
    row = t.op("Unsqueeze", [t.like(b, ref), t.i64([0])])
    return _out(t, node, t.op("Mul", [col, row]))


def _rms_norm(t: Any, node: fx.Node, x: Any, shape: Any, w: Any = None,
              eps: float | None = None) -> Any:
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    axes = t.i64(list(range(x.rank - len(shape), x.rank)))
    mean = t.op("ReduceMean", [t.op("Mul", [x.name, x.name]), axes], keepdims=1)
    inv = t.op("Reciprocal", [t.op("Sqrt", [t.op("Add", [mean, t.const(eps, x.dtype)])])])
    y = t.op("Mul", [x.name, inv])
    return _out(t, node, y if w is None else t.op("Mul", [y, t.like(w, x)]))


def _sdpa(t: Any, node: fx.Node, q: Any, k: Any, v: Any, attn_mask: Any = None,
          dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
          enable_gqa: bool = False) -> Any:
    """Attention over keys that are not split (cross-attention to the text states)."""
    if is_causal or dropout_p or (enable_gqa and q.rank >= 3
                                  and node.args[0].meta["val"].shape[-3]
                                  != node.args[1].meta["val"].shape[-3]):
        raise ExportError(f"attention {node.name!r} over unsplit keys is causal, has dropout "
                          "or grouped heads; tppc exports it without those only. fix: report "
                          "the model")
    d = int(node.args[0].meta["val"].shape[-1])
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    perm = list(range(k.rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    scores = t.op("Mul", [t.op("MatMul", [q.name, t.op("Transpose", [k.name], perm=perm)]),
                          t.const(scale, q.dtype)])
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = t.op("Where", [attn_mask.name, scores, t.const(-np.inf, q.dtype)])
        else:
            scores = t.op("Add", [scores, t.like(attn_mask, q)])
    return _out(t, node, t.op("MatMul", [t.op("Softmax", [scores], axis=-1), v.name]))


def _copy(t: Any, node: fx.Node, x: Tensor, src: Any, *_: Any, **__: Any) -> Tensor:
    """Functional ``copy`` (``x.copy_(src)``, CogView4): ``src`` in ``x``'s dtype, broadcast
    to ``x``'s shape."""
    out = t.tensor(node, "")
    return t.tensor(node, t.op("Expand", [t.like(src, out), t.op("Shape", [x.name])]))


def _slice_scatter(t: Any, node: fx.Node, x: Tensor, src: Any, dim: int = 0,
                   start: Any = None, end: Any = None, step: int = 1) -> Tensor:
    """``x`` with ``src`` written over ``x[start:end]`` along ``dim`` (a functional slice
    write, CogView4's rope): the rows before, ``src``, the rows after, joined."""
    out = t.tensor(node, "")
    axis = _axis(dim, x.rank)
    if step != 1:
        return _strided_scatter(t, node, x, t.like(src, out), axis, slice(start, end, step))
    start = 0 if start is None else start
    end = 2**63 - 1 if end is None else end

    def rows(lo: Any, hi: Any) -> str:
        return t.op("Slice", [x.name, t.i64([lo]), t.i64([hi]), t.i64([axis])])

    parts = [rows(0, start), t.like(src, out), rows(end, 2**63 - 1)]
    return t.tensor(node, t.op("Concat", parts, axis=axis))


def _select_scatter(t: Any, node: fx.Node, x: Tensor, src: Any, dim: int, index: int
                    ) -> Tensor:
    """``x`` with ``src`` written over row ``index`` of ``dim`` (``attn[..., i, :i] = row``
    in a loop over a block's rows, Gated DeltaNet): the slice write of ``src`` unsqueezed."""
    axis = _axis(dim, x.rank)
    if index < 0:
        size = node.args[0].meta["val"].shape[axis]
        if not isinstance(size, int):
            raise ExportError(f"node {node.name!r} writes row {index} from the end of an axis "
                              f"of size {size}; tppc exports such a write along an axis of "
                              "fixed size only. fix: report the model")
        index += size
    out = t.tensor(node, "")
    row = t.op("Unsqueeze", [t.like(src, out), t.i64([axis])])
    parts = [t.op("Slice", [x.name, t.i64([0]), t.i64([index]), t.i64([axis])]), row,
             t.op("Slice", [x.name, t.i64([index + 1]), t.i64([2**63 - 1]), t.i64([axis])])]
    return t.tensor(node, t.op("Concat", parts, axis=axis))


def _eye(t: Any, node: fx.Node, n: Any, m: Any = None, **_: Any) -> Tensor:
    """``torch.eye(n[, m])`` of static sizes: a constant."""
    if not all(isinstance(v, int | None) for v in (n, m)):
        raise ExportError(f"node {node.name!r} makes an identity matrix of a size computed "
                          "at run time; tppc exports one of a fixed size only. fix: report "
                          "the model")
    out = t.tensor(node, "")
    return t.tensor(node, t.const(np.eye(n, n if m is None else m), out.dtype))


def _strided_scatter(t: Any, node: fx.Node, x: Tensor, src: str, axis: int,
                     rows: slice) -> Tensor:
    """``x[..., rows, ...] = src`` along ``axis`` of a static size (an interleaved rope's
    ``x[..., 0::2]``: SkyReels): a ScatterND of those rows with the axis moved first."""
    size = node.args[0].meta["val"].shape[axis]
    if not isinstance(size, int) or not all(isinstance(v, int | None)
                                            for v in (rows.start, rows.stop)):
        raise ExportError(f"node {node.name!r} writes every {rows.step}th row of an axis of "
                          f"size {size} from {rows.start} to {rows.stop}; tppc exports a "
                          "strided write along an axis of fixed size and bounds only. fix: "
                          "report the model")
    perm = [axis] + [d for d in range(x.rank) if d != axis]
    back = [perm.index(d) for d in range(x.rank)]
    index = t.const([[i] for i in range(size)[rows]])
    moved = [t.op("Transpose", [name], perm=perm) for name in (x.name, src)]
    scattered = t.op("ScatterND", [moved[0], index, moved[1]])
    return t.tensor(node, t.op("Transpose", [scattered], perm=back))


DIT_OPS: dict[Any, Callable[..., Any]] = {
    _aten.squeeze.dim: _squeeze, _aten.squeeze.dims: _squeeze,
    _aten.split_with_sizes.default: _split_sizes, _aten.unbind.int: _unbind,
    _aten.stack.default: _stack, _aten.unflatten.int: _unflatten,
    _aten.outer.default: _outer, _aten.rms_norm.default: _rms_norm,
    _aten.scaled_dot_product_attention.default: _sdpa,
    _aten.copy.default: _copy, _aten.slice_scatter.default: _slice_scatter,
    _aten.select_scatter.default: _select_scatter, _aten.eye.default: _eye,
    _aten.eye.m: _eye,
}
"""ATen op → translation, read by :mod:`tppc.artifact.writer.to_onnx` after
:data:`~tppc.artifact.writer.onnx_ops.OPS`."""
