"""State buffers for export: a chunk's new state as an output instead of an in-place write.

Terms as in :mod:`tppc.passes.chunking.carried_state` (state buffer of shape ``(2, *state)``,
slot 0 the start value, slot 1 the state the last chunk on the stage left). An emitted stage
graph fills slot 0 (``fill_(narrow(buffer, 0, 0, 1), v)``), reads slot
``min(chunk_start, 1)`` and writes slot 1 (``copy_(select(buffer, 0, 1), state)``) in place.
A portable graph cannot mutate its inputs, so the export stage graph

- reads the buffer with :func:`state_read` (slot 1, or the start value ``v`` at the call's
  first chunk: the fill moves into the graph, and a runner never writes slot 0);
- returns the chunk's new state as one more output (``kv.<buffer>``, one slot: ``state``'s
  shape), which the runner writes into slot 1 after the chunk, as it writes a chunk's K/V
  rows into a K/V buffer (:mod:`tppc.artifact.writer.graphs`).

A chunk thus reads the state its stage's previous chunk left, at a cost fixed by batch,
heads and channels (never the length). Recurrent scans and causal convolutions
(:mod:`tppc.passes.chunking.carried_state`) and block scans
(:mod:`tppc.passes.chunking.block_state`) write their state this way.

Example:
    >>> rows = functional_states(gm.graph, stage)                          # doctest: +SKIP
    >>> sorted(rows)
    ['cumsum_state', 'conv1d_state']
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import optimization_hint as hint_int

from tppc.errors import ExportError
from tppc.ir.records import CHUNK_INPUT

__all__ = ["STATE_OPS", "functional_states", "state_read"]

_aten = torch.ops.aten
_SLOT = "tppc.export.state_slot"
"""Key of the state buffer a :func:`state_read` node reads (its value: one slot)."""


def state_read(buffer: torch.Tensor, index: Any, fill: float | torch.Tensor) -> torch.Tensor:
    """Slot ``min(index, 1)`` of a state buffer whose slot 0 holds ``fill`` (a number, or a
    tensor the graph computes: a re-rolled loop's initial carry): the state the previous
    chunk left (``index > 0``), else the start value (the torch reference of the ONNX
    translation)."""
    slot = buffer.select(0, 1)
    if index > 0:
        return slot.clone()
    if isinstance(fill, torch.Tensor):
        return fill.expand_as(slot).clone()
    return torch.full_like(slot, fill)


def functional_states(graph: fx.Graph, stage: Any) -> dict[str, fx.Node]:
    """Rewrite the in-place state writes of ``stage``'s state buffers in ``graph`` (a copy of
    its module's graph; see the module docstring); returns each buffer's new-state node.

    Raises:
        ExportError: a state buffer used otherwise than filled, read by slot and written
            into slot 1 once (naming the buffer, its layer and the node).
    """
    placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
    out: dict[str, fx.Node] = {}
    written: list[tuple[Any, fx.Node, fx.Node]] = []
    for b in stage.buffers:
        if b.kind != "state":
            continue
        buf = placeholders.get(b.name)
        if buf is None:
            _refuse(b, None, "is not an input of the stage graph")
        fill, reads, writes = None, [], []
        for user in list(buf.users):
            if _target(user) is _aten.narrow.default and tuple(user.args[1:]) == (0, 0, 1) \
                    and user.users and all(_target(u) is _aten.fill_.Scalar
                                           for u in user.users):
                fill = next(iter(user.users)).args[1]
                for u in list(user.users):
                    graph.erase_node(u)
                graph.erase_node(user)
            elif _target(user) is _aten.select.int and user.args[1] == 0:
                copies = [u for u in user.users
                          if _target(u) is _aten.copy_.default and u.args[0] is user]
                if copies and user.args[2] == 0 and len(user.users) == 1:
                    fill = copies[0].args[1]  # a start value the graph computes (a loop's)
                    graph.erase_node(copies[0])
                    graph.erase_node(user)
                elif copies:
                    if user.args[2] != 1 or len(user.users) != 1:
                        _refuse(b, user, "is written other than once into slot 1")
                    writes.append((user, copies[0]))
                else:
                    reads.append(user)
            else:
                _refuse(b, user, f"is used by {_target(user)} (not a fill, a slot read or a "
                        "slot write)")
        if fill is None or len(writes) != 1:
            _refuse(b, None, f"has {len(writes)} slot writes and "
                    f"{'no' if fill is None else 'a'} start value (one of each expected)")
        written.append((b, *writes[0]))
        for read in reads:
            index = read.args[2]
            if _target(index) is torch.sym_min and index.args[1] == 1:
                index = index.args[0]  # min(chunk_start, 1) > 0 iff chunk_start > 0
            with graph.inserting_before(read):
                new = graph.call_function(state_read, (buf, index, fill if isinstance(
                    fill, fx.Node) else float(fill)))
            new.meta = dict(read.meta)
            new.meta[_SLOT] = b
            read.replace_all_uses_with(new)
            graph.erase_node(read)
    known = _fill_vals(graph, stage) if written else {}
    for b, slot, copy in written:
        out[b.name] = _new_state(graph, b, slot, copy, known)
    return out


def _fill_vals(graph: fx.Graph, stage: Any) -> dict[fx.Node, Any]:
    """``meta["val"]`` of the nodes the chunk-step rewriter made for the carried states (it
    records none; the ONNX translation reads their dtypes and ranks), as tensors on the
    meta device from the records' size hints (the capture's shape environment is never
    touched: a fake op could specialise its symbols). Each node without a record is run on
    its arguments' meta tensors, those after a state read recomputed so for their users
    only (a record keeps the capture's symbolic sizes); the state buffers come from their
    specs, ``chunk_start`` is 16 rows in, ``chunk_size`` the hint of the first symbolic
    size of an input. A node whose arguments have none, or that cannot run so, keeps what
    it had (the translation names it if it needs one). Returns the values computed (meta
    tensors and ints), by node."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    specs = {b.name: b for b in stage.buffers}
    sizes = [s for n in placeholders for s in getattr(n.meta.get("val"), "shape", ())
             if isinstance(s, torch.SymInt)]
    known: dict[fx.Node, Any] = {}
    for node in placeholders:
        spec, b = node.meta.get(CHUNK_INPUT), specs.get(node.name)
        kind = getattr(spec, "kind", None)
        if b is not None and b.kind == "state":
            node.meta["val"] = torch.empty(b.shape, dtype=b.dtype, device="meta")
        elif kind == "chunk_start":
            known[node] = 16
        elif kind == "chunk_size" and sizes:
            known[node] = hint_int(sizes[0])
    missing = object()

    def value(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        if a in known:
            return known[a]
        return _on_meta(a.meta.get("val", missing), missing)

    after_state: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is state_read:
            b = node.meta[_SLOT]
            known[node] = torch.empty(b.shape[1:], dtype=b.dtype, device="meta")
            node.meta.setdefault("val", known[node])
            after_state.add(node)
            continue
        if any(a in after_state for a in node.all_input_nodes):
            after_state.add(node)
        elif "val" in node.meta:
            continue
        args = fx.node.map_aggregate(node.args, value)
        kwargs = fx.node.map_aggregate(node.kwargs, value)
        if any(x is missing for x in _leaves([*args, *kwargs.values()])):
            continue
        if "device" in kwargs:
            kwargs["device"] = "meta"
        try:
            result = node.target(*args, **kwargs)
        except Exception:  # left without a record, as before
            continue
        if isinstance(result, torch.Tensor | int):
            known[node] = result
        if isinstance(result, torch.Tensor):
            old = node.meta.get("val")  # a record is kept (its symbolic sizes), in the
            if not isinstance(old, torch.Tensor) or old.dim() != result.dim():  # new dtype
                node.meta["val"] = result
            elif old.dtype != result.dtype:  # (a scan over the carried state: its dtype)
                node.meta["val"] = old.to(result.dtype)
    return known


def _on_meta(val: Any, missing: Any) -> Any:
    """A record as a meta tensor (sizes: their hints), a size as its hint."""
    if isinstance(val, torch.SymInt):
        return hint_int(val)
    if isinstance(val, torch.Tensor):
        return torch.empty([hint_int(s) if isinstance(s, torch.SymInt) else int(s)
                            for s in val.shape], dtype=val.dtype, device="meta")
    if isinstance(val, list | tuple):  # a split's parts
        parts = [_on_meta(v, missing) for v in val]
        return missing if any(p is missing for p in parts) else type(val)(parts)
    if isinstance(val, torch.SymFloat | torch.SymBool):
        return missing
    return val


def _leaves(items: Any) -> list[Any]:
    out: list[Any] = []
    for x in items:
        out.extend(_leaves(x) if isinstance(x, (list, tuple)) else [x])
    return out


def _new_state(graph: fx.Graph, b: Any, slot: fx.Node, copy: fx.Node,
               known: dict[fx.Node, Any]) -> fx.Node:
    """The value ``copy`` wrote into ``slot``, in the slot's dtype (the writes removed);
    ``known``: the values :func:`_fill_vals` computed (meta tensors: comparing a record's
    symbolic sizes would specialise the capture's symbols)."""
    value = copy.args[1]
    want = known.get(slot)
    got = known.get(value, _on_meta(value.meta.get("val"), None))
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor) \
            or tuple(want.shape) != tuple(got.shape):
        _refuse(b, copy, f"is written a value of shape "
                f"{tuple(getattr(got, 'shape', ()))} into a slot of shape "
                f"{tuple(getattr(want, 'shape', ()))}")
    graph.erase_node(copy)
    graph.erase_node(slot)
    if got.dtype == want.dtype:
        return value
    with graph.inserting_after(value):
        cast = graph.call_function(_aten._to_copy.default, (value,), {"dtype": want.dtype})
    cast.meta = {"val": got.to(want.dtype)}
    return cast


def _target(node: Any) -> Any:
    return node.target if isinstance(node, fx.Node) and node.op == "call_function" else None


def _refuse(b: Any, node: fx.Node | None, what: str) -> None:
    at = f" (node {node.name!r})" if node is not None else ""
    raise ExportError(f"state buffer {b.name!r} of layer {b.layer!r}{at} {what}; tppc "
                      "cannot export its carried state. fix: report the model, or run it "
                      "with backend='torch'")


def _state_read(t: Any, node: fx.Node, buffer: Any, index: Any, fill: Any) -> Any:
    """:func:`state_read` in ONNX: ``Where(index > 0, Gather(buffer, 1), fill)``."""
    from tppc.artifact.writer.onnx_ops import Int, Tensor

    slot = t.op("Gather", [buffer.name, t.const(1)], axis=0)
    start = t.like(fill, Tensor(slot, buffer.dtype, 0)) if isinstance(fill, Tensor) \
        else t.const(fill, buffer.dtype)
    if isinstance(index, int):
        if index > 0:
            return t.tensor(node, slot)
        return t.tensor(node, t.op("Expand", [start, t.op("Shape", [slot])]))
    if not isinstance(index, Int):
        raise ExportError(f"node {node.name!r} reads a state slot by {index!r}, neither an "
                          "int nor the chunk's start; tppc cannot export it. fix: report the "
                          "model")
    first = t.op("Greater", [index.name, t.const(0)])
    value = t.op("Where", [first, slot, start])
    return t.tensor(node, value)


STATE_OPS: dict[Any, Any] = {state_read: _state_read}
"""The ONNX translation of :func:`state_read` (joins the tables of
:func:`tppc.artifact.writer.to_onnx.to_onnx`)."""
