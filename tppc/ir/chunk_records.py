"""Records of the chunk-step and stage graphs: what each placeholder receives, how to call.

Terms:
    chunk-step graph: the program that runs one chunk ``[start, end)`` of the sequence;
        its placeholders are user inputs (sliced or whole), ints, positional values and
        K/V buffers (:class:`ChunkInput`), its call convention a :class:`ChunkSignature`.
    stage graph: the part of a chunk-step graph one pipeline stage runs
        (:class:`StageInfo`); its boundary inputs come from the previous stage.
    rows: positions of the token axis per unit of the sequence symbol (``scale``), after
        an unsplit text ``prefix``, in ``frames`` frame-major blocks (:func:`frame_blocks`).

Every key and record here is also importable from :mod:`tppc.ir.records`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "CHUNK_INPUT",
    "CHUNK_SIGNATURE",
    "STAGE_INFO",
    "ChunkInput",
    "ChunkSignature",
    "InputKind",
    "KVBuffer",
    "StageInfo",
    "frame_blocks",
]

CHUNK_INPUT = "tppc.chunk_input"
"""Placeholder-meta key of a :class:`ChunkInput`."""

CHUNK_SIGNATURE = "tppc.chunk_signature"
"""``GraphModule.meta`` key of the :class:`ChunkSignature` of a chunk-step graph."""

InputKind = Literal["token", "const", "chunk_start", "chunk_size", "seq_len", "positional",
                    "key", "value", "state", "boundary", "full", "hoisted"]


@dataclass(frozen=True)
class ChunkInput:
    """What a placeholder of a chunk-step (or stage) graph receives.

    Attributes:
        kind: ``token`` (a chunk of a user input), ``const`` (a whole user input),
            ``chunk_start`` / ``chunk_size`` / ``seq_len`` (ints), ``positional`` (a slice of
            a frontier value), ``key`` / ``value`` (a K/V buffer), ``boundary`` (a token value
            sent by the previous stage; only in stage graphs), ``full`` (a user input with a
            sequence axis, whole: the key-validity mask of every position so far),
            ``hoisted`` (a const sub-graph's value, :mod:`tppc.passes.stages.hoist_consts`),
            ``state`` (the carried state of a recurrent node: ``shape`` fixed, no token axis).
        source: the user input's name, the frontier node's name, the attention node's name,
            or the boundary value's name.
        index: flat user-input index (token, const) or positional-program output index.
        axis: the token axis to slice (token, positional) or the buffer's token axis.
        shape: key/value buffers: the buffer shape with ``None`` at the token axis; a state
            buffer: its whole shape.
        dtype: key/value buffers: the element type.
        layer: key/value buffers: the layer that owns the buffer.
        scale: positions of the token axis per unit of the sequence symbol (a DiT's patch
            columns, a latent's patch size; 1 for LLM tokens), see
            :mod:`tppc.passes.chunking.token_rows`.
        prefix: the unsplit text segment before the split positions (joint attention).
        suffix: the unsplit text segment after the split positions (K/V buffers only: the
            first chunk of a step writes it after the last split row).
        frames: video frames folded into the token axis (frame-major tokens of a latent
            whose patch rows are the sequence symbol): a chunk of patch rows is then a band
            of rows in every frame, ``frames`` blocks of the axis (:meth:`blocks`).
        parts: key/value buffers of a Ring attention worker: it holds ``1/parts`` of the
            sequence's rows (its own K/V block, :mod:`tppc.passes.meshcut.ring_form`) beside
            the whole text segments.
    """

    kind: InputKind
    source: str = ""
    index: int | None = None
    axis: int | None = None
    shape: tuple[int | None, ...] = ()
    dtype: torch.dtype | None = None
    layer: str = ""
    scale: int = 1
    prefix: int = 0
    suffix: int = 0
    frames: int = 1
    parts: int = 1

    def rows(self, start: int, end: int) -> tuple[int, int]:
        """``(offset, count)`` of the chunk ``[start, end)`` along the token axis; the first
        chunk (``start == 0``) carries the prefix."""
        lo = 0 if start == 0 else self.prefix + self.scale * start
        return lo, self.prefix + self.scale * end - lo

    def blocks(self, start: int, end: int, length: int) -> list[tuple[int, int]]:
        """``(offset, count)`` of each contiguous block of the chunk ``[start, end)`` of a
        sequence of ``length`` units, in the chunk's own order (:func:`frame_blocks`)."""
        return frame_blocks(self.scale, self.prefix, self.frames, start, end, length)


def frame_blocks(scale: int, prefix: int, frames: int, start: int, end: int, length: int
                 ) -> list[tuple[int, int]]:
    """The contiguous blocks ``(offset, count)`` of the chunk ``[start, end)`` along a token
    axis of ``prefix + scale · length`` positions holding ``frames`` frames one after the
    other: the rows ``[start, end)`` of every frame (``scale / frames`` positions per unit and
    frame), the first block from 0 when ``start == 0`` (the chunk carries the prefix).

    >>> frame_blocks(8, 2, 2, 1, 3, 4)   # 2 frames of 4 rows of 4, text prefix of 2
    [(6, 8), (22, 8)]
    """
    if frames == 1:
        lo = 0 if start == 0 else prefix + scale * start
        return [(lo, prefix + scale * end - lo)]
    per = scale // frames
    out = [(prefix + per * (f * length + start), per * (end - start)) for f in range(frames)]
    if start == 0 and prefix:
        out[0] = (0, prefix + out[0][1])
    return out


STAGE_INFO = "tppc.stage_info"
"""``GraphModule.meta`` key of the :class:`StageInfo` of a stage graph."""


@dataclass(frozen=True)
class StageInfo:
    """What a stage graph is.

    Attributes:
        index: stage number.
        layers: names of its layers.
        inputs: names of its boundary inputs (sent by the previous stage), in order.
        outputs: names of its boundary outputs (the last stage: ``()``; it returns the
            model's flat outputs).
        buffers: names of the K/V buffer placeholders it owns.
    """

    index: int
    layers: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    buffers: tuple[str, ...]


@dataclass(frozen=True)
class KVBuffer:
    """One K or V buffer: placeholder name and its :class:`ChunkInput`."""

    name: str
    spec: ChunkInput


@dataclass(frozen=True)
class ChunkSignature:
    """How to call a chunk-step graph and assemble its outputs.

    Attributes:
        user_inputs: names of the captured graph's flat user inputs, in order.
        in_spec: pytree spec of ``(args, kwargs)`` of the model's forward.
        out_spec: pytree spec of the model's outputs.
        output_axes: per flat output, the token axis along which chunks are concatenated
            (``None``: not a token value; the last chunk's value is returned).
        frontier: names of the positional program's outputs, in order.
        buffers: every K/V buffer, in graph order.
        attention: names of the attention nodes, in graph order.
        tail: True when a ``global`` epilogue (``gm.tppc_tail``) turns the full-length chunk
            outputs into the model's outputs; False when the chunk outputs are the model's.
        output_rows: per flat output, ``(scale, prefix, frames)`` of its token axis (see
            :mod:`tppc.passes.chunking.token_rows`, :func:`frame_blocks`), None where
            ``output_axes`` is None.
        length_tables: the frontier values whose rows depend on the call's whole length
            (a dynamic-NTK rope: :mod:`tppc.passes.chunking.length_tables`); a generation
            evaluates them at each step's length.
    """

    user_inputs: tuple[str, ...]
    in_spec: Any
    out_spec: Any
    output_axes: tuple[int | None, ...]
    frontier: tuple[str, ...]
    buffers: tuple[KVBuffer, ...]
    attention: tuple[str, ...]
    tail: bool = False
    output_rows: tuple[tuple[int, ...] | None, ...] = ()
    length_tables: tuple[str, ...] = ()
