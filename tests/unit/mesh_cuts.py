"""A stand-in worker cut for the runtime's mesh tests (the graph side builds the real ones).

``replicated_cut(stage, mesh, rank, what)``: every worker computes its whole stage; on the
last stage each worker keeps its own part of the batch of every output (``cfg`` coordinate
``c`` of ``C``: rows ``[c·B/C, (c+1)·B/C)`` of axis 0) and an ``all_gather_mark`` over its cfg
group makes it whole again. The result is exact, and it exercises what the runtime owns: the
groups per axis, the wiring by coordinates, the per-worker K/V buffers, the collectives of a
non-tensor-parallel axis and the leader's outputs.
"""

from __future__ import annotations

import torch
from torch import fx

from tppc.ir.records import STAGE_INFO
from tppc.passes.sharding.shard_graph import all_gather_mark
from tppc.passes.subgraph import copy_graph
from tppc.program.mesh import Mesh

__all__ = ["replicated_cut"]


def replicated_cut(stage: fx.GraphModule, mesh: Mesh, rank: int, what: str) -> fx.GraphModule:
    """Worker ``rank``'s graph (see the module docstring)."""
    new = copy_graph(stage)
    new.meta.update(stage.meta)
    for name in ("tppc_positional", "tppc_consts"):
        if hasattr(stage, name):
            setattr(new, name, getattr(stage, name))
    if stage.meta[STAGE_INFO].outputs:  # not the last stage: whole boundary values
        return new
    c = mesh.coords(rank)["cfg"]
    graph = new.graph
    out = graph.output_node()
    leaves = out.args[0] if isinstance(out.args[0], tuple | list) else (out.args[0],)
    for leaf in leaves:
        val = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        rows = int(val.shape[0]) // mesh.cfg
        with graph.inserting_before(out):
            mine = graph.call_function(torch.ops.aten.narrow.default, (leaf, 0, c * rows, rows))
            mark = graph.call_function(all_gather_mark, (mine, 0), {"group": "cfg"})
        mark.meta["val"] = val
        out.replace_input_with(leaf, mark)
    graph.lint()
    new.recompile()
    return new
