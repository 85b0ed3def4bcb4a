"""Helpers of ``chunk_attention`` for video latents: a chunk of patch rows in every frame.

Terms:
    frames: the latent frames a video DiT folds into its token axis, frame-major (CogVideoX:
        ``(frames, rows, cols)`` patches, text before them). The sequence symbol counts the
        patch rows of one frame (the latent's height), so the chunk ``[chunk_start,
        chunk_end)`` is a band of rows in *every* frame: ``frames`` blocks of the token axis,
        ``scale / frames`` positions per unit and frame, frame ``f``'s block at
        ``prefix + (scale / frames) · (f · seq_len + chunk_start)``
        (:func:`tppc.ir.records.frame_blocks`).
    frame-major value: a token value whose split axis holds whole frames: its split size is
        a multiple of ``frames · cols`` per unit. A value with the frames on another axis (the latent,
        its patch embedding before the flatten) is cut by its own rows, like an image's.

The chunk's values hold its rows in the chunk's own order (frame by frame); what reads or
writes the full-length axis gathers or scatters the blocks: the K/V write
(:func:`write_frame_rows`), a table baked in at the captured resolution
(:func:`frame_table_rows`), the positional inputs and the outputs at run time
(:meth:`tppc.ir.records.ChunkInput.blocks`). Attention reads the whole buffer, so a chunk's
keys sit at their own positions whatever the chunking: the one-chunk warm-up and the patches
of a pipelined step write the same rows.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import sympy
import torch
from torch import fx

from tppc.errors import PassError
from tppc.ir.context import CompileContext
from tppc.ir.records import LAYER, PART, TOKEN, TokenInfo
from tppc.passes.chunking.token_rows import ABSENT

__all__ = ["chunk_outputs", "frame_table_rows", "token_frames", "write_frame_rows"]

_aten = torch.ops.aten
New = Callable[..., fx.Node]


def token_frames(size: sympy.Expr | None, ctx: CompileContext) -> int:
    """The frames folded into a token axis of split ``size`` (1: none, or one frame): its
    size is a multiple of every frame's patches (``frames · cols · rows``)."""
    grid = ctx.patch_grid
    if len(grid) != 3 or grid[0] < 2 or size is None or ctx.seq_symbol is None:
        return 1
    ratio = sympy.simplify(size / (grid[0] * grid[2] * ctx.seq_symbol))
    return grid[0] if ratio.is_Integer and ratio >= 1 else 1


def _arith(graph: fx.Graph, op: Any, a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int):
        return op(a, b)
    node = graph.call_function(op, (a, b))
    node.meta[TOKEN] = TokenInfo("positional")
    return node


