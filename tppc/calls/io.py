"""Runtime edges of a compiled pipeline: checking inputs and assembling outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from tppc.ir.records import frame_blocks
from tppc.program.state import Call

if TYPE_CHECKING:
    from tppc.program.program import Program

__all__ = ["OutputAssembler", "output_structure"]


def output_structure(program: Program, leaves: list[Any]) -> Any:
    """The model's output structure from its flat outputs."""
    if program.signature.out_spec is None:
        return leaves[0] if len(leaves) == 1 else tuple(leaves)
    return pytree.tree_unflatten(leaves, program.signature.out_spec)


class OutputAssembler:
    """Writes each chunk's outputs into full-length outputs as the chunk arrives (a sink).

    Outputs the last stage already wrote in place (``call.outputs``) are not copied.
    """

    def __init__(self, axes: tuple[int | None, ...], call: Call,
                 rows: tuple[tuple[int, int] | None, ...] = ()) -> None:
        self.axes, self.call, self.rows = axes, call, rows
        self.leaves: list[Any] = list(call.outputs) if call.outputs else [None] * len(axes)

    def __call__(self, index: int, values: tuple[Any, ...]) -> None:
        start, end = self.call.chunks[index]
        for j, (axis, value) in enumerate(zip(self.axes, values)):
            if axis is None:
                self.leaves[j] = value
                continue
            rows = self.rows[j] if j < len(self.rows) and self.rows[j] else (1, 0)
            if self.leaves[j] is None and (start, end) == (0, self.call.seq_len) \
                    and tuple(rows) in ((1, 0), (1, 0, 1)) and value.shape[axis] == end \
                    and isinstance(value, torch.Tensor) and value._base is None \
                    and not any(value is x for x in self.call.flat_inputs):
                self.leaves[j] = value  # one chunk of every row, a tensor of its own: no copy
                continue
            if self.leaves[j] is None:
                shape = list(value.shape)
                shape[axis] = rows[1] + rows[0] * self.call.seq_len
                self.leaves[j] = value.new_empty(shape)
            frames = rows[2] if len(rows) > 2 else 1
            at = 0
            for lo, count in frame_blocks(rows[0], rows[1], frames, start, end,
                                          self.call.seq_len):  # one block per video frame
                target = self.leaves[j].narrow(axis, lo, count)
                part = value.narrow(axis, at, count) if frames > 1 else value
                at += count
                if not _same_view(target, part):
                    target.copy_(part)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)
