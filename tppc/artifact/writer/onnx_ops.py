"""ONNX translations of the ATen ops in stage graphs (the table :data:`OPS`).

Each translation takes the translator (``t``: emits nodes and constants), the fx node (its
``meta["val"]`` gives the result's dtype and rank) and the node's arguments with fx nodes
replaced by :class:`Tensor` (an ONNX value), :class:`Int` (a dynamic int64 scalar) or
Python values.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from onnx import TensorProto, helper
from torch import fx

from tppc.artifact.writer.onnx_mask_ops import MASK_OPS
from tppc.errors import ExportError

__all__ = ["OPS", "Fn", "Int", "Tensor", "onnx_dtype"]

_aten = torch.ops.aten


def onnx_dtype(dtype: torch.dtype) -> int:
    """The ONNX element type of a torch dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(str(dtype).removeprefix("torch."))) \
        if dtype != torch.bfloat16 else TensorProto.BFLOAT16


class Tensor:
    """An ONNX value with its torch dtype and rank."""

    def __init__(self, name: str, dtype: torch.dtype, rank: int) -> None:
        self.name, self.dtype, self.rank = name, dtype, rank


class Int:
    """A dynamic int64 scalar."""

    def __init__(self, name: str) -> None:
        self.name = name


Fn = Callable[..., Any]
"""A translation: ``fn(translator, node, *args, **kwargs)`` → the ONNX value(s)."""


def _unary(op_type: str) -> Fn:
    def fn(t: Any, node: fx.Node, x: Tensor, *_: Any, **__: Any) -> Tensor:
        return t.tensor(node, t.op(op_type, [x.name]))
    return fn


def _binary(op_type: str) -> Fn:
    """An elementwise op in the result's dtype; bfloat16 (which ONNX Runtime's CPU kernels
    lack) in float32, rounded back: what torch's CPU kernels compute."""
    def fn(t: Any, node: fx.Node, a: Any, b: Any, *, alpha: Any = 1) -> Tensor:
        out = t.tensor(node, "")
        ref = Tensor("", torch.float32, out.rank) if out.dtype == torch.bfloat16 else out
        if alpha != 1:
            b = Tensor(t.op("Mul", [t.like(b, ref), t.const(alpha, ref.dtype)]), ref.dtype,
                        ref.rank)
        y = t.op(op_type, [t.like(a, ref), t.like(b, ref)])
        return t.tensor(node, y if ref is out else
                        t.op("Cast", [y], to=onnx_dtype(torch.bfloat16)))
    return fn


def _rsub(t: Any, node: fx.Node, a: Any, b: Any, *, alpha: Any = 1) -> Tensor:
    """``b − alpha·a`` (``1 - z`` on a tensor ``z``)."""
    return _binary("Sub")(t, node, b, a, alpha=alpha)


def _int_op(op_type: str, py: Callable[[int, int], int]) -> Fn:
    def fn(t: Any, node: fx.Node, a: Any, b: Any) -> Any:
        if isinstance(a, int) and isinstance(b, int):
            return py(a, b)
        return Int(t.op(op_type, [t.scalar(a), t.scalar(b)]))
    return fn


