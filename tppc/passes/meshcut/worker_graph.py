"""One worker's graph of a stage whose workers form a mesh (cfg × ring × ulysses × tp).

Terms:
    worker graph: the stage graph as worker ``rank`` runs it (:func:`worker_graph`): its
        tensor-parallel shard (:func:`tppc.passes.sharding.shard_graph.shard_graph`, the
        ``tp`` coordinate), then its part of the batch (:func:`batch_cut`, the ``cfg``
        coordinate), then its sub-chunk of the tokens with the exchanges around attention
        (:func:`token_cut`, the ``ring`` and ``ulysses`` coordinates), with collective marks
        naming their mesh axis; :func:`tppc.passes.sharding.split_parts.split_parts` cuts it
        into parts. The product is exact because each cut is exact on any graph of the form
        the one before leaves: the shard is a stage graph of fewer heads and features, the
        batch part a stage graph of a smaller batch, the sub-chunk a chunk of the stage.
    inputs: every worker is fed the stage graph's own inputs, whole (the chunk's rows, the
        consts, the ints); the worker graph narrows them. Boundary inputs arrive cut as the
        previous stage's worker of the same (cfg, ring, ulysses) coordinates left them, and
        boundary outputs leave cut.
    outputs of the last stage: gathered whole on every worker (over ``ulysses``, then
        ``ring``, on their token axes; then over ``cfg`` on their batch axes).

Example (the contract with the program builder, :file:`docs/hybrid.md`):
    >>> from tppc.program.mesh import Mesh
    >>> graphs = [worker_graph(stage, Mesh(cfg=2, ulysses=2), r) for r in range(4)]
    ... # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx

from tppc.errors import SpecError
from tppc.ir.records import STAGE_INFO, TOKEN
from tppc.passes.meshcut.batch_cut import batch_cut
from tppc.passes.meshcut.rows import interleave_parts
from tppc.passes.meshcut.token_cut import token_cut
from tppc.passes.sharding.shard_graph import all_gather_mark, cuttable, shard_graph
from tppc.passes.subgraph import copy_graph
from tppc.program.mesh import Mesh

__all__ = ["worker_graph"]


def worker_graph(stage: fx.GraphModule, mesh: Mesh, rank: int, *,
                 output_rows: Sequence[tuple[int, ...] | None] = (),
                 what: str = "", ring_gather: str = "") -> fx.GraphModule:
    """Worker ``rank``'s graph of stage graph ``stage`` on ``mesh`` (module docstring;
    ``stage`` stays as it is).

    Args:
        stage: a stage graph (``partition_stages``).
        mesh: the stage's mesh.
        rank: the worker, ``0 .. mesh.size - 1``.
        output_rows: the chunk signature's ``output_rows`` (the last stage's outputs' frames).
        what: how errors name the stage (default: ``stage <index>``).
        ring_gather: why every attention takes the ring's gather form (empty: Ring
            attention where it applies, :mod:`tppc.passes.meshcut.ring_form`).

    Raises:
        SpecError: a degree the graph cannot take (named: the batch, a head count, an op
            that mixes batch elements, joint attention under ring/ulysses, ...).
    """
    info = stage.meta.get(STAGE_INFO)
    what = what or (f"stage {info.index}" if info is not None else "the stage")
    coords = mesh.coords(rank)
    if mesh.tp > 1 and cuttable(stage):
        gm = shard_graph(stage, coords["tp"], mesh.tp, what)
    else:
        gm = copy_graph(stage)
        gm.meta.update(stage.meta)
        for name in ("tppc_positional", "tppc_consts"):
            if hasattr(stage, name):
                setattr(gm, name, getattr(stage, name))
    batch = batch_cut(gm, coords["cfg"], mesh.cfg, what)
    token_cut(gm, mesh.ring, mesh.ulysses, coords["ring"], coords["ulysses"], what,
              ring_gather)
    if info is None or not info.outputs:
        _gather_outputs(gm, mesh, batch, tuple(output_rows), what)
    gm.graph.lint()
    gm.recompile()
    return gm


def _gather_outputs(gm: fx.GraphModule, mesh: Mesh, batch: dict[fx.Node, int],
                    rows: tuple[tuple[int, ...] | None, ...], what: str) -> None:
    """The last stage's outputs gathered whole (token cut, then batch cut)."""
    graph = gm.graph
    out = graph.output_node()
    flat = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    for i, value in enumerate(flat):
        if not isinstance(value, fx.Node):
            continue
        got, src = value, value
        while TOKEN not in src.meta and src.op == "call_function" and \
                isinstance(src.args[0], fx.Node):  # a shard's own sum, bias or gather
            src = src.args[0]
        info = src.meta.get(TOKEN)
        with graph.inserting_before(out):
            if mesh.ring * mesh.ulysses > 1 and info is not None and info.axis is not None \
                    and info.role in ("token", "mixing"):
                if info.prefix or info.suffix:
                    raise SpecError(f"{what}: output {src.name} holds text rows beside the "
                                    "image tokens; tppc gathers only token-cut outputs. fix: "
                                    "ring=1 and ulysses=1 for this model")
                for group in ("ulysses", "ring"):
                    if getattr(mesh, group) > 1:
                        got = graph.call_function(all_gather_mark, (got, info.axis),
                                                  {"group": group})
                frames = rows[i][2] if i < len(rows) and rows[i] and len(rows[i]) > 2 else 1
                if frames > 1:
                    got = graph.call_function(interleave_parts, (
                        got, info.axis, mesh.ring * mesh.ulysses, frames))
            if value in batch:
                got = graph.call_function(all_gather_mark, (got, batch[value]),
                                          {"group": "cfg"})
        flat[i] = got
    out.args = (tuple(flat) if isinstance(out.args[0], (list, tuple)) else flat[0],)
