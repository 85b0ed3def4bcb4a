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
    piece: on a tensor-parallel last stage the LM head is cut by vocabulary and its output
        gathered (an all-gather between the worker's last two parts). Each worker's part
        before that gather writes its vocabulary slice straight into its columns of the
        full-length output (:func:`write_piece_in_place`; ``OutSlot.piece``), so the gather
        finds the pieces side by side in one tensor and copies nothing (the threads
        executor's meeting: :func:`tppc.backends.torch_local.in_place_ops`).
"""

from __future__ import annotations

import torch
from torch import fx

from tppc.passes.subgraph import copy_graph
from tppc.program.program import OutSlot

__all__ = ["in_place_linear", "write_outputs_in_place", "write_piece_in_place"]

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
    for j, leaf in enumerate(leaves):
        slot = _slot(leaf, j, axes[j] if j < len(axes) else None, leaves)
        if slot is None:
            continue
        ph = _write_into(graph, leaf, f"out_{leaf.name}")
        slots[ph.name] = slot
    if not slots:
        return module, {}
    copy.recompile()
    return copy, slots


def in_place_linear(node: object) -> bool:
    """Whether ``node`` is a linear without bias (``aten.linear.out`` can write it in place;
    with a bias, linear adds it inside the GEMM and linear.out after it)."""
    if not isinstance(node, fx.Node) or node.target is not _aten.linear.default or node.kwargs:
        return False
    return len(node.args) == 2 or (len(node.args) == 3 and node.args[2] is None)


def _write_into(graph: fx.Graph, leaf: fx.Node, name: str) -> fx.Node:
    """A new last placeholder ``name``; ``leaf`` (a linear) computed into it."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    if placeholders:
        with graph.inserting_after(placeholders[-1]):
            ph = graph.placeholder(name)
    else:
        with graph.inserting_before(next(iter(graph.nodes))):
            ph = graph.placeholder(name)
    with graph.inserting_after(leaf):
        new = graph.call_function(_aten.linear.out, (*leaf.args[:2], None), {"out": ph})
    new.meta.update(leaf.meta)
    leaf.replace_all_uses_with(new)
    graph.erase_node(leaf)
    return ph


def write_piece_in_place(part: fx.GraphModule, last: fx.GraphModule, axes: tuple[int | None, ...],
                         axis: int, rank: int, degree: int
                         ) -> tuple[fx.GraphModule, OutSlot] | None:
    """``part`` (a worker's part before the all-gather on ``axis`` that ends its stage) writing
    its slice straight into the output, and the slot; None when it does not apply.

    It applies when ``part``'s gathered value (its first output) is a bias-free linear, the
    ``last`` part returns the gathered value (its first input) once as output ``j`` with a
    token axis (``axes[j]``), and the gathered axis is the linear's last, cut into ``degree``
    equal slices: worker ``rank`` writes slice ``rank`` (the all-gather's member order).
    """
    outputs = part.graph.output_node().args[0]
    leaf = outputs[0] if isinstance(outputs, tuple | list) and outputs else None
    gathered = next(iter(last.graph.find_nodes(op="placeholder")), None)
    leaves = last.graph.output_node().args[0]
    leaves = list(leaves) if isinstance(leaves, tuple | list) else []
    if not in_place_linear(leaf) or gathered is None or leaves.count(gathered) != 1 \
            or list(outputs).count(leaf) != 1:
        return None
    j = leaves.index(gathered)
    val = gathered.meta.get("val")
    token = axes[j] if j < len(axes) else None
    if token is None or not isinstance(val, torch.Tensor) or axis != val.dim() - 1 \
            or token == axis:
        return None
    shape: list[int | None] = []
    for i, size in enumerate(val.shape):
        if i != token and not isinstance(size, int):
            return None  # another symbolic axis: unknown before the chunk runs
        shape.append(None if i == token else int(size))
    if shape[axis] % degree:  # type: ignore[operator]
        return None
    width = shape[axis] // degree  # type: ignore[operator]
    copy = copy_graph(part, class_name=type(part).__name__)
    node = next(n for n in copy.graph.nodes if n.name == leaf.name)
    _write_into(copy.graph, node, f"out_{leaf.name}")
    copy.recompile()
    return copy, OutSlot(j, token, tuple(shape), val.dtype, piece=(axis, rank * width, width))


def _slot(leaf: object, index: int, axis: int | None, leaves: list[object]) -> OutSlot | None:
    if not isinstance(leaf, fx.Node) or axis is None or leaves.count(leaf) != 1:
        return None
    if not in_place_linear(leaf):
        return None
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
