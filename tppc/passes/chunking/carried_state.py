"""Helpers of ``chunk_attention``: the carried state of recurrent nodes.

Terms as in :mod:`tppc.passes.annotation.recurrent` (scan, causal convolution, carried
state) and :mod:`tppc.passes.chunking.chunk_attention` (chunk, chunk step).

Each recurrent node gets one *state buffer*, a placeholder of kind ``state`` owned by the
node's layer (so by the stage that runs it), of shape ``(2, *state)``: slot 0 holds the
state before the first row (the scan's identity, zeros for a convolution; written by every
chunk), slot 1 the state the last chunk left. A chunk reads slot ``min(chunk_start, 1)``
(so a call needs no reset: its first chunk never reads what another call left), runs the
op on ``[state | chunk rows]`` and writes its new state into slot 1:

- a scan: ``op(cat([state, rows]))[1:]``; the state is the last row, kept in the CPU
  kernel's accumulation type (float64 for float32, float32 for 16-bit floats), so the
  chunked scan adds the same numbers in the same order as the whole one (bit-identical on
  CPU);
- a causal convolution: ``conv(cat([state, rows]), padding=0)`` gives the chunk's ``c``
  output rows; the state is the last ``(k − 1)·d`` input rows.
- a causal shift by ``s`` rows: the first ``c`` rows of ``cat([state, rows])``; the state
  is the last ``s`` input rows, slot 0 filled with the pad's value.

- a re-rolled loop (:class:`tppc.ir.loop_scan.LoopScan`): one buffer per carry, shaped as
  the carry; slot 0 is filled with the loop's initial carry by every chunk (``fill_`` as a
  scan's when a creation op makes it: ``zeros``, ``ones``, ``full``; else a copy of it), and the loop's stateful form runs the chunk's rows from the
  slot read, returning the outputs and the final carries, written into slot 1.

The state's shape is the value's with the token axis of size 1 (a scan) or ``(k − 1)·d``
(a convolution): batch × heads × channels, never the length. Later chunks on the same stage
run after earlier ones (the schedule is a permutation flow shop), so the state is always
the previous chunk's.
"""

from __future__ import annotations

import operator as _operator

import torch
from torch import fx

from tppc.errors import PassError
from tppc.ir.loop_scan import LoopScan, is_loop_scan
from tppc.ir.records import CHUNK_INPUT, LAYER, PART, TOKEN, ChunkInput, KVBuffer, TokenInfo
from tppc.passes.annotation.recurrent import SCAN_INIT, causal_shift, conv_state_rows
from tppc.passes.shapes import constant_pad_fill, size_expr, tensor_val

__all__ = ["CarriedState", "is_recurrent", "state_dtype"]

_aten = torch.ops.aten


def is_recurrent(node: fx.Node) -> bool:
    """Whether ``node`` is a recurrent ``mixing`` node (a scan or a causal convolution)."""
    info = node.meta.get(TOKEN)
    return node.op == "call_function" and isinstance(info, TokenInfo) \
        and info.role == "mixing" and info.attention == "recurrent"


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type a scan's state is kept in: the CPU kernel's accumulation type."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype.is_floating_point:
        return torch.float64
    return torch.int64 if not dtype.is_complex and dtype != torch.bool else dtype


