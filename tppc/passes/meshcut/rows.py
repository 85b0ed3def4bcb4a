"""Run-time helpers of the token cut: a worker's sub-chunk and its rows of a chunk's values.

Terms:
    sub-chunk: the chunk ``[a, a + c)`` (sequence units) cut into ``parts`` equal pieces;
        part ``p`` is ``[a + p·c/parts, a + (p+1)·c/parts)``. A worker runs the stage graph
        on its sub-chunk.
    rows of a part: a chunk's value holds ``frames`` blocks of equal rows along its token
        axis (video: one band of rows per frame, :meth:`tppc.ir.records.ChunkInput.blocks`);
        part ``p`` takes the ``p``-th equal piece of every block, in order.

These run inside worker graphs (fx calls them as functions), so they take ints and tensors.

Example:
    >>> import torch
    >>> part_rows(torch.arange(8), 0, 1, 2, frames=2).tolist()
    [2, 3, 6, 7]
    >>> interleave_parts(torch.tensor([0, 1, 4, 5, 2, 3, 6, 7]), 0, 2, frames=2).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
"""

from __future__ import annotations

import torch

from tppc.errors import SpecError

__all__ = ["interleave_parts", "part_rows", "sub_size", "sub_start"]


def sub_size(size: int, parts: int, what: str) -> int:
    """The sub-chunk's size: ``size / parts`` (SpecError naming ``what`` when it does not
    divide)."""
    if size % parts:
        raise SpecError(f"{what}: a chunk of {size} sequence units does not cut into "
                        f"{parts} equal parts (ring x ulysses = {parts}). fix: a sequence "
                        f"length (or patch) divisible by {parts}, or smaller ring/ulysses")
    return size // parts


def sub_start(start: int, size: int, part: int) -> int:
    """The first unit of part ``part`` of sub-chunks of ``size`` units from ``start``."""
    return start + part * size


def part_rows(x: torch.Tensor, axis: int, part: int, parts: int, frames: int = 1,
              prefix: int = 0, suffix: int = 0) -> torch.Tensor:
    """Part ``part`` of ``parts`` of every one of the ``frames`` blocks of ``x``'s ``axis``;
    the ``prefix`` and ``suffix`` rows (text beside the image tokens) kept whole."""
    if prefix or suffix:
        inner = x.narrow(axis, prefix, x.shape[axis] - prefix - suffix)
        pieces = [x.narrow(axis, 0, prefix), part_rows(inner, axis, part, parts, frames),
                  x.narrow(axis, x.shape[axis] - suffix, suffix)]
        return torch.cat(pieces, axis)
    rows = x.shape[axis]
    if rows % (parts * frames):
        raise SpecError(f"a value of {rows} rows on axis {axis} ({frames} frame blocks) does "
                        f"not cut into {parts} equal parts per block. fix: a length "
                        f"divisible by {parts}")
    if frames == 1:
        step = rows // parts
        return x.narrow(axis, part * step, step)
    step = rows // frames // parts
    blocks = x.unflatten(axis, (frames, parts * step))
    return blocks.narrow(axis + 1, part * step, step).flatten(axis, axis + 1)


def interleave_parts(x: torch.Tensor, axis: int, parts: int, frames: int = 1) -> torch.Tensor:
    """The inverse order of a gather of :func:`part_rows`: ``parts`` pieces of ``frames``
    blocks each, back into ``frames`` blocks of ``parts`` pieces each."""
    if frames == 1:
        return x
    blocks = x.unflatten(axis, (parts, frames, -1)).transpose(axis, axis + 1)
    return blocks.flatten(axis, axis + 2)
