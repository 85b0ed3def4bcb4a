"""Helpers for the annotation tests."""

from __future__ import annotations

from torch import fx

from tppc.ir.records import LAYER, TOKEN
from tppc.passes.shapes import tensor_val


def block_activations(gm: fx.GraphModule, ctx) -> list[fx.Node]:
    """Tensor-valued token/mixing nodes inside the blocks."""
    blocks = {layer.name for layer in ctx.layers if layer.kind == "block"}
    return [n for n in gm.graph.nodes
            if n.meta.get(LAYER) in blocks and n.op == "call_function"
            and n.meta[TOKEN].role in ("token", "mixing") and tensor_val(n) is not None]


def roles_by_target(gm: fx.GraphModule, name_part: str) -> set[str]:
    """Roles of the call_function nodes whose op name contains ``name_part``."""
    return {n.meta[TOKEN].role for n in gm.graph.nodes
            if n.op == "call_function" and name_part in str(n.target)}