def _blocks(graph: fx.Graph, n: Any, start: Any, seq_len: Any, rows: tuple[int, int, int],
            carry: bool, suffix: int = 0) -> tuple[int, Any, list[Any]]:
    """``(text rows before the frames in the chunk's value, rows per frame block, offset of
    each frame's block along the full axis)``; the value has ``n`` rows, the last ``suffix``
    of them text after the frames when it ``carry``-s the context segments."""
    scale, prefix, frames = rows
    text = prefix if carry else 0  # the first chunk of a step carries the text rows
    tail = suffix if carry else 0
    per_frame = _arith(graph, operator.floordiv, _arith(graph, operator.sub, n, text + tail),
                       frames)
    offsets = []
    for f in range(frames):
        at = _arith(graph, operator.add, _arith(graph, operator.mul, seq_len, f), start)
        at = _arith(graph, operator.mul, at, scale // frames)
        offsets.append(_arith(graph, operator.add, at, prefix))
    return text, per_frame, offsets


def write_frame_rows(graph: fx.Graph, new: New, buf: fx.Node, axis: int, value: fx.Node,
                     marks: tuple[fx.Node, fx.Node], rows: tuple[int, int, int],
                     carry: bool, suffix: int = 0) -> None:
    """Write the chunk's K (or V) ``value`` into ``buf`` block by block (module docstring);
    ``marks`` are ``(chunk_start, seq_len)``, ``new(target, args)`` makes a token node. A
    value that carries a ``suffix`` (text after the frames, the first chunk of a step) writes
    it after the buffer's last frame, at ``prefix + scale · seq_len``."""
    n = new(_aten.sym_size.int, (value, axis))
    text, per_frame, offsets = _blocks(graph, n, *marks, rows, carry, suffix)
    if text:
        new(_aten.copy_.default, (new(_aten.narrow.default, (buf, axis, 0, text)),
                                  new(_aten.narrow.default, (value, axis, 0, text))))
    for f, at in enumerate(offsets):
        src = _arith(graph, operator.add, _arith(graph, operator.mul, per_frame, f), text)
        new(_aten.copy_.default, (new(_aten.narrow.default, (buf, axis, at, per_frame)),
                                  new(_aten.narrow.default, (value, axis, src, per_frame))))
    if suffix and carry:
        scale, prefix, frames = rows
        at = _arith(graph, operator.add, _arith(graph, operator.mul, marks[1], scale), prefix)
        src = _arith(graph, operator.add, _arith(graph, operator.mul, per_frame, frames), text)
        new(_aten.copy_.default, (new(_aten.narrow.default, (buf, axis, at, suffix)),
                                  new(_aten.narrow.default, (value, axis, src, suffix))))


def frame_table_rows(graph: fx.Graph, env: dict[fx.Node, Any], node: fx.Node, table: fx.Node,
                     axis: int, marks: tuple[fx.Node, fx.Node], rows: tuple[int, int, int],
                     carry: bool) -> fx.Node:
    """The chunk's rows of a ``table`` baked in at the captured resolution (frame-major
    along ``axis``), gathered in the chunk's own order, as many as ``node``'s token input
    has (see :func:`tppc.passes.chunking.token_rows.table_rows`)."""
    info: TokenInfo = node.meta[TOKEN]
    token = next(a for a in node.all_input_nodes if a.meta[TOKEN].role in ("token", "mixing")
                 and a.meta[TOKEN].axis_size == info.axis_size)

    def new(target: Any, args: tuple) -> fx.Node:
        made = graph.call_function(target, args)
        made.meta[TOKEN], made.meta[LAYER] = TokenInfo("token"), node.meta.get(LAYER, "")
        if PART in node.meta:
            made.meta[PART] = node.meta[PART]
        return made

    n = new(_aten.sym_size.int, (env[token], token.meta[TOKEN].axis))
    text, per_frame, offsets = _blocks(graph, n, *marks, rows, carry)
    pieces = [new(_aten.narrow.default, (table, axis, 0, text))] if text else []
    pieces += [new(_aten.narrow.default, (table, axis, at, per_frame)) for at in offsets]
    return new(_aten.cat.default, (pieces, axis))


def chunk_outputs(graph: fx.Graph, env: dict[fx.Node, Any], flat: list[Any],
                  rows_of: Callable[[TokenInfo], tuple[int, int, int]]
                  ) -> tuple[tuple[int | None, ...], tuple[tuple[int, int, int] | None, ...]]:
    """The chunk step's output node; per flat output its token axis (None: not a token
    value) and ``(scale, prefix, frames)`` of that axis (``ChunkSignature.output_rows``)."""
    axes: list[int | None] = []
    rows: list[tuple[int, int, int] | None] = []
    outs: list[Any] = []
    for leaf in flat:
        if not isinstance(leaf, fx.Node):
            axes.append(None)
            rows.append(None)
            outs.append(leaf)
            continue
        info: TokenInfo = leaf.meta[TOKEN]
        if info.role == "positional":
            raise PassError(f"output {leaf.name!r} is a positional value; tppc "
                            "pipelines models whose outputs are per-token values")
        axes.append(info.axis if info.role in ("token", "mixing") else None)
        rows.append(rows_of(info) if axes[-1] is not None else None)
        if env[leaf] is ABSENT:
            raise PassError(f"output {leaf.name!r} is text tokens only (a prefix "
                            "segment); tppc pipelines models whose outputs hold the "
                            "image tokens")
        outs.append(env[leaf])
    graph.output(tuple(outs))
    return tuple(axes), tuple(rows)