class CarriedState:
    """State buffers and recurrent nodes of the chunk-step rewriter
    (``chunk_attention._Rewriter``).

    Uses the rewriter's ``graph``, ``env``, ``start``, ``buffers``, ``buffer_nodes``,
    ``_input`` and ``_new``.
    """

    def _state_inputs(self, recurrent: list[fx.Node]) -> None:
        """One state placeholder per recurrent node (see the module docstring)."""
        for node in recurrent:
            if is_loop_scan(node):
                for j, (shape, dtype) in enumerate(_carry_shapes(node)):
                    self._state_buffer(node, node.name, f"carry{j}", shape, dtype)
            else:
                self._state_buffer(node, node.name, "state", *_state_shape(node))

    def _state_buffer(self, node: fx.Node, owner: str, kind: str, shape: tuple[int, ...],
                      dtype: torch.dtype) -> None:
        """A state placeholder ``<owner>_<kind>`` (slot 0 the start value, slot 1 what the
        last chunk left) in ``node``'s layer and part, registered as a buffer of the step."""
        layer = node.meta.get(LAYER, "")
        spec = ChunkInput("state", owner, shape=(2, *shape), dtype=dtype, layer=layer)
        name = f"{owner}_{kind}"
        ph = self._input(name, spec)
        ph.meta[LAYER] = layer
        if PART in node.meta:
            ph.meta[PART] = node.meta[PART]
        self.buffers.append(KVBuffer(name, spec))
        self.buffer_nodes[owner, kind] = ph

    def _loop(self, node: fx.Node) -> fx.Node:
        """The chunk's rows of a re-rolled loop from its carried states."""
        loop: LoopScan = node.target
        inits, xs, invariants = loop.split(node.args)
        new = lambda target, args: self._new(target, args, node)  # noqa: E731
        bufs = [self.buffer_nodes[node.name, f"carry{j}"] for j in range(loop.carries)]
        slot = new(torch.sym_min, (self.start, 1))
        prevs = []
        for buf, init in zip(bufs, inits, strict=True):
            fill = constant_fill(init)
            if fill is not None:  # the scans' form: the export reads it (state_reads)
                new(_aten.fill_.Scalar, (new(_aten.narrow.default, (buf, 0, 0, 1)), fill))
            else:
                new(_aten.copy_.default, (new(_aten.select.int, (buf, 0, 0)), self.env[init]))
            prevs.append(new(_aten.select.int, (buf, 0, slot)))
        args = (*prevs, *(self.env[x] for x in xs), *(self.env[v] if isinstance(v, fx.Node)
                                                      else v for v in invariants))
        result = self.graph.call_function(loop.stateful(), args)
        result.meta.update(node.meta)  # priced as the loop over the chunk's rows
        carries = [tensor_val(out) for out in _step_outputs(loop)[:loop.carries]]
        result.meta["val"] = (node.meta["val"], *carries)
        out = self.graph.call_function(_operator.getitem, (result, 0))
        for j, buf in enumerate(bufs):
            final = new(_operator.getitem, (result, 1 + j))
            new(_aten.copy_.default, (new(_aten.select.int, (buf, 0, 1)), final))
        out.meta.update(node.meta)
        return out

    def _recurrent(self, node: fx.Node) -> fx.Node:
        """The chunk's rows of a scan or causal convolution from the carried state."""
        if is_loop_scan(node):
            return self._loop(node)
        buf = self.buffer_nodes[node.name, "state"]
        new = lambda target, args: self._new(target, args, node)  # noqa: E731
        conv = node.target not in SCAN_INIT
        shift = causal_shift(node, node.args[0])
        first = new(_aten.narrow.default, (buf, 0, 0, 1))
        new(_aten.fill_.Scalar, (first, constant_pad_fill(node) if shift else
                                 0.0 if conv else SCAN_INIT[node.target]))
        prev = new(_aten.select.int, (buf, 0, new(torch.sym_min, (self.start, 1))))
        rows = self.env[node.args[0]]
        axis = node.args[0].meta[TOKEN].axis
        size = new(_aten.sym_size.int, (rows, axis))
        if shift:
            whole = new(_aten.cat.default, ([prev, rows], axis))
            state = new(_aten.narrow.default, (whole, axis, size, shift))
            out = new(_aten.narrow.default, (whole, axis, 0, size))
        elif conv:
            whole = new(_aten.cat.default, ([prev, rows], axis))
            state = new(_aten.narrow.default, (whole, axis, size, conv_state_rows(node)))
            args = [self.env[a] if isinstance(a, fx.Node) else a for a in node.args]
            args[0] = whole
            args[4] = [0]  # the state rows stand in for the padding before the chunk
            out = self.graph.call_function(node.target, tuple(args), dict(node.kwargs))
        else:
            out_dtype = tensor_val(node).dtype
            rows = self._new(_aten._to_copy.default, (rows,), node,
                             {"dtype": buf.meta[CHUNK_INPUT].dtype})
            whole = new(_aten.cat.default, ([prev, rows], axis))
            scanned = self.graph.call_function(node.target, (whole, axis))
            scanned.meta.update(node.meta)  # priced as the scan over the chunk's rows
            state = new(_aten.narrow.default, (scanned, axis, size, 1))
            out = new(_aten.narrow.default, (scanned, axis, 1, size))
            out = self.graph.call_function(_aten._to_copy.default, (out,),
                                           {"dtype": out_dtype})
        new(_aten.copy_.default, (new(_aten.select.int, (buf, 0, 1)), state))
        out.meta.update(node.meta)
        return out


