"""Let the last stage write its per-token outputs straight into the full-length outputs.

Without this, every chunk's logits are computed into a fresh tensor and then copied into the
full-length output (in the calling thread, which competes with the stage workers for the
cores): for a 32000-word vocabulary at 2048 tokens that is 262 MB written twice. A model
output made by ``aten.linear`` without bias (an LM head) is instead computed with
``aten.linear.out`` into the chunk's rows of the full-length output; the values are the same
(the same GEMM, only the destination differs).

Terms:
    out slot: one such output: its flat output index, its token axis, its full-length shape
        (``None`` at the token axis) and dtype; the stage runner passes the slice
        ``[chunk_start, chunk_start + chunk_size)`` of the output (or a fresh tensor when the
        call has no full-length outputs, e.g. the prefill inside ``generate``).
"""

from __future__ import annotations

import torch
from torch import fx

from tppc.passes.subgraph import copy_graph
from tppc.program.program import OutSlot

__all__ = ["write_outputs_in_place"]

_aten = torch.ops.aten


def write_outputs_in_place(module: fx.GraphModule, axes: tuple[int | None, ...]
                           ) -> tuple[fx.GraphModule, dict[str, OutSlot]]:
    """A copy of the last stage's graph whose bias-free linear outputs take an ``out`` input.

    Args:
        module: the last stage graph (its outputs are the chunk-step graph's outputs).
        axes: the token axis of each flat output (``ChunkSignature.output_axes``).

    Returns:
        ``(graph module, {placeholder name: slot})``; the module itself and ``{}`` when no
        output qualifies. The new placeholders follow the stage's own placeholders.
    """
    copy = copy_graph(module, class_name=type(module).__name__)
    graph = copy.graph
    output = graph.output_node()
    leaves = list(output.args[0]) if isinstance(output.args[0], tuple | list) else []
    slots: dict[str, OutSlot] = {}
    last_placeholder = list(graph.find_nodes(op="placeholder"))[-1:]
    for j, leaf in enumerate(leaves):
        slot = _slot(leaf, j, axes[j] if j < len(axes) else None, leaves)
        if slot is None:
            continue
        anchor = last_placeholder[-1] if last_placeholder else next(iter(graph.nodes))
        insert = graph.inserting_after if last_placeholder else graph.inserting_before
        with insert(anchor):
            ph = graph.placeholder(f"out_{leaf.name}")
        last_placeholder.append(ph)
        with graph.inserting_after(leaf):
            new = graph.call_function(_aten.linear.out, (*leaf.args[:2], None), {"out": ph})
        new.meta.update(leaf.meta)
        leaf.replace_all_uses_with(new)
        graph.erase_node(leaf)
        slots[ph.name] = slot
    if not slots:
        return module, {}
    copy.recompile()
    return copy, slots


def _slot(leaf: object, index: int, axis: int | None, leaves: list[object]) -> OutSlot | None:
    if not isinstance(leaf, fx.Node) or axis is None or leaves.count(leaf) != 1:
        return None
    if leaf.target is not _aten.linear.default or leaf.kwargs:
        return None
    if len(leaf.args) not in (2, 3) or (len(leaf.args) == 3 and leaf.args[2] is not None):
        return None  # a bias: linear adds it inside the GEMM, linear.out after it
    val = leaf.meta.get("val")
    if not isinstance(val, torch.Tensor) or axis >= val.dim():
        return None
    shape: list[int | None] = []
    for i, size in enumerate(val.shape):
        if i == axis:
            shape.append(None)
        elif isinstance(size, int):
            shape.append(size)
        else:
            return None  # another symbolic axis: its size is unknown before the chunk runs
    return OutSlot(index, axis, tuple(shape), val.dtype)
