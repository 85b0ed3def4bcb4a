"""The token cut of a stage graph (sequence parallelism): each worker runs the stage on its
sub-chunk, and the keys and values of every attention are exchanged so that each worker's
K/V buffers hold the whole chunk's before attention reads them.

Terms:
    sub-chunk: part ``p = ring_coord · ulysses + ulysses_coord`` of the chunk
        (:mod:`tppc.passes.meshcut.rows`). The stage graph is a chunk-step graph: it is
        exact on any chunk ``[a', a' + c')`` once its attention sees the right keys, so the
        worker's graph is the stage graph with ``chunk_start``/``chunk_size`` replaced by its
        sub-chunk's and the chunk's rows of every token and positional input narrowed to
        the sub-chunk's; boundary inputs arrive cut (the previous stage's worker ran the same
        sub-chunk).
    Ulysses (group ``ulysses``): before attention the queries, keys and values go from
        token-cut to head-cut (``all_to_all_mark``: split the heads, join the tokens), the
        K/V buffers hold ``heads / ulysses`` heads, attention runs on the ulysses group's
        tokens, and its output goes back to token-cut (split the tokens, join the heads).
        DeepSpeed-Ulysses (Jacobs et al., 2023).
    Ring (group ``ring``): each worker keeps its own K/V block and the blocks go around
        the group (``ring_shift_mark``), the partial attentions merged by their
        log-sum-exps (:mod:`tppc.passes.meshcut.ring_form`); the queries stay cut. An
        attention the ring form does not cover (causal, masked, a video's frames) gathers
        the chunk's keys and values around the group instead (``all_gather_mark``), the
        reason in its ``RING_FORM`` record.
    write: the stage graph writes a chunk's keys into its buffer
        (``copy_(narrow(buffer, axis, offset(chunk_start), rows), keys)``); the worker writes
        the exchanged keys (the whole chunk's) at the chunk's own offset.

Both together: Ulysses inside, Ring outside (xDiT's USP). Joint attention (a text prefix or
suffix on the token axis) and video chunks (a band of rows in every frame) are exchanged by
:mod:`tppc.passes.meshcut.exchange`; attention not read from K/V buffers and other mixing ops
(linear attention's sums, token convolutions) are refused by name.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from tppc.errors import SpecError
from tppc.ir.records import CHUNK_INPUT, TOKEN
from tppc.passes.meshcut.exchange import BufferWrite, exchange_attention
from tppc.passes.meshcut.ring_form import local_subst
from tppc.passes.meshcut.rows import part_rows, sub_size, sub_start

__all__ = ["token_cut"]

aten = torch.ops.aten
_ATTENTION = torch.ops.tppc.chunk_attention.default


def token_cut(gm: fx.GraphModule, ring: int, ulysses: int, ring_coord: int,
              ulysses_coord: int, what: str, gather: str = "") -> None:
    """Cut ``gm``'s tokens for the worker at ``(ring_coord, ulysses_coord)`` (in place; see
    the module docstring); ``gather``: why every attention takes the ring's gather form
    (empty: the ring form where it applies).

    Raises:
        SpecError: joint attention, a head count ``ulysses`` does not divide, a mixing op
            that is not attention over K/V buffers.
    """
    parts = ring * ulysses
    if parts == 1:
        return
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    attentions = _attentions(graph, placeholders, what)
    kinds = {p.meta[CHUNK_INPUT].kind: p for p in placeholders if CHUNK_INPUT in p.meta}
    start = kinds.get("chunk_start")
    part = ring_coord * ulysses + ulysses_coord
    with graph.inserting_before(placeholders[-1].next):
        sub = _sub_units(graph, placeholders, kinds.get("chunk_size"), parts, what)
    keep = _int_ancestors(sub)  # they read the whole inputs
    first = q_start = q_size = None
    if sub is not None and start is not None:
        with graph.inserting_after(sub):
            first = graph.call_function(sub_start, (start, sub, part))
        with graph.inserting_after(first):  # the first query row after the ulysses exchange
            q_start = graph.call_function(sub_start, (start, sub, ring_coord * ulysses))
        with graph.inserting_after(q_start):  # the queries' rows after the exchange
            q_size = graph.call_function(operator.mul, (sub, ulysses))
        start.replace_all_uses_with(first, delete_user_cb=lambda u: u not in (first, q_start))
        keep |= {q_start, q_size}
        if "chunk_size" in kinds:
            kinds["chunk_size"].replace_all_uses_with(
                sub, delete_user_cb=lambda u: u not in keep)
    elif attentions:
        raise SpecError(f"{what}: attention over K/V buffers, but tppc finds neither the "
                        "chunk's start nor its size among the stage's inputs to place the "
                        "exchanged keys. fix: ring=1 and ulysses=1")
    for ph in placeholders:
        spec = ph.meta.get(CHUNK_INPUT)
        if spec is None or spec.kind not in ("token", "positional") or spec.axis is None:
            continue
        with graph.inserting_after(sub or placeholders[-1]):
            rows = graph.call_function(part_rows, (ph, spec.axis, part, parts, spec.frames,
                                                   spec.prefix, spec.suffix))
        ph.replace_all_uses_with(rows, delete_user_cb=lambda u, r=rows: u is not r
                                 and u not in keep)
    local = local_subst(graph, q_size, start, first, kinds.get("seq_len"), ring) \
        if ring > 1 and first is not None and not gather else None
    for node, (key, value) in attentions.items():
        exchange_attention(graph, node, key, value, ring, ulysses, ulysses_coord,
                           {first: start}, {first: q_start, sub: q_size}, what, local,
                           gather)


def _sub_units(graph: fx.Graph, placeholders: list[fx.Node], size: fx.Node | None,
               parts: int, what: str) -> fx.Node | None:
    """A node of the sub-chunk's size in sequence units: the chunk's size cut into
    ``parts`` (``chunk_size``, or a token input's rows over its scale), or a boundary
    input's rows over its positions per unit (it arrives cut)."""
    if size is not None:
        return graph.call_function(sub_size, (size, parts, what))
    for ph in placeholders:
        spec = ph.meta.get(CHUNK_INPUT)
        if spec is not None and spec.kind in ("token", "positional") and spec.axis is not None:
            rows = graph.call_function(aten.sym_size.int, (ph, spec.axis))
            if spec.prefix or spec.suffix:
                rows = graph.call_function(operator.sub, (rows, spec.prefix + spec.suffix))
            units = graph.call_function(operator.floordiv, (rows, spec.scale))
            return graph.call_function(sub_size, (units, parts, what))
    for ph in placeholders:
        spec, info = ph.meta.get(CHUNK_INPUT), ph.meta.get(TOKEN)
        if spec is None or spec.kind != "boundary" or info is None or info.axis is None \
                or info.axis_size is None:
            continue
        per_unit = info.axis_size.as_coeff_Mul()[0]
        if per_unit.is_Integer and len(info.axis_size.free_symbols) == 1:
            rows = graph.call_function(aten.sym_size.int, (ph, info.axis))
            return graph.call_function(operator.floordiv, (rows, int(per_unit)))
    return None


def _int_ancestors(node: fx.Node | None) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [node] if node is not None else []
    while todo:
        n = todo.pop()
        if n not in seen and n.op == "call_function":
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _attentions(graph: fx.Graph, placeholders: list[fx.Node], what: str
                ) -> dict[fx.Node, tuple[BufferWrite, BufferWrite]]:
    """Every attention over K/V buffers and its two writes; anything else that mixes
    tokens is refused."""
    found: dict[fx.Node, dict[str, BufferWrite]] = {}
    for ph in placeholders:
        spec = ph.meta.get(CHUNK_INPUT)
        if spec is None or spec.kind not in ("key", "value"):
            continue
        write = _write_of(ph)
        if write is None:
            raise SpecError(f"{what}: K/V buffer {ph.name} is not written and read as one "
                            "chunk's rows (a video's frame blocks?); tppc cannot exchange its "
                            "rows. fix: ring=1 and ulysses=1 for this model")
        heads = len(spec.shape) - 3
        part = next((u for u in write.read.users if u.target == aten.narrow.default
                     and u.args[1] == heads and len(write.read.users) == 1), None)
        if part is not None:
            write = dataclasses.replace(write, heads=part)
        readers = [u for u in (part or write.read).users if u.op == "call_function"
                   and u.target == _ATTENTION]
        if len(readers) != 1:
            raise SpecError(f"{what}: K/V buffer {ph.name} (of {spec.source}) feeds "
                            f"{len(readers)} tppc.chunk_attention nodes: it holds another "
                            "kind of token mixing (linear attention's sums, a convolution "
                            "over tokens); sequence parallelism cannot cut it. fix: ring=1 "
                            "and ulysses=1 for this model")
        found.setdefault(readers[0], {})[spec.kind] = write
    for node in graph.nodes:
        info = node.meta.get(TOKEN)
        if node.op == "call_function" and info is not None and info.role == "mixing" and (
                node not in found or set(found[node]) != {"key", "value"}):
            raise SpecError(f"{what}: {node.name} ({node.target}, module "
                            f"{info.module or '<top>'}) mixes tokens but is not attention "
                            "over K/V buffers; sequence parallelism cannot cut it. fix: ring=1 "
                            "and ulysses=1 for this model")
    return {n: (w["key"], w["value"]) for n, w in found.items()}


def _write_of(buffer: fx.Node) -> BufferWrite | None:
    """The buffer's write of the chunk's rows, its writes of text rows (a literal count:
    SD3's suffix after the last image row), and its read; None for another pattern."""
    views = [u for u in buffer.users if u.target == aten.narrow.default]
    if len(views) != len(buffer.users):
        return None
    writes, reads = [], []
    for view in views:
        copies = [u for u in view.users if u.target == aten.copy_.default and u.args[0] is view]
        if copies and len(copies) == len(view.users) == 1:
            writes.append((view, copies[0]))
        else:
            reads.append(view)
    rows = [w for w in writes if not isinstance(w[0].args[3], int)]
    if len(reads) != 1 or not rows:
        return None
    text = tuple(w for w in writes if w not in rows)
    if len(rows) > 1:  # one write per video frame: narrows of one value on the buffer's axis
        sources = {c.args[1].args[0] if c.args[1].target == aten.narrow.default
                   and c.args[1].args[1] == v.args[1] else None for v, c in rows}
        if len(sources) != 1 or None in sources:
            return None
    return BufferWrite(buffer, *rows[0], reads[0], text=text, blocks=tuple(rows[1:]))
