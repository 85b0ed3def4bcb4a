"""Block scans: a recurrence over blocks of the token axis, written with an initial-state slot.

Terms:
    block: ``k`` consecutive tokens; a model that pads its sequence to whole blocks is
        captured with ``L = k·n`` (:mod:`tppc.frontend.block_capture`), so a value reshaped
        ``(b, L, …) → (b, n, k, …)`` has the blocks as its token axis (``n``, one per unit).
    block scan: the state entering each block of a linear recurrence over the blocks,
        computed for all blocks at once from per-block values, in the form Mamba2's SSD scan
        (transformers' ``torch_forward``, also Falcon-H1's mixer) writes it::

            states = cat([zeros_like(states[:, :1]), states], dim=1)     # slot 0: h_0 = 0
            decay = exp(segment_sum(pad(A_cumsum[..., -1], (1, 0))))      # (n+1) × (n+1)
            new_states = einsum("bhzc,bchpn->bzhpn", decay, states)
            states, final_state = new_states[:, :-1], new_states[:, -1]

        i.e. a region of ops over the ``n + 1`` slots (the initial state, then one per block)
        entered by a ``cat([init, x])`` along the blocks axis, whose ``init`` is a constant
        zero of one slot, and left by ``whole[:, :-1]`` (the state entering each block) and
        ``whole[:, -1]`` (the state after the last block). Row ``c`` of ``whole`` depends on
        slots ``≤ c`` only (the decay matrix is lower-triangular), so the region run on the
        blocks of one chunk, with ``init`` replaced by the state the previous chunk left (its
        ``whole[:, -1]``), gives the same rows (to float reassociation: the decay of the
        carried state is ``exp`` of a sum over the chunk instead of over the prefix).
    carried state: one buffer per region, the shape of ``init`` (batch × 1 × heads ×
        head_dim × state for Mamba2): never the length (:mod:`tppc.passes.chunking.block_state`).

Annotation first marks such a region ``global`` (it changes the token count by one slot and
builds an ``(n+1) × (n+1)`` matrix); :func:`mark_block_scans` then finds it from the
``cat`` and marks it ``mixing`` / ``recurrent`` with a :class:`BlockScanPart` in
``node.meta[BLOCK_SCAN]``, and the ops after it are annotated again. A region whose state
after the last block is used (``final_state`` returned), or whose values leave it other than
through the two reads above, stays ``global`` and is refused by ``group_layers``.
Translation validation checks the chunked region against the whole graph at every compile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import sympy
import torch
from torch import fx

from tppc.ir.records import TOKEN, TokenInfo
from tppc.passes.shapes import size_expr, tensor_val

__all__ = ["BLOCK_SCAN", "BlockScanPart", "mark_block_scans"]

BLOCK_SCAN = "tppc.block_scan"
"""``node.meta`` key of a node in a block scan region (a :class:`BlockScanPart`)."""

_aten = torch.ops.aten
_ZEROS = (_aten.zeros_like.default, _aten.zeros.default, _aten.new_zeros.default)
_BIG = 2**62


@dataclasses.dataclass(frozen=True)
class BlockScanPart:
    """A node's part in a block scan region.

    Attributes:
        region: the name of the region's ``cat`` node (names the state buffer).
        part: ``init`` (the zero slot, replaced by the carried state), ``inner``, ``exit``
            (``whole[:, :-1]``: the state entering each block; it writes the new state) or
            ``final`` (``whole[:, -1]`` with no users).
        axis: the slots' axis of the region's ``whole`` value (for ``exit``: where the state
            after the chunk's last block is read).
    """

    region: str
    part: Literal["init", "inner", "exit", "final"]
    axis: int


def mark_block_scans(gm: fx.GraphModule, sym: sympy.Symbol,
                     annotate: Callable[[fx.Node], TokenInfo]) -> int:
    """Mark every block scan region of ``gm`` (see the module docstring) and annotate the
    ``global`` nodes after it again with ``annotate``; returns how many regions were found."""
    found = 0
    for node in list(gm.graph.nodes):  # in order: a later region reads an earlier one's rows
        info = node.meta.get(TOKEN)
        if BLOCK_SCAN in node.meta or info is None or info.role != "global" \
                or node.op not in ("call_function", "output"):
            continue
        region = _region(node, sym) if node.target is _aten.cat.default else None
        if region is not None:
            _mark(node, *region)
            found += 1
        elif found:
            try:
                node.meta[TOKEN] = annotate(node)
            except Exception:
                continue
    return found


def _region(cat: fx.Node, sym: sympy.Symbol
            ) -> tuple[fx.Node, set[fx.Node], list[fx.Node], list[fx.Node], int] | None:
    """``(init, nodes, exits, finals, axis)`` of the region entered by ``cat``, or None."""
    tensors = cat.args[0]
    if not isinstance(tensors, list | tuple) or len(tensors) != 2:
        return None
    init, x = tensors
    x_info = x.meta.get(TOKEN)
    x_val, init_val = tensor_val(x), tensor_val(init)
    if x_info is None or x_info.role not in ("token", "mixing") or x_info.axis is None \
            or x_val is None or init_val is None or init.target not in _ZEROS:
        return None
    axis = (cat.args[1] if len(cat.args) > 1 else 0) % x_val.dim()
    if axis != x_info.axis or x_info.other_axes or x_info.prefix or x_info.suffix \
            or size_expr(init_val.shape[axis]) != 1:
        return None
    slots = x_info.axis_size + 1
    nodes: set[fx.Node] = {cat}
    exits: list[fx.Node] = []
    finals: list[fx.Node] = []
    whole_axis: int | None = None
    todo = [cat]
    while todo:  # forward: every reader of the slots, up to the two reads that leave
        node = todo.pop()
        for user in node.users:
            if user in nodes or user in exits or user in finals:
                continue
            kind = _leaves(user, node, slots)
            if kind is not None:
                uaxis = node.meta[TOKEN].axis
                if whole_axis not in (None, uaxis):
                    return None
                whole_axis = uaxis
                (exits if kind == "exit" else finals).append(user)
            else:
                nodes.add(user)
                todo.append(user)
    if not exits or whole_axis is None or any(f.users for f in finals):
        return None
    todo = list(nodes)
    while todo:  # backward: the decay matrix and the masks built for the slots
        node = todo.pop()
        for arg in node.all_input_nodes:
            if arg not in nodes and _inside(arg, sym):
                nodes.add(arg)
                todo.append(arg)
    for chain in _init_chain(init):
        nodes.add(chain)
    allowed = nodes | set(exits) | set(finals)
    if any(u not in allowed for n in nodes if tensor_val(n) is not None for u in n.users):
        return None  # a value of the region read elsewhere: not a carried state
    # (a size of the slots, ``n + 1``, may be shared with a later region: it is the chunk's
    # own ``c + 1`` in the chunk step, the same for every region)
    whole = exits[0].args[0]
    state = list(tensor_val(whole).shape)
    state[whole_axis] = 1
    if [size_expr(s) for s in state] != [size_expr(s) for s in init_val.shape]:
        return None
    return init, nodes, exits, finals, whole_axis


def _leaves(user: fx.Node, whole: fx.Node, slots: sympy.Expr) -> str | None:
    """``exit`` for ``whole[:, :-1]`` along its slots axis, ``final`` for ``whole[:, -1]``."""
    info = whole.meta.get(TOKEN)
    if info is None or info.axis is None or info.axis_size is None \
            or sympy.simplify(info.axis_size - slots) != 0 or user.args[0] is not whole:
        return None
    rank = tensor_val(whole).dim()
    dim = (user.args[1] if len(user.args) > 1 else 0) % rank
    if dim != info.axis:
        return None
    if user.target is _aten.slice.Tensor:
        start = user.args[2] if len(user.args) > 2 else None
        end = user.args[3] if len(user.args) > 3 else None
        step = user.args[4] if len(user.args) > 4 else 1
        if start in (0, None) and end == -1 and step == 1:
            return "exit"
    if user.target is _aten.select.int and user.args[2] == -1:
        return "final"
    return None


def _inside(node: fx.Node, sym: sympy.Symbol) -> bool:
    """An input of the region built for it: a ``global`` value, or a positional tensor
    sized by the slots (a causal mask of ``(n+1) × (n+1)``), recomputed per chunk."""
    info = node.meta.get(TOKEN)
    if info is None or node.op != "call_function":
        return False
    if info.role == "global":
        return True
    val = tensor_val(node)
    return info.role == "positional" and val is not None and not info.inputs \
        and any(size_expr(s).free_symbols & {sym} for s in val.shape)


def _init_chain(init: fx.Node) -> list[fx.Node]:
    """``init`` and the values only it reads (``states[:, :1]``, its shape's source)."""
    chain, todo = [init], [init]
    while todo:
        node = todo.pop()
        for arg in node.all_input_nodes:
            info = arg.meta.get(TOKEN)
            if info is not None and info.role == "global" and all(
                    u in chain for u in arg.users):
                chain.append(arg)
                todo.append(arg)
    return chain


def _mark(cat: fx.Node, init: fx.Node, nodes: set[fx.Node], exits: list[fx.Node],
          finals: list[fx.Node], axis: int) -> None:
    for node in nodes:
        part = "init" if node is init else "inner"
        node.meta[BLOCK_SCAN] = BlockScanPart(cat.name, part, axis)
        node.meta[TOKEN] = TokenInfo("mixing", attention="recurrent",
                                     module=node.meta[TOKEN].module)
    x_info: TokenInfo = cat.args[0][1].meta[TOKEN]
    for node, part in [(e, "exit") for e in exits] + [(f, "final") for f in finals]:
        node.meta[BLOCK_SCAN] = BlockScanPart(cat.name, part, axis)
        info = node.meta[TOKEN]
        node.meta[TOKEN] = TokenInfo("mixing", axis if part == "exit" else None,
                                     x_info.axis_size if part == "exit" else None,
                                     attention="recurrent", module=info.module)
