"""Repeats of each unit along the sequence axis, written as a row-wise reshape.

Terms:
    unit repeat: ``t.repeat_interleave(k, dim=d)`` (``aten.repeat_interleave.self_int``, an
        integer ``k``) where ``t``'s axis ``d`` counts sequence units: a 1-D table of row
        positions as long as the patch rows, repeated once per patch column to give one
        entry per token (a follower input, :mod:`tppc.frontend.joint_inputs`). Entry ``i``
        of the result is entry ``i // k`` of ``t``, so the rows of a chunk of units
        ``[a, b)`` are ``[a·k, b·k)``: row-wise, like a patch embedding's flatten of rows and
        columns into tokens.

The pass rewrites each unit repeat as ``t.unsqueeze(d + 1).expand(..., k, ...).flatten(d,
d + 1)`` (the same values, bit for bit), which the token annotation reads as a reshape that
keeps the token order, instead of an op that resizes the token axis (``global``: refused
before the last block). Repeats along any other axis (grouped-query K/V heads) are left as
they are.
"""

from __future__ import annotations

import torch
from torch import fx

from tppc.ir.context import CompileContext
from tppc.passes.shapes import size_expr, tensor_val

__all__ = ["unfold_unit_repeats_pass"]

_aten = torch.ops.aten


def unfold_unit_repeats_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Rewrite every unit repeat (module docstring); other graphs are returned unchanged."""
    sym = ctx.seq_symbol
    changed = False
    for node in list(gm.graph.nodes):
        found = None if sym is None else _unit_repeat(node, sym)
        if found is None:
            continue
        src, repeats, dim = found
        val = tensor_val(src)
        sizes = [-1] * (dim + 1) + [repeats] + [-1] * (val.dim() - dim - 1)
        graph = gm.graph
        with graph.inserting_before(node):
            wide = graph.call_function(_aten.unsqueeze.default, (src, dim + 1))
            wide.meta["val"] = val.unsqueeze(dim + 1)
            full = graph.call_function(_aten.expand.default, (wide, sizes))
            full.meta["val"] = wide.meta["val"].expand(sizes)
            flat = graph.call_function(_aten.flatten.using_ints, (full, dim, dim + 1))
            flat.meta["val"] = full.meta["val"].flatten(dim, dim + 1)
        for new in (wide, full, flat):
            new.meta.update({k: v for k, v in node.meta.items() if k not in ("val",)})
        node.replace_all_uses_with(flat)
        graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _unit_repeat(node: fx.Node, sym: object) -> tuple[fx.Node, int, int] | None:
    """``(input, repeats, axis)`` of a unit repeat, or None."""
    if node.op != "call_function" or node.target is not _aten.repeat_interleave.self_int:
        return None
    src = node.args[0]
    repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    val = tensor_val(src) if isinstance(src, fx.Node) else None
    if val is None or isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        return None
    if dim is None:
        if val.dim() != 1:
            return None
        dim = 0
    dim = dim % val.dim()
    if sym not in size_expr(val.shape[dim]).free_symbols:
        return None
    return src, repeats, dim
