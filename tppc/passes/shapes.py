"""Helpers shared by the passes: symbolic shapes, module paths, op dimensions.

Terms:
    symbolic value: what ``node.meta["val"]`` holds for a tensor: a fake tensor whose sizes
        are ``torch.SymInt`` (or ints where torch.export specialised them).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import sympy
import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function
from torch.utils._sympy.functions import Max as _TorchMax
from torch.utils._sympy.functions import Min as _TorchMin

__all__ = [
    "SHAPE_USES",
    "ancestors",
    "call_module_of",
    "constant_pad_fill",
    "module_path",
    "op_dims",
    "op_name",
    "seq_axes",
    "size_expr",
    "source_line",
    "tensor_val",
]

SHAPE_USES = frozenset({torch.ops.aten.sym_size.int,
                        torch.ops.aten._assert_tensor_metadata.default})
"""Ops that read only a tensor's size or metadata, never its values."""


def constant_pad_fill(node: fx.Node) -> float | None:
    """The fill value of a constant pad node (``pad(x, pad, "constant", value)`` or
    ``constant_pad_nd(x, pad, value)``), or None when ``node`` is no constant pad."""
    aten = torch.ops.aten
    if node.op != "call_function" or len(node.args) < 2 \
            or node.target not in (aten.pad.default, aten.constant_pad_nd.default):
        return None
    full = node.target is aten.pad.default
    mode = node.args[2] if full and len(node.args) > 2 else node.kwargs.get("mode", "constant")
    at = 3 if full else 2
    value = node.args[at] if len(node.args) > at else node.kwargs.get("value")
    return None if mode != "constant" else 0.0 if value is None else float(value)


def ancestors(nodes: Iterable[fx.Node]) -> set[fx.Node]:
    """``nodes`` and every node they are computed from (their transitive inputs)."""
    needed: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(n.all_input_nodes)
    return needed


def tensor_val(node: Any) -> Any:
    """The node's (first) tensor value from ``meta["val"]`` (a fake tensor), or None."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, list | tuple):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return val if isinstance(val, torch.Tensor) else None


def size_expr(size: int | torch.SymInt | sympy.Expr) -> sympy.Expr:
    """A tensor size (int, ``SymInt`` or sympy expression) as a sympy expression, torch's
    ``Max``/``Min`` as sympy's, which evaluate under the symbols' assumptions (MPT's ALiBi
    rows ``1 - Max(0, 1 - s)`` are 1 for every positive ``s``; torch's stays symbolic)."""
    if isinstance(size, torch.SymInt):
        size = size.node.expr
    if isinstance(size, sympy.Basic):
        return _sympy_minmax(size) if size.has(_TorchMax, _TorchMin) else size
    return sympy.Integer(int(size))


@functools.lru_cache(maxsize=4096)
def _sympy_minmax(expr: sympy.Expr) -> sympy.Expr:
    return expr.replace(_TorchMax, sympy.Max).replace(_TorchMin, sympy.Min)


def seq_axes(node: fx.Node, sym: sympy.Symbol) -> tuple[list[int], list[sympy.Expr]]:
    """Axes of the node's tensor value whose size depends on ``sym``, and those sizes."""
    val = tensor_val(node)
    if val is None:
        return [], []
    axes, sizes = [], []
    for i, size in enumerate(val.shape):
        expr = size_expr(size)
        if sym in expr.free_symbols:
            axes.append(i)
            sizes.append(expr)
    return axes, sizes


def module_path(node: fx.Node) -> str:
    """Innermost module path of the node (``"model.layers.0.self_attn"``), or ``""``.

    Taken from ``nn_module_stack``; a ``call_module`` node without one is its own target.
    """
    stack = node.meta.get("nn_module_stack") or {}
    for path, _cls in reversed(list(stack.values())):
        if path and not path.startswith("_"):
            return path
    if node.op == "call_module":
        return str(node.target)
    return ""


def call_module_of(node: fx.Node) -> torch.nn.Module | None:
    """The submodule a ``call_module`` node calls, or None for other nodes."""
    owner = node.graph.owning_module
    if node.op != "call_module" or owner is None:
        return None
    return owner.get_submodule(str(node.target))


def op_dims(node: fx.Node, src: fx.Node) -> set[int]:
    """The dimensions of ``src`` that the op works along (normalised to be non-negative).

    Understands aten ops, torch-level functions (``torch.cumsum``, ``F.softmax``), tensor
    methods (``x.softmax(-1)``) and ``nn.Softmax``-like modules with a ``dim`` attribute.
    """
    val = tensor_val(src)
    rank = val.dim() if val is not None else 0
    kwargs = _normalized_kwargs(node)
    dims: Any = kwargs.get("dim", kwargs.get("dims")) if kwargs is not None else None
    module = call_module_of(node)
    if module is not None:
        dims = getattr(module, "dim", None)
    if dims is None:
        return set()
    if isinstance(dims, int):
        dims = [dims]
    out = set()
    for d in dims:
        if isinstance(d, int) and rank:
            out.add(d % rank)
    return out


def _normalized_kwargs(node: fx.Node) -> dict[str, Any] | None:
    """The op's arguments as keywords (defaults filled in), or None when unknown."""
    target: Any = node.target
    if node.op == "call_method":
        target = getattr(torch, str(node.target), None)
    elif node.op != "call_function":
        return None
    if target is None:
        return None
    arg_types = None
    if not isinstance(target, torch._ops.OpOverload):
        arg_types = tuple(_arg_type(a) for a in node.args)
    try:
        norm = normalize_function(
            target, tuple(node.args), dict(node.kwargs), arg_types=arg_types,
            kwarg_types={k: _arg_type(v) for k, v in node.kwargs.items()} if arg_types else None,
            normalize_to_only_use_kwargs=True,
        )
    except Exception:
        norm = None
    return norm.kwargs if norm is not None else None


def _arg_type(arg: Any) -> Any:
    if isinstance(arg, fx.Node):
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            return torch.Tensor
        return int if isinstance(val, sympy.Basic | int) else type(val)
    return type(arg)


def op_name(node: fx.Node) -> str:
    """The op's name: an ATen overload's packet (``softmax``), else the target's ``__name__``."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def source_line(node: fx.Node) -> str:
    """``file:line (function)`` of the model code that made ``node``: the last frame of its
    trace (torch.export records a module's ``forward``; a helper it calls shows as the call)."""
    trace = node.meta.get("stack_trace") or ""
    frames = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    parts = frames[-1].split(", ") if frames else []
    if len(parts) < 3:
        return "source line unknown"
    return f"{parts[0][5:].strip(chr(34))}:{parts[1].split()[-1]} ({parts[2][3:]})"
