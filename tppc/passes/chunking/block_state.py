"""Helpers of ``chunk_attention``: the carried state of block scan regions.

Terms as in :mod:`tppc.passes.annotation.block_scan` (block, block scan, carried state) and
:mod:`tppc.passes.chunking.carried_state` (state buffer, slots).

Each region gets one state buffer of shape ``(2, *init)`` owned by its layer: slot 0 holds
the zero state before the first block (written by every chunk), slot 1 the state the last
chunk left. A chunk runs the region's ops on its own blocks, with the region's ``init``
(the zero slot prepended to the per-block states) replaced by slot
``min(chunk_start, 1)``; the region's rows for the chunk's blocks are then the states
entering them, and its last slot, the state after the chunk's last block, is written into
slot 1 for the next chunk on the same stage (chunks run in order on a stage: see
:mod:`tppc.passes.chunking.carried_state`). The ``(c+1) × (c+1)`` decay matrix and its
masks are rebuilt from the chunk's own size.
"""

from __future__ import annotations

import torch
from torch import fx

from tppc.passes.annotation.block_scan import BLOCK_SCAN, BlockScanPart
from tppc.passes.shapes import size_expr, tensor_val

__all__ = ["BlockState", "block_scan_part"]

_aten = torch.ops.aten
_END = 9223372036854775807


def block_scan_part(node: fx.Node) -> BlockScanPart | None:
    """The node's part in a block scan region, or None."""
    return node.meta.get(BLOCK_SCAN)


class BlockState:
    """State buffers and block scan regions of the chunk-step rewriter
    (``chunk_attention._Rewriter``).

    Uses the rewriter's ``graph``, ``env``, ``start``, ``buffer_nodes``, ``_new`` and
    :meth:`CarriedState._state_buffer`.
    """

    def _block_state_inputs(self, nodes: list[fx.Node]) -> None:
        """One state placeholder per block scan region whose ``init`` the step reads."""
        for node in nodes:
            part = block_scan_part(node)
            if part is None or part.part != "init":
                continue
            val = tensor_val(node)
            shape = tuple(int(size_expr(s)) for s in val.shape)
            self._state_buffer(node, part.region, "block_state", shape, val.dtype)

    def _block_scan(self, node: fx.Node) -> fx.Node:
        """A node of a block scan region over the chunk's blocks (see the module docstring)."""
        part = block_scan_part(node)
        buf = self.buffer_nodes[part.region, "block_state"]
        new = lambda target, args: self._new(target, args, node)  # noqa: E731
        if part.part == "init":
            first = new(_aten.narrow.default, (buf, 0, 0, 1))
            new(_aten.fill_.Scalar, (first, 0.0))
            prev = new(_aten.select.int, (buf, 0, new(torch.sym_min, (self.start, 1))))
            out = new(_aten.clone.default, (prev,))
        else:
            out = self.graph.node_copy(node, lambda a: self.env[a])
            if part.part == "exit" and (part.region, "written") not in self.buffer_nodes:
                whole = self.env[node.args[0]]
                last = new(_aten.slice.Tensor, (whole, part.axis, -1, _END))
                new(_aten.copy_.default, (new(_aten.select.int, (buf, 0, 1)), last))
                self.buffer_nodes[part.region, "written"] = last
        out.meta.update(node.meta)
        return out