def _carry_shapes(node: fx.Node) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each carry of a re-rolled loop (its step's outputs)."""
    loop: LoopScan = node.target
    outs = _step_outputs(loop)
    found = []
    for j, (init, out) in enumerate(zip(loop.split(node.args)[0], outs, strict=False)):
        val, init_val = tensor_val(out), tensor_val(init)
        if val is None or init_val is None or any(size_expr(s).free_symbols
                                                  for s in init_val.shape) \
                or tuple(init_val.shape) != tuple(val.shape) or init_val.dtype != val.dtype:
            raise PassError(
                f"re-rolled loop {node.name!r} ({loop.source}): carry {j} starts as "
                f"{init.name} of shape {None if init_val is None else tuple(init_val.shape)} "
                f"and is {None if val is None else tuple(val.shape)} after a step; a carried "
                "state keeps one shape and dtype, sized by batch, heads and channels. fix: "
                "start the state with its own shape (torch.zeros(batch, ..., dtype=...))")
        found.append((tuple(int(s) for s in val.shape), val.dtype))
    return found


_FILLS = {_aten.zeros.default: 0.0, _aten.zeros_like.default: 0.0, _aten.new_zeros.default: 0.0,
          _aten.ones.default: 1.0, _aten.ones_like.default: 1.0, _aten.new_ones.default: 1.0}


def constant_fill(init: object) -> float | None:
    """The value every element of a loop's initial carry holds when a creation op makes it
    (``zeros``, ``ones``, ``full``), else None."""
    if not isinstance(init, fx.Node) or init.op != "call_function":
        return None
    if init.target in _FILLS:
        return _FILLS[init.target]
    if init.target in (_aten.full.default, _aten.full_like.default, _aten.new_full.default):
        value = init.args[1] if init.target is not _aten.new_full.default else init.args[2]
        return float(value) if isinstance(value, int | float) else None
    return None


def _step_outputs(loop: LoopScan) -> tuple[fx.Node, ...]:
    return tuple(next(n for n in loop.step.graph.nodes if n.op == "output").args[0])


def _state_shape(node: fx.Node) -> tuple[tuple[int, ...], torch.dtype]:
    """The state of ``node``: the value's shape with its token axis cut to the rows carried."""
    src = node.args[0]
    val, axis = tensor_val(src), src.meta[TOKEN].axis
    conv = node.target not in SCAN_INIT
    shift = causal_shift(node, src)
    rows = shift or (conv_state_rows(node) if conv else 1)
    shape = []
    for i, s in enumerate(val.shape):
        expr = size_expr(s)
        if i != axis and expr.free_symbols:
            raise PassError(
                f"recurrent node {node.name!r} (op {node.target}, module "
                f"{node.meta[TOKEN].module or '<top level>'}) has a second axis {i} of size "
                f"{expr} that depends on the sequence length; its carried state must be sized "
                "by batch, heads and channels. fix: scan over a value with one token axis")
        shape.append(rows if i == axis else int(expr))
    dtype = val.dtype if conv else state_dtype(tensor_val(node).dtype)
    return tuple(shape), dtype
