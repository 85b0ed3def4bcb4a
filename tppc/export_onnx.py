"""Translate an export stage graph (ATen fx) into an ONNX model with dynamic chunk inputs.

Terms:
    dynamic int: an int placeholder (``chunk_start``, ``chunk_size``, ``seq_len``) or
        arithmetic on one; it becomes an int64 scalar tensor of the ONNX graph, so one file
        serves every chunk and every length.
    initializer: a parameter or module buffer the graph reads (``get_attr``); each stage
        file holds only its own.

Supported ops are the table :data:`_OPS` (the ATen ops emitted for GPT-style causal LMs:
embedding, linear/addmm, layer/RMS norm, rope, GELU/SiLU, views) plus
:func:`tppc.export_graphs.split_attention`, decomposed to MatMul-Softmax-MatMul with an
offset-causal mask built from ``Range``/``Less`` on the chunk's rows only. Anything else
raises :class:`~tppc.export_graphs.ExportError` naming the node and the op.

Example:
    >>> model = to_onnx(gm, sym_name="chunk")                              # doctest: +SKIP
    >>> [i.name for i in model.graph.input][:3]
    ['input_ids', 'chunk_start', 'chunk_size']
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import fx

from tppc.export_graphs import ExportError, split_attention

__all__ = ["OPSET", "onnx_dtype", "to_onnx"]

OPSET = 18
_aten = torch.ops.aten
_INT_KINDS = ("chunk_start", "chunk_size", "seq_len")


def onnx_dtype(dtype: torch.dtype) -> int:
    """The ONNX element type of a torch dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(str(dtype).removeprefix("torch."))) \
        if dtype != torch.bfloat16 else TensorProto.BFLOAT16


class _Tensor:
    """An ONNX value with its torch dtype and rank."""

    def __init__(self, name: str, dtype: torch.dtype, rank: int) -> None:
        self.name, self.dtype, self.rank = name, dtype, rank


class _Int:
    """A dynamic int64 scalar."""

    def __init__(self, name: str) -> None:
        self.name = name


def to_onnx(gm: fx.GraphModule, *, sym_name: str, constants: Mapping[str, Any] | None = None,
            name: str = "stage", output_names: tuple[str, ...] = ()) -> onnx.ModelProto:
    """The ONNX model of ``gm``.

    Args:
        gm: an ATen fx graph (an export stage graph or a positional program).
        sym_name: the ONNX name of every symbolic input axis (``chunk``, ``length``); K/V
            buffers' token axes are ``capacity``.
        constants: placeholders baked in as values (non-tensor user inputs).
        name: the graph's name.
        output_names: names of the outputs, in order (default ``out_<i>``).
    """
    return _Translator(gm, sym_name, dict(constants or {}), name).run(output_names)


