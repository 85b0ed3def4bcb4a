"""Helpers of ``chunk_attention``: full-length buffers and the reads that follow them.

Terms as in :mod:`tppc.passes.chunking.chunk_attention`; *buffered mixing* as in
:mod:`tppc.passes.annotation.buffered_mixing` (linear attention's token contraction, a neighbourhood
convolution over the token axis).

:class:`BufferReads` is the part of the chunk-step rewriter that writes a chunk's rows into
a buffer and reads the buffer back: SDPA's K and V (read up to ``kv_len``), and the operands
of buffered mixing (read whole: the op then runs over every row of the sequence).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from tppc.ir.records import CHUNK_INPUT, TOKEN, ChunkInput, TokenInfo
from tppc.passes.annotation.buffered_mixing import buffered_operands
from tppc.passes.chunking.chunk_parts import SIZE_ARG_OPS, cache_source, sdpa_kwargs
from tppc.passes.chunking.context_rows import write_rows
from tppc.passes.chunking.frame_rows import write_frame_rows
from tppc.passes.chunking.token_rows import row_offset, rows_per_unit, split_size

__all__ = ["BufferReads", "buffered_inputs"]

_aten = torch.ops.aten


def buffered_inputs(node: fx.Node) -> dict[str, fx.Node]:
    """The inputs of a buffered node by buffer kind: SDPA's ``key`` and ``value``, or the
    operands of buffered mixing."""
    operands = buffered_operands(node)
    if operands is not None:
        return operands
    args = sdpa_kwargs(node)
    return {"key": args["key"], "value": args["value"]}


def _whole_rows(new: fx.Node, like: fx.Node) -> None:
    """Price ``new`` as ``like``'s value over the whole sequence: its token axis becomes a
    key axis of bidirectional attention (``L`` rows, not the chunk's ``c``)."""
    info: TokenInfo = like.meta[TOKEN]
    new.meta["val"] = like.meta.get("val")
    new.meta[TOKEN] = TokenInfo("token", other_axes=(info.axis,), attention="bidirectional",
                                module=info.module)


class BufferReads:
    """Buffer writes and reads of the chunk-step rewriter (``chunk_attention._Rewriter``).

    Uses the rewriter's ``graph``, ``env``, ``sym``, ``ctx``, ``carry``, ``start``, ``size``,
    ``seq_len``, ``buffer_nodes`` and ``_new``.
    """

    def _buffered_mixing(self, node: fx.Node) -> fx.Node:
        """Linear attention's contraction, or a neighbourhood convolution, over the whole
        buffer of its operands; a convolution's output is cut back to the chunk's rows."""
        operands = buffered_operands(node) or {}
        args: dict[fx.Node, Any] = {a: self.env[a] for a in node.all_input_nodes}
        rows = (1, 0)
        for which, operand in operands.items():
            info: TokenInfo = operand.meta[TOKEN]
            rows = (rows_per_unit(split_size(info), self.ctx) or 1, info.prefix)
            buf = self.buffer_nodes[node.name, which]
            whole = row_offset(self.graph, self.seq_len, *rows)
            args[operand] = self._read_buffer(operand, buf, buf.meta[CHUNK_INPUT].axis, whole,
                                              node, repeat=True)
            _whole_rows(args[operand], operand)
        out = self.graph.node_copy(node, lambda a: args[a])
        axis = node.meta[TOKEN].axis
        if axis is None:
            return out  # a contraction: no token axis left
        _whole_rows(out, node)
        source = self.env[next(iter(operands.values()))]
        offset = row_offset(self.graph, self.start, rows[0], 0 if self.carry else rows[1])
        size = self._new(_aten.sym_size.int, (source, axis), node)
        rows_out = self._new(_aten.narrow.default, (out, axis, offset, size), node)
        rows_out.meta.update({k: node.meta[k] for k in ("val", TOKEN)})
        return rows_out

    def _read_buffer(self, arg: fx.Node, buf: fx.Node, axis: int, kv_len: Any,
                     layer: fx.Node, *, repeat: bool, frames: int = 1) -> fx.Node:
        """Write the chunk's rows of ``arg`` into ``buf`` (its spec's ``[prefix | scale ·
        units | suffix]`` layout; a video's ``frames`` blocks: a band of rows in every
        frame) and read ``buf`` back up to ``kv_len`` rows."""
        source, chain = cache_source(arg, self.sym)
        chain = chain if repeat else []
        offset, size = self.start, self.size
        spec: ChunkInput = buf.meta[CHUNK_INPUT]
        rows, suffix = (spec.scale, spec.prefix), spec.suffix if self.carry else 0
        if frames > 1:
            write_frame_rows(self.graph, lambda t, a: self._new(t, a, layer), buf, axis,
                             self.env[source], (self.start, self.seq_len), (*rows, frames),
                             self.carry, spec.suffix)
            return self._read_back(buf, axis, kv_len, layer, chain)
        if rows != (1, 0) or suffix:  # the chunk's rows: prefix + scale · start on, as many as
            offset = row_offset(self.graph, self.start, rows[0], 0 if self.carry else rows[1])
            size = self._new(_aten.sym_size.int, (self.env[source], axis), layer)  # it has
        at = row_offset(self.graph, self.seq_len, rows[0], rows[1]) if suffix else None
        write_rows(lambda t, a: self._new(t, a, layer), buf, axis, self.env[source], offset,
                   size, suffix, at)
        return self._read_back(buf, axis, kv_len, layer, chain)

    def _read_back(self, buf: fx.Node, axis: int, kv_len: Any, layer: fx.Node,
                   chain: list[fx.Node]) -> fx.Node:
        """``buf`` up to ``kv_len`` rows, through the ops between the cached value and its
        reader (``chain``: a head repeat, with its size argument at the buffer's length)."""
        value = self._new(_aten.narrow.default, (buf, axis, 0, kv_len), layer)
        for step in chain:
            args = [value, *(self.env[a] if isinstance(a, fx.Node) else a for a in step.args[1:])]
            if step.target in SIZE_ARG_OPS:
                sizes = list(args[1])
                token_axis = step.meta[TOKEN].axis
                if sizes[token_axis] != -1:
                    sizes[token_axis] = kv_len
                args[1] = sizes
            value = self._new(step.target, tuple(args), layer, dict(step.kwargs))
        return value
