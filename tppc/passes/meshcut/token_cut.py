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
    Ring (group ``ring``): the keys and values are gathered around the group
        (``all_gather_mark`` on the token axis); the queries stay cut. The exact form of ring
        attention (Liu et al., 2023) without its overlap: the K/V blocks of all members, then
        one attention.
    write: the stage graph writes a chunk's keys into its buffer
        (``copy_(narrow(buffer, axis, offset(chunk_start), rows), keys)``); the worker writes
        the exchanged keys (the whole chunk's) at the chunk's own offset.

Both together: Ulysses inside, Ring outside (xDiT's USP). Joint attention (a text prefix or
suffix on the token axis), attention not read from K/V buffers, and other mixing ops are
refused by name.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from tppc.errors import SpecError
from tppc.ir.records import CHUNK_INPUT, LAYER, TOKEN
from tppc.passes.meshcut.rows import part_rows, sub_size, sub_start
from tppc.passes.sharding.shard_graph import all_gather_mark, all_to_all_mark

__all__ = ["token_cut"]

aten = torch.ops.aten
_ATTENTION = torch.ops.tppc.chunk_attention.default


@dataclass(frozen=True)
class _Write:
    """One K or V buffer of an attention: its placeholder, write view, write, read view."""

    buffer: fx.Node
    view: fx.Node
    copy: fx.Node
    read: fx.Node
    heads: fx.Node | None = None
    """A tensor-parallel shard's part of the heads taken after the read (K/V it left whole:
    ``narrow(read, heads axis, offset, count)``), or None."""

    @property
    def source(self) -> fx.Node:
        return self.copy.args[1]


def token_cut(gm: fx.GraphModule, ring: int, ulysses: int, ring_coord: int,
              ulysses_coord: int, what: str) -> None:
    """Cut ``gm``'s tokens for the worker at ``(ring_coord, ulysses_coord)`` (in place; see
    the module docstring).

    Raises:
        SpecError: joint attention, a head count ``ulysses`` does not divide, a mixing op
            that is not attention over K/V buffers.
    """
    parts = ring * ulysses
    if parts == 1:
        return
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    _refuse_segments(placeholders, what)
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
            rows = graph.call_function(part_rows, (ph, spec.axis, part, parts, spec.frames))
        ph.replace_all_uses_with(rows, delete_user_cb=lambda u, r=rows: u is not r
                                 and u not in keep)
    for node, (key, value) in attentions.items():
        _exchange(graph, node, key, value, ring, ulysses, {first: start},
                  {first: q_start, sub: q_size},
                  what)


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


def _refuse_segments(placeholders: list[fx.Node], what: str) -> None:
    for ph in placeholders:
        spec = ph.meta.get(CHUNK_INPUT)
        if spec is not None and (spec.prefix or spec.suffix):
            raise SpecError(
                f"{what}: input {ph.name} carries an unsplit text segment of "
                f"{spec.prefix or spec.suffix} tokens on its token axis (joint attention); "
                "sequence parallelism does not cut joint text + image tokens yet. "
                "fix: ring=1 and ulysses=1 for this model (cfg_parallel and tensor_parallel "
                "apply)")


def _attentions(graph: fx.Graph, placeholders: list[fx.Node], what: str
                ) -> dict[fx.Node, tuple[_Write, _Write]]:
    """Every attention over K/V buffers and its two writes; anything else that mixes
    tokens is refused."""
    found: dict[fx.Node, dict[str, _Write]] = {}
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
            write = _Write(write.buffer, write.view, write.copy, write.read, part)
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


def _write_of(buffer: fx.Node) -> _Write | None:
    views = [u for u in buffer.users if u.target == aten.narrow.default]
    if len(views) != 2 or len(buffer.users) != 2:
        return None
    for view, read in (views, views[::-1]):
        copies = [u for u in view.users if u.target == aten.copy_.default and u.args[0] is view]
        if len(copies) == 1 and len(view.users) == 1:
            return _Write(buffer, view, copies[0], read)
    return None


def _exchange(graph: fx.Graph, node: fx.Node, key: _Write, value: _Write, ring: int,
              ulysses: int, write_subst: dict, query_subst: dict, what: str) -> None:
    """The exchanges of one attention (module docstring)."""
    spec = key.buffer.meta[CHUNK_INPUT]
    t_kv, h_kv = int(spec.axis), len(spec.shape) - 3
    query = node.args[0]
    t_q = node.meta[TOKEN].axis
    h_q = node.meta["val"].dim() - 3
    if ulysses > 1:
        _check_heads(node, key, h_kv, ulysses, what)
        if any(isinstance(a, fx.Node) and _rows(a) for a in node.args[7:]):
            raise SpecError(f"{what}: {node.name} takes a mask with a row per query; ulysses "
                            "exchanges the queries of several workers. fix: ulysses=1 (ring "
                            "applies)")
        with graph.inserting_before(node):
            query = _mark(graph, all_to_all_mark, (query, h_q, t_q, "ulysses"), node)
    sources = []
    for w in (key, value):
        src = w.source
        with graph.inserting_before(w.view):
            if w.heads is not None:  # the shard's heads, before the exchange
                src = graph.call_function(aten.narrow.default, (src, *w.heads.args[1:]))
                _set_heads(w.buffer, h_kv, w.heads.args[3])
                w.heads.replace_all_uses_with(w.read)
                graph.erase_node(w.heads)
            if ulysses > 1:
                src = _mark(graph, all_to_all_mark, (src, h_kv, t_kv, "ulysses"), node)
            if ring > 1:
                src = _mark(graph, all_gather_mark, (src, t_kv, "ring"), node)
            offset = _clone(graph, w.view.args[2], write_subst)
            rows = graph.call_function(aten.sym_size.int, (src, t_kv))
        with graph.inserting_before(w.read):  # keys up to the queries' end (causal)
            w.read.args = (w.read.args[0], w.read.args[1],
                           *(_clone(graph, a, query_subst) for a in w.read.args[2:]))
        old = w.view.args[3]
        w.view.args = (w.buffer, w.view.args[1], offset, rows)
        w.copy.args = (w.view, src, *w.copy.args[2:])
        if isinstance(old, fx.Node) and not old.users:
            graph.erase_node(old)
        if ulysses > 1:
            _set_heads(w.buffer, h_kv, w.buffer.meta[CHUNK_INPUT].shape[h_kv] // ulysses)
        sources.append(src)
    with graph.inserting_before(node):
        args = list(node.args)
        args[0] = query
        if len(args) > 3:
            args[3] = _clone(graph, args[3], query_subst)
        node.args = tuple(args)
    if ulysses > 1:
        with graph.inserting_after(node):
            back = _mark(graph, all_to_all_mark, (node, t_q, h_q, "ulysses"), node)
        node.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)


def _check_heads(node: fx.Node, key: _Write, h_kv: int, ulysses: int, what: str) -> None:
    """Refuse a head count ``ulysses`` does not divide (this worker's heads: the buffers'
    shape, which a tensor-parallel shard has already divided)."""
    kv_heads = key.heads.args[3] if key.heads is not None else \
        key.buffer.meta[CHUNK_INPUT].shape[h_kv]
    whole_kv = key.source.meta["val"].shape[h_kv] if "val" in key.source.meta else kv_heads
    q_heads = node.meta["val"].shape[-3] * kv_heads // max(1, int(whole_kv))
    for heads, which in ((q_heads, "query"), (kv_heads, "key/value")):
        if heads % ulysses:
            raise SpecError(f"{what}: attention {node.name} (module "
                            f"{node.meta[TOKEN].module or '<top>'}) has {heads} {which} heads "
                            f"per worker; ulysses={ulysses} must divide them. fix: a ulysses "
                            f"degree dividing {heads} (ring for the rest)")


def _rows(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() >= 2 and val.shape[-2] != 1


def _clone(graph: fx.Graph, value: object, subst: dict) -> object:
    """``value`` recomputed with the nodes of ``subst`` replaced (a copy of the int
    arithmetic between them; nodes that read none of them are reused)."""
    if not isinstance(value, fx.Node):
        return value
    if value in subst:
        return subst[value]
    if value.op != "call_function" or not _reads(value, subst):
        return value
    args = fx.node.map_arg(value.args, lambda a: _clone(graph, a, subst))
    kwargs = fx.node.map_arg(value.kwargs, lambda a: _clone(graph, a, subst))
    return graph.call_function(value.target, args, kwargs)


def _reads(node: fx.Node, subst: dict) -> bool:
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in subst:
            return True
        if n in seen or n.op != "call_function" or n.target not in _INT_OPS:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


_INT_OPS = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.neg,
            sub_start, sub_size}
"""The int arithmetic an offset is made of."""


def _mark(graph: fx.Graph, mark: object, args: tuple, like: fx.Node) -> fx.Node:
    made = graph.call_function(mark, args[:-1], {"group": args[-1]})
    if LAYER in like.meta:
        made.meta[LAYER] = like.meta[LAYER]
    return made


def _set_heads(buffer: fx.Node, axis: int, heads: int) -> None:
    spec = buffer.meta[CHUNK_INPUT]
    shape = list(spec.shape)
    shape[axis] = heads
    buffer.meta[CHUNK_INPUT] = type(spec)(**{**spec.__dict__, "shape": tuple(shape)})