class _Translator:
    def __init__(self, gm: fx.GraphModule, sym_name: str, constants: dict[str, Any],
                 name: str) -> None:
        self.gm, self.sym, self.constants, self.name = gm, sym_name, constants, name
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, onnx.TensorProto] = {}
        self.by_storage: dict[tuple[int, tuple[int, ...], str], str] = {}
        self.inputs: list[onnx.ValueInfoProto] = []
        self.env: dict[fx.Node, Any] = {}
        self.count = 0

    # -- plumbing ------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"_t{self.count}_{hint}"

    def op(self, op_type: str, inputs: list[str], hint: str = "", **attrs: Any) -> str:
        out = self.fresh(hint or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def const(self, value: Any, dtype: torch.dtype | np.dtype = np.int64) -> str:
        if isinstance(dtype, torch.dtype):
            dtype = np.dtype(str(dtype).removeprefix("torch."))
        name = self.fresh("const")
        self.inits[name] = numpy_helper.from_array(np.asarray(value, dtype=dtype), name)
        return name

    def i64(self, value: Any) -> str:
        """A 1-D int64 tensor from ints and dynamic ints."""
        items = value if isinstance(value, (list, tuple)) else [value]
        if all(isinstance(v, int) for v in items):
            return self.const([int(v) for v in items])
        parts = [self.op("Unsqueeze", [v.name, self.const([0])]) if isinstance(v, _Int)
                 else self.const([int(v)]) for v in items]
        return parts[0] if len(parts) == 1 else self.op("Concat", parts, axis=0)

    def scalar(self, value: Any) -> str:
        return value.name if isinstance(value, _Int) else self.const(int(value))

    def like(self, value: Any, ref: _Tensor) -> str:
        """``value`` (a tensor or a Python number) as a tensor of ``ref``'s dtype."""
        if isinstance(value, _Tensor):
            return value.name if value.dtype == ref.dtype else \
                self.op("Cast", [value.name], to=onnx_dtype(ref.dtype))
        if isinstance(value, _Int):
            return self.op("Cast", [value.name], to=onnx_dtype(ref.dtype))
        return self.const(value, ref.dtype)

    def tensor(self, node: fx.Node, name: str) -> _Tensor:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ExportError(f"node {node.name!r} ({node.target}) has no tensor metadata; "
                              "tppc cannot export it. fix: report the model")
        return _Tensor(name, val.dtype, val.dim())

    # -- graph -----------------------------------------------------------------------------------
    def run(self, output_names: tuple[str, ...]) -> onnx.ModelProto:
        outputs: list[Any] = []
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.placeholder(node)
            elif node.op == "get_attr":
                self.env[node] = self.attr(node)
            elif node.op == "call_function":
                fn = _OPS.get(node.target)
                if fn is None:
                    raise ExportError(
                        f"node {node.name!r} calls {node.target}, which tppc's ONNX export "
                        "does not translate. fix: report the op (or run the torch backend)")
                args = fx.node.map_arg(node.args, self.env.__getitem__)
                kwargs = fx.node.map_arg(node.kwargs, self.env.__getitem__)
                self.env[node] = fn(self, node, *args, **kwargs)
            elif node.op == "output":
                outputs = list(fx.node.map_arg(node.args[0], self.env.__getitem__))
            else:
                raise ExportError(f"node {node.name!r} is a {node.op}; tppc exports flat "
                                  "ATen graphs only")
        names = output_names or tuple(f"out_{i}" for i in range(len(outputs)))
        infos = []
        for out_name, value in zip(names, outputs):
            if not isinstance(value, _Tensor):
                raise ExportError(f"output {out_name!r} is not a tensor ({value!r})")
            self.nodes.append(helper.make_node("Identity", [value.name], [out_name]))
            infos.append(helper.make_tensor_value_info(out_name, onnx_dtype(value.dtype),
                                                       [None] * value.rank))
        graph = helper.make_graph(self.nodes, self.name, self.inputs, infos,
                                  initializer=list(self.inits.values()))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="tppc")
        model.ir_version = 9
        return model

    def placeholder(self, node: fx.Node) -> Any:
        if node.name in self.constants:
            return self.constants[node.name]
        spec = node.meta.get("tppc.chunk_input")
        val = node.meta.get("val")
        if spec is not None and spec.kind in _INT_KINDS:
            self.inputs.append(helper.make_tensor_value_info(node.name, TensorProto.INT64, []))
            return _Int(node.name)
        if spec is not None and spec.kind in ("key", "value"):
            shape = ["capacity" if s is None else s for s in spec.shape]
            dtype = spec.dtype
        elif isinstance(val, torch.Tensor):
            shape = [self.sym if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
            dtype = val.dtype
        else:
            raise ExportError(f"input {node.name!r} is neither a tensor nor a chunk int "
                              f"({val!r}); tppc cannot export it")
        self.inputs.append(helper.make_tensor_value_info(node.name, onnx_dtype(dtype), shape))
        return _Tensor(node.name, dtype, len(shape))

    def attr(self, node: fx.Node) -> _Tensor:
        value = self.gm.get_parameter(node.target) if _is_param(self.gm, node.target) \
            else self.gm.get_buffer(node.target)
        data = value.detach().cpu().contiguous()
        key = (data.data_ptr(), tuple(data.shape), str(data.dtype))
        name = self.by_storage.get(key)
        if name is None:
            name = node.target
            if data.dtype == torch.bfloat16:
                proto = helper.make_tensor(name, TensorProto.BFLOAT16, list(data.shape),
                                           data.view(torch.int16).numpy().tobytes(), raw=True)
            else:
                proto = numpy_helper.from_array(data.numpy(), name)
            self.inits[name] = proto
            self.by_storage[key] = name
        return _Tensor(name, data.dtype, data.dim())


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


# -- op translations ----------------------------------------------------------------------------
Fn = Callable[..., Any]


def _unary(op_type: str) -> Fn:
    def fn(t: _Translator, node: fx.Node, x: _Tensor, *_: Any, **__: Any) -> _Tensor:
        return t.tensor(node, t.op(op_type, [x.name]))
    return fn


def _binary(op_type: str) -> Fn:
    def fn(t: _Translator, node: fx.Node, a: Any, b: Any, *, alpha: Any = 1) -> _Tensor:
        ref = t.tensor(node, "")
        if alpha != 1:
            b = _Tensor(t.op("Mul", [t.like(b, ref), t.const(alpha, ref.dtype)]), ref.dtype,
                        ref.rank)
        return t.tensor(node, t.op(op_type, [t.like(a, ref), t.like(b, ref)]))
    return fn


def _int_op(op_type: str, py: Callable[[int, int], int]) -> Fn:
    def fn(t: _Translator, node: fx.Node, a: Any, b: Any) -> Any:
        if isinstance(a, int) and isinstance(b, int):
            return py(a, b)
        return _Int(t.op(op_type, [t.scalar(a), t.scalar(b)]))
    return fn


def _cast(t: _Translator, node: fx.Node, x: _Tensor, *args: Any, **kwargs: Any) -> _Tensor:
    out = t.tensor(node, "")
    return t.tensor(node, x.name if out.dtype == x.dtype
                    else t.op("Cast", [x.name], to=onnx_dtype(out.dtype)))


def _axis(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _linear(t: _Translator, node: fx.Node, x: _Tensor, w: _Tensor, b: Any = None) -> _Tensor:
    y = t.op("MatMul", [x.name, t.op("Transpose", [w.name], perm=[1, 0])])
    return t.tensor(node, y if b is None else t.op("Add", [y, b.name]))


def _addmm(t: _Translator, node: fx.Node, b: _Tensor, x: _Tensor, w: _Tensor, *,
           beta: Any = 1, alpha: Any = 1) -> _Tensor:
    if beta != 1 or alpha != 1:
        raise ExportError(f"node {node.name!r}: addmm with beta/alpha is not exported")
    return t.tensor(node, t.op("Add", [t.op("MatMul", [x.name, w.name]), b.name]))


def _pow(t: _Translator, node: fx.Node, x: _Tensor, exponent: Any) -> _Tensor:
    if exponent == 2:
        return t.tensor(node, t.op("Mul", [x.name, x.name]))
    return t.tensor(node, t.op("Pow", [x.name, t.like(exponent, x)]))


def _mean(t: _Translator, node: fx.Node, x: _Tensor, dims: Any, keepdim: bool = False,
          **_: Any) -> _Tensor:
    return t.tensor(node, t.op("ReduceMean", [x.name, t.i64(list(dims))],
                               keepdims=int(keepdim)))


def _rsqrt(t: _Translator, node: fx.Node, x: _Tensor) -> _Tensor:
    return t.tensor(node, t.op("Reciprocal", [t.op("Sqrt", [x.name])]))


def _silu(t: _Translator, node: fx.Node, x: _Tensor) -> _Tensor:
    return t.tensor(node, t.op("Mul", [x.name, t.op("Sigmoid", [x.name])]))


def _gelu(t: _Translator, node: fx.Node, x: _Tensor, approximate: str = "none") -> _Tensor:
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


def _layer_norm(t: _Translator, node: fx.Node, x: _Tensor, shape: Any, w: Any = None,
                b: Any = None, eps: float = 1e-5, *_: Any) -> _Tensor:
    if w is None:
        w = _Tensor(t.const(np.ones(list(shape)), x.dtype), x.dtype, len(shape))
    inputs = [x.name, w.name] + ([b.name] if b is not None else [])
    return t.tensor(node, t.op("LayerNormalization", inputs, axis=-len(shape), epsilon=eps))


def _embedding(t: _Translator, node: fx.Node, w: _Tensor, idx: _Tensor, *_: Any) -> _Tensor:
    return t.tensor(node, t.op("Gather", [w.name, idx.name], axis=0))


def _view(t: _Translator, node: fx.Node, x: _Tensor, shape: Any) -> _Tensor:
    return t.tensor(node, t.op("Reshape", [x.name, t.i64(list(shape))]))


def _transpose(t: _Translator, node: fx.Node, x: _Tensor, a: int, b: int) -> _Tensor:
    perm = list(range(x.rank))
    a, b = _axis(a, x.rank), _axis(b, x.rank)
    perm[a], perm[b] = perm[b], perm[a]
    return t.tensor(node, t.op("Transpose", [x.name], perm=perm))


def _unsqueeze(t: _Translator, node: fx.Node, x: _Tensor, dim: int) -> _Tensor:
    return t.tensor(node, t.op("Unsqueeze", [x.name, t.i64([_axis(dim, x.rank + 1)])]))


def _slice(t: _Translator, node: fx.Node, x: _Tensor, dim: int = 0, start: Any = None,
           end: Any = None, step: int = 1) -> _Tensor:
    start = 0 if start is None else start
    end = 2**63 - 1 if end is None else end
    ins = [x.name, t.i64([start]), t.i64([end]), t.i64([_axis(dim, x.rank)]), t.i64([step])]
    return t.tensor(node, t.op("Slice", ins))


def _narrow(t: _Translator, node: fx.Node, x: _Tensor, dim: int, start: Any,
            length: Any) -> _Tensor:
    end = start + length if isinstance(start, int) and isinstance(length, int) \
        else _Int(t.op("Add", [t.scalar(start), t.scalar(length)]))
    return _slice(t, node, x, dim, start, end)


def _cat(t: _Translator, node: fx.Node, xs: list[_Tensor], dim: int = 0) -> _Tensor:
    ref = t.tensor(node, "")
    return t.tensor(node, t.op("Concat", [t.like(x, ref) for x in xs],
                               axis=_axis(dim, ref.rank)))


def _split(t: _Translator, node: fx.Node, x: _Tensor, size: int, dim: int = 0) -> list[Any]:
    parts = node.meta["val"]
    out, offset = [], 0
    for part in parts:
        n = int(part.shape[dim])
        ins = [x.name, t.i64([offset]), t.i64([offset + n]), t.i64([_axis(dim, x.rank)])]
        out.append(_Tensor(t.op("Slice", ins), part.dtype, part.dim()))
        offset += n
    return out


def _sym_size(t: _Translator, node: fx.Node, x: _Tensor, dim: int) -> Any:
    val = node.meta.get("val")
    if isinstance(val, int):
        return val
    shape = t.op("Shape", [x.name])
    return _Int(t.op("Squeeze", [t.op("Gather", [shape, t.i64([_axis(dim, x.rank)])]),
                                 t.const([0])]))


def _arange(t: _Translator, node: fx.Node, *args: Any, **kwargs: Any) -> _Tensor:
    start, end, step = (0, args[0], 1) if len(args) == 1 else (*args, 1)[:3]
    ref = t.tensor(node, "")
    ins = [t.like(v, ref) for v in (start, end, step)]
    return t.tensor(node, t.op("Range", ins))


def _identity(t: _Translator, node: fx.Node, x: Any, *_: Any, **__: Any) -> Any:
    return x


def _attention(t: _Translator, node: fx.Node, q: _Tensor, kb: _Tensor, vb: _Tensor,
               k: _Tensor, v: _Tensor, start: Any, kv_len: Any, causal: bool,
               scale: float | None, gqa: bool, mask: Any) -> _Tensor:
    """:func:`split_attention` in ONNX ops (see its docstring)."""
    val = node.meta["val"]
    heads, kv_heads, d = int(q_shape(node)[-3]), int(node.args[3].meta["val"].shape[-3]), \
        int(q_shape(node)[-1])
    axis = kb.rank - 2
    c = t.op("Squeeze", [t.op("Shape", [q.name], start=-2, end=-1), t.const([0])])
    end = _Int(t.op("Add", [t.scalar(start), c]))
    keys = [t.op("Slice", [kb.name, t.i64([0]), t.i64([start]), t.i64([axis])]), k.name]
    vals = [t.op("Slice", [vb.name, t.i64([0]), t.i64([start]), t.i64([axis])]), v.name]
    if not causal:
        keys.append(t.op("Slice", [kb.name, t.i64([end]), t.i64([kv_len]), t.i64([axis])]))
        vals.append(t.op("Slice", [vb.name, t.i64([end]), t.i64([kv_len]), t.i64([axis])]))
    query = q.name
    grouped = gqa and heads != kv_heads
    if grouped:  # (B, Hkv, G, c, d) against (B, Hkv, 1, n, d)
        lead = [int(s) for s in q_shape(node)[:-3]]
        query = t.op("Reshape", [q.name, t.i64([*lead, kv_heads, heads // kv_heads, -1, d])])
        keys = [t.op("Unsqueeze", [x, t.i64([axis])]) for x in keys]
        vals = [t.op("Unsqueeze", [x, t.i64([axis])]) for x in vals]
    rank = q.rank + int(grouped)
    perm = [*range(rank - 2), rank - 1, rank - 2]
    s = t.const(float(scale if scale is not None else 1 / np.sqrt(d)), val.dtype)
    scores = [t.op("Mul", [t.op("MatMul", [query, t.op("Transpose", [x], perm=perm)]), s])
              for x in keys]
    if causal:  # key j of the chunk is hidden from row i when j > i
        rows = t.op("Range", [t.const(0), c, t.const(1)])
        hidden = t.op("Less", [t.op("Unsqueeze", [rows, t.const([1])]),
                               t.op("Unsqueeze", [rows, t.const([0])])])
        scores[1] = t.op("Where", [hidden, t.const(-np.inf, val.dtype), scores[1]])
    full = t.op("Concat", scores, axis=-1)
    if mask is not None:
        m = mask.name if not grouped else t.op("Unsqueeze", [mask.name, t.i64([-3])])
        full = t.op("Where", [m, full, t.const(-np.inf, val.dtype)]) \
            if mask.dtype == torch.bool else t.op("Add", [full, t.like(mask, _Tensor(
                "", val.dtype, 0))])
    probs = t.op("Softmax", [full], axis=-1)
    bounds: list[Any] = [0, start, end, kv_len]  # segments of the concatenated key axis
    out = None
    for i, x in enumerate(vals):
        p = t.op("Slice", [probs, t.i64([bounds[i]]), t.i64([bounds[i + 1]]), t.i64([-1])])
        part = t.op("MatMul", [p, x])
        out = part if out is None else t.op("Add", [out, part])
    if grouped:
        lead = [int(s) for s in q_shape(node)[:-3]]
        out = t.op("Reshape", [out, t.i64([*lead, heads, -1, d])])
    return _Tensor(out, val.dtype, val.dim())


def q_shape(node: fx.Node) -> tuple[Any, ...]:
    return tuple(node.args[0].meta["val"].shape)


_OPS: dict[Any, Fn] = {
    _aten.add.Tensor: _binary("Add"), _aten.sub.Tensor: _binary("Sub"),
    _aten.mul.Tensor: _binary("Mul"), _aten.div.Tensor: _binary("Div"),
    _aten.neg.default: _unary("Neg"), _aten.cos.default: _unary("Cos"),
    _aten.sin.default: _unary("Sin"), _aten.tanh.default: _unary("Tanh"),
    _aten.exp.default: _unary("Exp"), _aten.sigmoid.default: _unary("Sigmoid"),
    _aten.rsqrt.default: _rsqrt, _aten.silu.default: _silu, _aten.gelu.default: _gelu,
    _aten.pow.Tensor_Scalar: _pow, _aten.mean.dim: _mean,
    _aten.to.dtype: _cast, _aten.to.device: _cast, _aten.to.dtype_layout: _cast,
    _aten._to_copy.default: _cast,
    _aten.linear.default: _linear, _aten.addmm.default: _addmm,
    _aten.layer_norm.default: _layer_norm, _aten.embedding.default: _embedding,
    _aten.view.default: _view, _aten.reshape.default: _view,
    _aten.transpose.int: _transpose, _aten.unsqueeze.default: _unsqueeze,
    _aten.slice.Tensor: _slice, _aten.narrow.default: _narrow, _aten.cat.default: _cat,
    _aten.split.Tensor: _split, _aten.sym_size.int: _sym_size,
    _aten.arange.default: _arange, _aten.arange.start: _arange,
    _aten.alias.default: _identity, _aten.dropout.default: _identity,
    _aten.clone.default: _identity, _aten.contiguous.default: _identity,
    operator.getitem: lambda t, node, xs, i: xs[i],
    operator.add: _int_op("Add", operator.add), operator.sub: _int_op("Sub", operator.sub),
    operator.mul: _int_op("Mul", operator.mul),
    split_attention: _attention,
}
