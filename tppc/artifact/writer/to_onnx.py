"""Translate an export stage graph (ATen fx) into an ONNX model with dynamic chunk inputs.

Terms:
    dynamic int: an int placeholder (``chunk_start``, ``chunk_size``, ``seq_len``) or
        arithmetic on one; it becomes an int64 scalar tensor of the ONNX graph, so one file
        serves every chunk and every length.
    initializer: a parameter or module buffer the graph reads (``get_attr``); each stage
        file holds only its own.

Supported ops are the table :data:`tppc.artifact.writer.onnx_ops.OPS` (the ATen ops emitted for
GPT-style causal LMs: embedding, linear/addmm, layer/RMS norm, rope, GELU/SiLU, views), the
table :data:`tppc.artifact.writer.onnx_dit_ops.DIT_OPS` (what diffusion transformers add: cross-
attention to unsplit text keys, ``rms_norm``, rope tables from position ids), the table
:data:`tppc.artifact.writer.onnx_routing_ops.ROUTING_OPS` (indexing and mixture-of-experts
routing: ``index``, ``topk``, ``sort``, ``histc``, grouped expert matmuls), plus
:func:`tppc.artifact.writer.graphs.split_attention`
(:mod:`tppc.artifact.writer.onnx_attention`), decomposed to MatMul-Softmax-MatMul with an
offset-causal mask built from ``Range``/``Greater`` on the chunk's rows only (a sliding
window reads its last ``window`` keys; a padding mask, a ``full`` input of kind key
validity, hides keys; a row that sees none gives 0; a soft-cap and sinks as
``tppc::softmax_attention`` computes them). Anything else raises
:class:`~tppc.artifact.writer.graphs.ExportError` naming the node and the op.

Example:
    >>> model = to_onnx(gm, sym_name="chunk")                              # doctest: +SKIP
    >>> [i.name for i in model.graph.input][:3]
    ['input_ids', 'chunk_start', 'chunk_size']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import fx

from tppc.artifact.writer.graphs import ExportError
from tppc.artifact.writer.onnx_attention import ATTENTION_OPS
from tppc.artifact.writer.onnx_dit_ops import DIT_OPS
from tppc.artifact.writer.onnx_loop_ops import loop_op
from tppc.artifact.writer.onnx_ops import OPS, Int, Tensor, onnx_dtype
from tppc.artifact.writer.onnx_routing_ops import ROUTING_OPS, routing_op
from tppc.artifact.writer.onnx_scan_ops import SCAN_OPS
from tppc.artifact.writer.state_reads import STATE_OPS

__all__ = ["OPSET", "onnx_dtype", "to_onnx"]

OPSET = 18
_aten = torch.ops.aten
_INT_KINDS = ("chunk_start", "chunk_size", "seq_len")
_TABLE = {**OPS, **DIT_OPS, **ATTENTION_OPS, **ROUTING_OPS, **SCAN_OPS, **STATE_OPS}


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
    """Walks the fx graph once, emitting ONNX nodes, inputs and initializers."""

    def __init__(self, gm: fx.GraphModule, sym_name: str, constants: dict[str, Any],
                 name: str) -> None:
        self.gm, self.sym, self.constants, self.name = gm, sym_name, constants, name
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, onnx.TensorProto] = {}
        self.by_storage: dict[tuple[int, tuple[int, ...], str], str] = {}
        self.inputs: list[onnx.ValueInfoProto] = []
        self.env: dict[fx.Node, Any] = {}
        self.symbols: set[Any] = set()  # the symbols named ``sym_name`` (input axes)
        self.count = 0
        self.prefix = ""  # a loop body's names: unique within the whole model

    # -- plumbing ------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"_t{self.prefix}{self.count}_{hint}"

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
        parts = [self.op("Unsqueeze", [v.name, self.const([0])]) if isinstance(v, Int)
                 else self.const([int(v)]) for v in items]
        return parts[0] if len(parts) == 1 else self.op("Concat", parts, axis=0)

    def scalar(self, value: Any) -> str:
        return value.name if isinstance(value, Int) else self.const(int(value))

    def like(self, value: Any, ref: Tensor) -> str:
        """``value`` (a tensor or a Python number) as a tensor of ``ref``'s dtype."""
        if isinstance(value, Tensor):
            return value.name if value.dtype == ref.dtype else \
                self.op("Cast", [value.name], to=onnx_dtype(ref.dtype))
        if isinstance(value, Int):
            return self.op("Cast", [value.name], to=onnx_dtype(ref.dtype))
        return self.const(value, ref.dtype)

    def tensor(self, node: fx.Node, name: str) -> Tensor:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ExportError(f"node {node.name!r} ({node.target}) has no tensor metadata; "
                              "tppc cannot export it. fix: report the model")
        return Tensor(name, val.dtype, val.dim())

    # -- graph -----------------------------------------------------------------------------------
    def call(self, node: fx.Node) -> Any:
        """The ONNX value(s) of one ``call_function`` node."""
        fn = _TABLE.get(node.target) or routing_op(node.target) or loop_op(node.target)
        if fn is None:
            raise ExportError(
                f"node {node.name!r} calls {node.target}, which tppc's ONNX export "
                "does not translate. fix: report the op (or run the torch backend)")
        args = fx.node.map_arg(node.args, self.env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, self.env.__getitem__)
        return fn(self, node, *args, **kwargs)

    def run(self, output_names: tuple[str, ...]) -> onnx.ModelProto:
        outputs: list[Any] = []
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.placeholder(node)
            elif node.op == "get_attr":
                self.env[node] = self.attr(node)
            elif node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "output":
                outputs = list(fx.node.map_arg(node.args[0], self.env.__getitem__))
                shapes = [self.shape(a) for a in node.args[0]]
            else:
                raise ExportError(f"node {node.name!r} is a {node.op}; tppc exports flat "
                                  "ATen graphs only")
        names = output_names or tuple(f"out_{i}" for i in range(len(outputs)))
        infos = []
        for out_name, value, shape in zip(names, outputs, shapes):
            if isinstance(value, Int):  # a chunk int one part of a shard hands the next
                self.nodes.append(helper.make_node("Identity", [value.name], [out_name]))
                infos.append(helper.make_tensor_value_info(out_name, TensorProto.INT64, []))
                continue
            if not isinstance(value, Tensor):
                raise ExportError(f"output {out_name!r} is not a tensor ({value!r})")
            self.nodes.append(helper.make_node("Identity", [value.name], [out_name]))
            infos.append(helper.make_tensor_value_info(  # sizes: checked by tppc.load
                out_name, onnx_dtype(value.dtype), shape or [None] * value.rank))
        graph = helper.make_graph(self.nodes, self.name, self.inputs, infos,
                                  initializer=list(self.inits.values()))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="tppc")
        model.ir_version = 9
        return model

    def shape(self, arg: Any) -> list[int | str | None] | None:
        """An output's declared shape: static sizes, an input's symbol, None for the rest."""
        val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return None
        return [int(s) if not isinstance(s, torch.SymInt) else
                self.sym if s.node.expr in self.symbols else None for s in val.shape]

    def placeholder(self, node: fx.Node) -> Any:
        if node.name in self.constants:
            return self.constants[node.name]
        spec = node.meta.get("tppc.chunk_input")
        val = node.meta.get("val")
        carried_int = spec is not None and spec.kind == "boundary" \
            and not isinstance(val, torch.Tensor)  # a chunk int from a shard's previous part
        if spec is not None and (spec.kind in _INT_KINDS or carried_int):
            self.inputs.append(helper.make_tensor_value_info(node.name, TensorProto.INT64, []))
            return Int(node.name)
        if spec is not None and spec.kind in ("key", "value"):
            shape = ["capacity" if s is None else s for s in spec.shape]
            dtype = spec.dtype
        elif spec is not None and spec.kind == "full" and isinstance(val, torch.Tensor):
            shape = ["length" if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
            dtype = val.dtype  # a whole user input (key validity): its own length axis
        elif isinstance(val, torch.Tensor):
            shape = [self.sym if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
            self.symbols |= {s.node.expr for s in val.shape
                             if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol}
            dtype = val.dtype
        else:
            raise ExportError(f"input {node.name!r} is neither a tensor nor a chunk int "
                              f"({val!r}); tppc cannot export it")
        self.inputs.append(helper.make_tensor_value_info(node.name, onnx_dtype(dtype), shape))
        return Tensor(node.name, dtype, len(shape))

    def attr(self, node: fx.Node) -> Tensor:
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
        return Tensor(name, data.dtype, data.dim())


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