def _cast(t: Any, node: fx.Node, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    out = t.tensor(node, "")
    return t.tensor(node, x.name if out.dtype == x.dtype
                    else t.op("Cast", [x.name], to=onnx_dtype(out.dtype)))


def _axis(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _linear(t: Any, node: fx.Node, x: Tensor, w: Tensor, b: Any = None) -> Tensor:
    y = t.op("MatMul", [x.name, t.op("Transpose", [w.name], perm=[1, 0])])
    return t.tensor(node, y if b is None else t.op("Add", [y, b.name]))


def _addmm(t: Any, node: fx.Node, b: Tensor, x: Tensor, w: Tensor, *,
           beta: Any = 1, alpha: Any = 1) -> Tensor:
    if beta != 1 or alpha != 1:
        raise ExportError(f"node {node.name!r}: addmm with beta/alpha is not exported")
    return t.tensor(node, t.op("Add", [t.op("MatMul", [x.name, w.name]), b.name]))


def _mm(t: Any, node: fx.Node, x: Tensor, w: Tensor) -> Tensor:
    """A matmul without bias (a row-parallel ``addmm``'s shard: the bias is added once,
    after the group's sum)."""
    return t.tensor(node, t.op("MatMul", [x.name, w.name]))


def _pow(t: Any, node: fx.Node, x: Tensor, exponent: Any) -> Tensor:
    if exponent == 2:
        return t.tensor(node, t.op("Mul", [x.name, x.name]))
    return t.tensor(node, t.op("Pow", [x.name, t.like(exponent, x)]))


def _pow_scalar(t: Any, node: fx.Node, base: Any, exponent: Tensor) -> Tensor:
    """``base ** exponent`` of a number and a tensor (rope frequencies)."""
    ref = t.tensor(node, "")
    return t.tensor(node, t.op("Pow", [t.like(base, ref), t.like(exponent, ref)]))


def _mean(t: Any, node: fx.Node, x: Tensor, dims: Any, keepdim: bool = False,
          **_: Any) -> Tensor:
    return t.tensor(node, t.op("ReduceMean", [x.name, t.i64(list(dims))],
                               keepdims=int(keepdim)))


def _full(t: Any, node: fx.Node, size: Any, value: Any, **_: Any) -> Tensor:
    """``torch.full(size, value)``: the value expanded to ``size`` (ints or dynamic ints)."""
    ref = t.tensor(node, "")
    scalar = t.const(value, ref.dtype)
    return t.tensor(node, scalar if not size else t.op("Expand", [scalar, t.i64(list(size))]))


def _rsqrt(t: Any, node: fx.Node, x: Tensor) -> Tensor:
    return t.tensor(node, t.op("Reciprocal", [t.op("Sqrt", [x.name])]))


def _silu(t: Any, node: fx.Node, x: Tensor) -> Tensor:
    return t.tensor(node, t.op("Mul", [x.name, t.op("Sigmoid", [x.name])]))


def _gelu(t: Any, node: fx.Node, x: Tensor, approximate: str = "none") -> Tensor:
    def c(v: float) -> str:
        return t.const(v, x.dtype)

    if approximate == "tanh":
        cube = t.op("Mul", [t.op("Mul", [x.name, x.name]), x.name])
        inner = t.op("Add", [x.name, t.op("Mul", [cube, c(0.044715)])])
        th = t.op("Tanh", [t.op("Mul", [inner, c(float(np.sqrt(2 / np.pi)))])])
        return t.tensor(node, t.op("Mul", [t.op("Mul", [x.name, c(0.5)]),
                                           t.op("Add", [th, c(1.0)])]))
    erf = t.op("Erf", [t.op("Mul", [x.name, c(float(1 / np.sqrt(2)))])])
    return t.tensor(node, t.op("Mul", [t.op("Mul", [x.name, c(0.5)]),
                                       t.op("Add", [erf, c(1.0)])]))


def _layer_norm(t: Any, node: fx.Node, x: Tensor, shape: Any, w: Any = None,
                b: Any = None, eps: float = 1e-5, *_: Any) -> Tensor:
    if w is None:
        w = Tensor(t.const(np.ones(list(shape)), x.dtype), x.dtype, len(shape))
    inputs = [x.name, w.name] + ([b.name] if b is not None else [])
    return t.tensor(node, t.op("LayerNormalization", inputs, axis=-len(shape), epsilon=eps))


def _embedding(t: Any, node: fx.Node, w: Tensor, idx: Tensor, *_: Any) -> Tensor:
    return t.tensor(node, t.op("Gather", [w.name, idx.name], axis=0))


def _view(t: Any, node: fx.Node, x: Tensor, shape: Any) -> Tensor:
    return t.tensor(node, t.op("Reshape", [x.name, t.i64(list(shape))]))


def _transpose(t: Any, node: fx.Node, x: Tensor, a: int, b: int) -> Tensor:
    perm = list(range(x.rank))
    a, b = _axis(a, x.rank), _axis(b, x.rank)
    perm[a], perm[b] = perm[b], perm[a]
    return t.tensor(node, t.op("Transpose", [x.name], perm=perm))


def _unsqueeze(t: Any, node: fx.Node, x: Tensor, dim: int) -> Tensor:
    return t.tensor(node, t.op("Unsqueeze", [x.name, t.i64([_axis(dim, x.rank + 1)])]))


def _slice(t: Any, node: fx.Node, x: Tensor, dim: int = 0, start: Any = None,
           end: Any = None, step: int = 1) -> Tensor:
    start = 0 if start is None else start
    end = 2**63 - 1 if end is None else end
    ins = [x.name, t.i64([start]), t.i64([end]), t.i64([_axis(dim, x.rank)]), t.i64([step])]
    return Tensor(t.op("Slice", ins), x.dtype, x.rank)  # a node tppc added has no "val"


def _narrow(t: Any, node: fx.Node, x: Tensor, dim: int, start: Any,
            length: Any) -> Tensor:
    end = start + length if isinstance(start, int) and isinstance(length, int) \
        else Int(t.op("Add", [t.scalar(start), t.scalar(length)]))
    return _slice(t, node, x, dim, start, end)


def _cat(t: Any, node: fx.Node, xs: list[Tensor], dim: int = 0) -> Tensor:
    ref = t.tensor(node, "")
    return t.tensor(node, t.op("Concat", [t.like(x, ref) for x in xs],
                               axis=_axis(dim, ref.rank)))


def _split(t: Any, node: fx.Node, x: Tensor, size: int, dim: int = 0) -> list[Any]:
    parts = node.meta["val"]
    out, offset = [], 0
    for part in parts:
        n = int(part.shape[dim])
        ins = [x.name, t.i64([offset]), t.i64([offset + n]), t.i64([_axis(dim, x.rank)])]
        out.append(Tensor(t.op("Slice", ins), part.dtype, part.dim()))
        offset += n
    return out


def _chunk(t: Any, node: fx.Node, x: Tensor, chunks: int, dim: int = 0) -> list[Any]:
    return _split(t, node, x, 0, dim)


def _flatten(t: Any, node: fx.Node, x: Tensor, start: int = 0, end: int = -1) -> Tensor:
    start, end = _axis(start, x.rank), _axis(end, x.rank)
    tail = [int(s) for s in node.args[0].meta["val"].shape[end + 1:]]  # static (checked)
    return t.tensor(node, t.op("Reshape", [x.name, t.i64([0] * start + [-1] + tail)]))


def _permute(t: Any, node: fx.Node, x: Tensor, dims: Any) -> Tensor:
    return t.tensor(node, t.op("Transpose", [x.name], perm=[_axis(d, x.rank) for d in dims]))


def _conv(t: Any, node: fx.Node, x: Tensor, w: Tensor, b: Any = None, stride: Any = 1,
          padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Tensor:
    """``conv1d``/``conv2d``/``conv3d`` (a video DiT's patch embedding: Wan, SkyReels)."""
    n = x.rank - 2
    pads = _per_axis(padding, n)
    ins = [x.name, w.name] + ([b.name] if isinstance(b, Tensor) else [])
    return t.tensor(node, t.op("Conv", ins, strides=_per_axis(stride, n), pads=pads + pads,
                               dilations=_per_axis(dilation, n), group=groups))


def _per_axis(value: Any, n: int) -> list[int]:
    return [int(value)] * n if isinstance(value, int) else [int(v) for v in value]


def _repeat(t: Any, node: fx.Node, x: Tensor, sizes: Any) -> Tensor:
    name = x.name
    extra = len(sizes) - x.rank
    if extra > 0:  # torch's repeat adds leading axes
        name = t.op("Unsqueeze", [name, t.i64(list(range(extra)))])
    return t.tensor(node, t.op("Tile", [name, t.i64(list(sizes))]))


def _repeat_interleave(t: Any, node: fx.Node, x: Tensor, repeats: int, dim: Any = None,
                       *_: Any, **__: Any) -> Tensor:
    if dim is None:  # flattened, like torch
        flat = t.op("Reshape", [x.name, t.i64([-1])])
        x, dim = Tensor(flat, x.dtype, 1), 0
    d = _axis(dim, x.rank)
    ones = [1] * (x.rank + 1)
    ones[d + 1] = int(repeats)
    tiled = t.op("Tile", [t.op("Unsqueeze", [x.name, t.i64([d + 1])]), t.i64(ones)])
    tail = [int(v) for v in node.meta["val"].shape[d + 1:]]  # static (checked by int())
    return t.tensor(node, t.op("Reshape", [tiled, t.i64([0] * d + [-1] + tail)]))


def _sym_size(t: Any, node: fx.Node, x: Tensor, dim: int) -> Any:
    val = node.meta.get("val")
    if isinstance(val, int):
        return val
    shape = t.op("Shape", [x.name])
    return Int(t.op("Squeeze", [t.op("Gather", [shape, t.i64([_axis(dim, x.rank)])]),
                                 t.const([0])]))


def _arange(t: Any, node: fx.Node, *args: Any, **kwargs: Any) -> Tensor:
    start, end, step = (0, args[0], 1) if len(args) == 1 else (*args, 1)[:3]
    ref = t.tensor(node, "")
    ins = [t.like(v, ref) for v in (start, end, step)]
    return t.tensor(node, t.op("Range", ins))


def _einsum(t: Any, node: fx.Node, equation: str, xs: list[Tensor]) -> Tensor:
    return t.tensor(node, t.op("Einsum", [x.name for x in xs], equation=equation))


def _select(t: Any, node: fx.Node, x: Tensor, dim: int, index: Any) -> Tensor:
    """``x.select(dim, index)``: a Gather of one index (a scalar index drops the axis)."""
    return t.tensor(node, t.op("Gather", [x.name, t.scalar(index)], axis=_axis(dim, x.rank)))


def _identity(t: Any, node: fx.Node, x: Any, *_: Any, **__: Any) -> Any:
    return x


OPS: dict[Any, Fn] = {
    _aten.add.Tensor: _binary("Add"), _aten.sub.Tensor: _binary("Sub"),
    _aten.rsub.Scalar: _rsub, _aten.rsub.Tensor: _rsub,
    _aten.mul.Tensor: _binary("Mul"), _aten.div.Tensor: _binary("Div"),
    _aten.neg.default: _unary("Neg"), _aten.cos.default: _unary("Cos"),
    _aten.sin.default: _unary("Sin"), _aten.tanh.default: _unary("Tanh"),
    _aten.exp.default: _unary("Exp"), _aten.sigmoid.default: _unary("Sigmoid"),
    _aten.relu.default: _unary("Relu"),
    _aten.square.default: lambda t, node, x: _binary("Mul")(t, node, x, x),
    _aten.rsqrt.default: _rsqrt, _aten.silu.default: _silu, _aten.gelu.default: _gelu,
    _aten.pow.Tensor_Scalar: _pow, _aten.pow.Scalar: _pow_scalar, _aten.mean.dim: _mean,
    _aten.pow.Tensor_Tensor: _binary("Pow"), _aten.full.default: _full,
    _aten.ones.default: lambda t, node, size, **kw: _full(t, node, size, 1),
    _aten.zeros.default: lambda t, node, size, **kw: _full(t, node, size, 0),
    _aten.new_ones.default: lambda t, node, x, size, **kw: _full(t, node, size, 1),
    _aten.new_zeros.default: lambda t, node, x, size, **kw: _full(t, node, size, 0),
    _aten.matmul.default: _binary("MatMul"), _aten.bmm.default: _binary("MatMul"),
    _aten.to.dtype: _cast, _aten.to.device: _cast, _aten.to.dtype_layout: _cast,
    _aten._to_copy.default: _cast, _aten.type_as.default: _cast,
    _aten.linear.default: _linear, _aten.addmm.default: _addmm, _aten.mm.default: _mm,
    _aten.layer_norm.default: _layer_norm, _aten.embedding.default: _embedding,
    _aten.view.default: _view, _aten.reshape.default: _view,
    _aten.transpose.int: _transpose, _aten.unsqueeze.default: _unsqueeze,
    _aten.slice.Tensor: _slice, _aten.narrow.default: _narrow, _aten.cat.default: _cat,
    _aten.concat.default: _cat,
    _aten.split.Tensor: _split, _aten.sym_size.int: _sym_size,
    _aten.chunk.default: _chunk, _aten.flatten.using_ints: _flatten,
    _aten.permute.default: _permute, _aten.conv2d.default: _conv,
    _aten.conv1d.default: _conv, _aten.conv3d.default: _conv,
    _aten.repeat.default: _repeat, _aten.repeat_interleave.self_int: _repeat_interleave,
    _aten.arange.default: _arange, _aten.arange.start: _arange,
    _aten.arange.start_step: _arange,
    _aten.einsum.default: _einsum, _aten.select.int: _select,
    _aten.alias.default: _identity, _aten.dropout.default: _identity,
    _aten.clone.default: _identity, _aten.contiguous.default: _identity,
    operator.getitem: lambda t, node, xs, i: xs[i],
    operator.add: _int_op("Add", operator.add), operator.sub: _int_op("Sub", operator.sub),
    operator.mul: _int_op("Mul", operator.mul),
    operator.floordiv: _int_op("Div", operator.floordiv),  # sizes: non-negative
    operator.mod: _int_op("Mod", operator.mod),  # Python's sign (ONNX fmod=0): a padding
    **MASK_OPS,  # compares, where, clamp, logs, expand: masks and float biases
}
