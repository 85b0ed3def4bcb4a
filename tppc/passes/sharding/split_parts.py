"""A worker's shard cut into parts at its collective marks: compute, collective, compute, ...

Terms:
    part: the nodes between two collective marks (graph order), as a GraphModule of its own.
        Part ``q`` returns the value its mark reads first, then every value an later part
        reads (``carried``); part ``q + 1`` takes the collective's result first, then those
        values. The stage's boundary inputs all enter part 0 (in order) and are carried on;
        the inputs a call feeds (a chunk of the tokens, positional values, K/V buffers) enter
        every part that reads them. The last part returns what the stage returns.
    join: the collective between part ``q`` and ``q + 1`` (:class:`Join`): its kind, axes,
        how many leading values of the slot it takes (``first``; the rest pass through), and
        the mesh axis whose group runs it (``group``, :mod:`tppc.program.mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from tppc.ir.records import CHUNK_INPUT, ChunkInput
from tppc.passes.sharding.shard_graph import MARKS, mark_dims
from tppc.passes.subgraph import copy_subgraph

__all__ = ["Join", "split_parts"]


@dataclass(frozen=True)
class Join:
    """The collective between two parts (see the module docstring)."""

    kind: str
    dims: tuple[int, ...] = ()
    first: int = 1
    group: str = "tp"


def split_parts(gm: fx.GraphModule) -> tuple[tuple[fx.GraphModule, ...], tuple[Join, ...]]:
    """``gm``'s parts and the joins between them (``((gm,), ())`` when it has no marks)."""
    nodes = list(gm.graph.nodes)
    marks = [n for n in nodes if n.op == "call_function" and n.target in MARKS]
    if not marks:
        return (gm,), ()
    home: dict[fx.Node, int] = {}  # the part that computes a node (a mark: the one it opens)
    q = 0
    for node in nodes:
        if node.op == "call_function":
            q += node in marks
            home[node] = q
    last = len(marks)
    boundary = [p for p in nodes if p.op == "placeholder" and _kind(p) == "boundary"]
    for p in boundary:
        home[p] = 0

    def used_in(node: fx.Node) -> int:
        if node.op == "output":
            return last
        return home[node] - (node in marks)  # a mark reads its input in the part it closes

    def carried(q: int) -> list[fx.Node]:
        """Values made in parts up to ``q`` that a later part reads (not ``q``'s mark)."""
        return [n for n in nodes if n in home and home[n] <= q and n not in marks[q:q + 1]
                and any(used_in(u) > q for u in n.users)]

    parts, joins = [], []
    for q in range(last + 1):
        mine = [n for n in nodes if home.get(n) == q and n.op == "call_function"
                and n not in marks]
        reads = {a for n in mine for a in n.all_input_nodes}
        if q == last:
            reads |= set(gm.graph.output_node().all_input_nodes)
        attrs = [n for n in nodes if n.op == "get_attr" and n in reads]
        fed = [n for n in nodes if n.op == "placeholder" and n not in boundary and n in reads]
        inputs = list(boundary) + fed if q == 0 else [marks[q - 1], *carried(q - 1), *fed]
        outputs = gm.graph.output_node().args[0] if q == last else \
            (marks[q].args[0], *carried(q))
        part = copy_subgraph(gm, [*attrs, *mine], outputs, inputs=inputs)
        for ph in part.graph.find_nodes(op="placeholder"):
            if CHUNK_INPUT not in ph.meta:  # a value carried from the part before
                ph.meta[CHUNK_INPUT] = ChunkInput(kind="boundary", source=ph.name)
        part.recompile()
        parts.append(part)
        if q < last:
            dims, group = mark_dims(marks[q])
            joins.append(Join(MARKS[marks[q].target], dims, group=group))
    return tuple(parts), tuple(joins)


def _kind(node: fx.Node) -> str:
    spec = node.meta.get(CHUNK_INPUT)
    return "" if spec is None else spec.kind
