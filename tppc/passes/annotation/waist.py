"""Sub-layers of a block: where a stage boundary may fall inside it.

Terms:
    waist: a point of a block's node order (its own nodes, in graph order) across which
        exactly one token value is live, and that value is computed inside the block: the
        residual stream between attention and MLP in a pre-norm transformer block. Cutting
        there sends that one value, like a cut between blocks does. Shared (``const`` /
        ``positional``) values do not count: every stage recomputes them.
    parts: the block's nodes up to the waist (``<block>.attn`` when the attention is there)
        and after it (``<block>.mlp``); ``meta[PART]`` holds each node's part suffix.

Among several waists the one that splits the block's parameters most evenly is taken (a
proxy for work; the cost model prices the parts exactly). A block without a waist (long
skip connections live across it, two streams) is not split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

from tppc.ir.records import PART, TOKEN

__all__ = ["find_waist", "mark_parts", "part_names"]


def _is_token(node: fx.Node) -> bool:
    info = node.meta.get(TOKEN)
    return info is not None and info.role in ("token", "mixing")


def find_waist(own: Sequence[fx.Node], after: set[fx.Node], gm: fx.GraphModule) -> int | None:
    """Index ``i`` such that ``own[: i + 1]`` / ``own[i + 1:]`` cut the block at a waist.

    Args:
        own: the block's nodes in graph order (no placeholders, no ``get_attr``).
        after: nodes of later layers (and the output node): uses there keep a value live
            to the end of the block.
        gm: the graph module (parameter sizes for the balance rule).
    """
    n = len(own)
    if n < 2:
        return None
    pos = {node: i for i, node in enumerate(own)}
    first = own[0]
    before: set[fx.Node] = set()
    for node in first.graph.nodes:
        if node is first:
            break
        before.add(node)
    live = [0] * (n + 1)
    single: list[fx.Node | None] = [None] * n
    for node in [*before, *own]:
        if not _is_token(node):
            continue
        start = pos.get(node, -1)
        last = -1
        for user in node.users:
            if user in pos:
                last = max(last, pos[user])
            elif user in after:
                last = n
        lo, hi = max(start, 0), min(last, n - 1)  # live across cuts lo .. hi - 1
        if hi <= lo:
            continue
        live[lo] += 1
        live[hi] -= 1
        if start >= 0:
            for i in range(lo, hi):
                single[i] = node if single[i] is None else single[i]
    count, cuts = 0, []
    for i in range(n - 1):
        count += live[i]
        if count == 1 and single[i] is not None:  # the one live value is the block's own
            if not cuts or single[cuts[-1]] is not single[i]:
                cuts.append(i)
    cuts = [i for i in cuts if _computes(own[: i + 1]) and _computes(own[i + 1:])]
    if not cuts:
        return None
    sizes = [_param_numel(gm, node) for node in own]
    total = sum(sizes)
    return min(cuts, key=lambda i: (abs(2 * sum(sizes[: i + 1]) - total), i))


def _computes(nodes: Sequence[fx.Node]) -> bool:
    """Whether a part does work worth a stage boundary: a weight read or an attention."""
    return any(node.meta[TOKEN].role == "mixing" or any(
        a.op == "get_attr" for a in node.all_input_nodes) for node in nodes if _is_token(node))


def _param_numel(gm: fx.GraphModule, node: fx.Node) -> int:
    total = 0
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = gm
            for part in str(arg.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor):
                total += value.numel()
    return total


def part_names(own: Sequence[fx.Node], cut: int) -> tuple[str, str]:
    """``("attn", "mlp")`` when the attention (``mixing``) nodes are all before the waist,
    ``("mlp", "attn")`` when all after it, else ``("part0", "part1")``."""
    head = any(n.meta[TOKEN].role == "mixing" for n in own[: cut + 1] if TOKEN in n.meta)
    tail = any(n.meta[TOKEN].role == "mixing" for n in own[cut + 1:] if TOKEN in n.meta)
    if head and not tail:
        return "attn", "mlp"
    if tail and not head:
        return "mlp", "attn"
    return "part0", "part1"


def mark_parts(own: Sequence[fx.Node], cut: int, names: tuple[str, str]) -> None:
    """Write each node's part suffix under ``meta[PART]``."""
    for i, node in enumerate(own):
        node.meta[PART] = names[0] if i <= cut else names[1]
