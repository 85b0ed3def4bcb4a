"""The declared interface of an ONNX file, read from its protobuf bytes without ``onnx``.

Terms:
    interface: what :func:`read_graph` returns (:class:`Graph`): the graph's inputs and
        outputs (name, element type, dims), the shape of every initializer, where each
        externally stored weight lives, and the nodes (op type, inputs, outputs, ``axis``).
        Weights are skipped by length, never decoded; nested graphs (``If``/``Loop``
        bodies) are walked for external weights only.
    wire format: protobuf fields ``(number, wire type, value)``; wire type 0 is a varint,
        1 and 5 are 8 and 4 bytes, 2 is a length-prefixed slice (a message, a string, a
        packed list). Field numbers are those of ``onnx.proto3``.

A serving machine has numpy and onnxruntime only (see :mod:`tppc.artifact.core.load`), so this
module imports neither onnx nor torch. A malformed file raises :class:`ArtifactError`.

Example:
    >>> g = read_graph(Path("out/stage_1.onnx"))                         # doctest: +SKIP
    >>> g.inputs["add_2"]
    GraphIO(dtype='float32', dims=(1, 'chunk', 64))
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tppc.errors import ArtifactError

__all__ = ["DTYPES", "ExternalWeight", "Graph", "GraphIO", "Node", "read_graph"]

DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32",
          7: "int64", 8: "string", 9: "bool", 10: "float16", 11: "float64", 12: "uint32",
          13: "uint64", 16: "bfloat16"}
"""ONNX ``TensorProto.DataType`` numbers -> numpy-style names."""
_ITEM_BYTES = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8,
               16: 2}
Dims = tuple[int | str | None, ...]


@dataclass(frozen=True)
class GraphIO:
    """A graph input or output: element type name and dims (an int, a symbol, or None)."""

    dtype: str
    dims: Dims | None


@dataclass(frozen=True)
class Node:
    """One node of the top graph: its op type, input and output names, ``axis`` (or 0)."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    axis: int


@dataclass(frozen=True)
class ExternalWeight:
    """A weight stored outside the ONNX file: its file, and the bytes it reads there."""

    name: str
    location: str
    end: int


@dataclass
class Graph:
    """The interface of one ONNX file (see the module docstring)."""

    inputs: dict[str, GraphIO] = field(default_factory=dict)
    outputs: dict[str, GraphIO] = field(default_factory=dict)
    initializers: dict[str, tuple[int, ...]] = field(default_factory=dict)
    external: list[ExternalWeight] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)


def read_graph(path: Path) -> Graph:
    """The interface of the ONNX model at ``path`` (weights skipped, never decoded).

    Raises:
        ArtifactError: the file is not a well-formed ONNX model.
    """
    try:
        return _model(memoryview(path.read_bytes()))
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path.name} is not a well-formed ONNX model ({exc}). fix: "
                            "re-export the artifact") from exc


def _model(buf: memoryview) -> Graph:
    graph = Graph()
    top = [v for n, v in _fields(buf) if n == 7]
    if len(top) != 1:
        raise ValueError(f"{len(top)} graphs")
    todo = [(top[0], True)]
    while todo:  # iterative: nested graphs add work, not stack depth
        body, is_top = todo.pop()
        for n, v in _fields(body):
            if n == 5:
                _initializer(v, graph, is_top)
            elif n == 15:  # sparse initializer: its values tensor
                for m, t in _fields(v):
                    if m == 1:
                        _initializer(t, graph, False)
            elif n == 1:
                todo.extend((g, False) for g in _node(v, graph, is_top))
            elif is_top and n in (11, 12):
                name, io = _value_info(v)
                (graph.inputs if n == 11 else graph.outputs)[name] = io
    for name in graph.initializers:  # old exporters list weights as inputs too
        graph.inputs.pop(name, None)
    return graph


def _initializer(buf: memoryview, graph: Graph, record: bool) -> None:
    dims: list[int] = []
    name, dtype, external, location = "", 0, False, {}
    for n, v in _fields(buf):
        if n == 1:
            dims.extend(_packed(v) if isinstance(v, memoryview) else [v])
        elif n == 2:
            dtype = v
        elif n == 8:
            name = _text(v)
        elif n == 14:
            external = v == 1
        elif n == 13:
            entry = {m: _text(s) for m, s in _fields(v)}
            location[entry.get(1, "")] = entry.get(2, "")
    if record:
        graph.initializers[name] = tuple(dims)
    if external:
        offset = int(location.get("offset") or 0)
        size = location.get("length")
        nbytes = int(size) if size else _ITEM_BYTES.get(dtype, 1) * _prod(dims)
        graph.external.append(ExternalWeight(name, location.get("location", ""),
                                             offset + nbytes))


def _node(buf: memoryview, graph: Graph, record: bool) -> list[memoryview]:
    """Records a top-graph node; returns its subgraphs (and reads attribute tensors)."""
    inputs, outputs, op_type, axis, subgraphs = [], [], "", 0, []
    for n, v in _fields(buf):
        if n == 1:
            inputs.append(_text(v))
        elif n == 2:
            outputs.append(_text(v))
        elif n == 4:
            op_type = _text(v)
        elif n == 5:
            name = ""
            for m, a in _fields(v):
                if m == 1:
                    name = _text(a)
                elif m == 3 and name == "axis":
                    axis = _signed(a)
                elif m in (5, 10):  # a tensor attribute (Constant) may be external too
                    _initializer(a, graph, False)
                elif m in (6, 12):
                    subgraphs.append(a)
    if record:
        graph.nodes.append(Node(op_type, tuple(inputs), tuple(outputs), axis))
    return subgraphs


def _value_info(buf: memoryview) -> tuple[str, GraphIO]:
    name, elem, dims = "", 0, None
    for n, v in _fields(buf):
        if n == 1:
            name = _text(v)
        elif n == 2:
            for m, tensor in _fields(v):
                if m != 1:
                    continue  # a sequence or map type: no tensor element type
                for k, t in _fields(tensor):
                    if k == 1:
                        elem = t
                    elif k == 2:
                        dims = tuple(_dim(d) for j, d in _fields(t) if j == 1)
    return name, GraphIO(DTYPES.get(elem, f"onnx type {elem}"), dims)


def _dim(buf: memoryview) -> int | str | None:
    for n, v in _fields(buf):
        if n == 1:
            return _signed(v)
        if n == 2:
            return _text(v) or None
    return None


# -- wire format -------------------------------------------------------------------------------
def _fields(buf: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """``(field number, value)``: an int for varints, a slice for the other wire types."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield number, value
            continue
        if wire == 2:
            size, pos = _varint(buf, pos)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire} at byte {pos}")
        if pos + size > end:
            raise ValueError(f"field {number} runs past the end ({pos + size} > {end})")
        yield number, buf[pos:pos + size]
        pos += size


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError(f"a truncated or overlong varint at byte {pos}")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _packed(buf: memoryview) -> list[int]:
    out, pos = [], 0
    while pos < len(buf):
        value, pos = _varint(buf, pos)
        out.append(_signed(value))
    return out


def _signed(value: int | memoryview) -> int:
    if not isinstance(value, int):
        raise ValueError("an int field holds bytes")
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(value: int | memoryview) -> str:
    if isinstance(value, int):
        raise ValueError("a string field holds an int")
    return bytes(value).decode("utf-8")


def _prod(dims: list[int]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out
