"""The exchanges around one attention of a token-cut stage (:mod:`token_cut`): Ulysses'
all-to-all of the queries, keys and values (and back), Ring attention's passing of the K/V
blocks (:mod:`ring_form`; or, where it does not apply, the gather of the chunk's keys and
values), and the write of the keys into the worker's K/V buffers.

Terms:
    segments: joint attention (SD3, Flux, CogVideoX) runs over ``[text prefix, image tokens,
        text suffix]``; every worker computes the text whole (as xDiT does) beside its
        sub-chunk of image tokens. Only the image tokens are exchanged: under Ulysses each
        worker takes its own heads of the text (the heads the all-to-all gives it) and gathers
        the text rows of the output over the heads; under Ring the text keys are already
        whole (the ring form attends them in its first step, only image blocks circulate).
        The buffers receive ``[text, image rows, text]`` as the stage graph's do (the ring
        form: the worker's own image rows).
    write: ``copy_(narrow(buffer, axis, offset(chunk_start), rows), keys)`` in the stage
        graph; the worker writes the exchanged keys at the chunk's own offset (the ring
        form: at its own block's offset, :func:`ring_form.local_subst`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx

from tppc.errors import SpecError
from tppc.ir.records import CHUNK_INPUT, LAYER, RING_FORM, TOKEN, RingForm
from tppc.passes.meshcut.ring_form import ring_attention, ring_reason, set_parts
from tppc.passes.meshcut.rows import interleave_parts, part_rows, sub_size, sub_start
from tppc.passes.sharding.shard_graph import all_gather_mark, all_to_all_mark

__all__ = ["BufferWrite", "exchange_attention"]

aten = torch.ops.aten


@dataclass(frozen=True)
class BufferWrite:
    """One K or V buffer of an attention: its placeholder, write view, write, read view."""

    buffer: fx.Node
    view: fx.Node
    copy: fx.Node
    read: fx.Node
    heads: fx.Node | None = None
    """A tensor-parallel shard's part of the heads taken after the read (K/V it left whole:
    ``narrow(read, heads axis, offset, count)``), or None."""
    text: tuple[tuple[fx.Node, fx.Node], ...] = ()
    """Separate writes ``(view, copy_)`` of text rows (SD3's suffix after the last image
    row); then ``copy`` writes image rows only."""

    blocks: tuple[tuple[fx.Node, fx.Node], ...] = ()
    """The writes ``(view, copy_)`` of the other video frames' rows (each copies a narrow of
    one value, :attr:`source`); empty: ``copy`` writes all the chunk's rows."""

    @property
    def source(self) -> fx.Node:
        """The keys (values) the stage graph writes."""
        return self.copy.args[1].args[0] if self.blocks else self.copy.args[1]


@dataclass(frozen=True)
class _Exchange:
    """What one attention's exchanges need (see the module docstring)."""

    graph: fx.Graph
    node: fx.Node
    ring: int
    ulysses: int
    coord: int
    """The worker's ulysses coordinate (its heads of the text)."""
    prefix: int
    suffix: int
    local: dict | None = None
    """The ring form's placement of the worker's own rows (:func:`ring_form.local_subst`);
    None: the gather form (or no ring)."""

    def segmented(self, x: fx.Node, axis: int, middle: Any, side: Any,
                  segments: tuple[int, int] | None = None) -> fx.Node:
        """``x`` cut into ``[prefix, image, suffix]`` on ``axis`` (``segments``: other
        lengths than the attention's), ``middle`` applied to the image rows and ``side`` to
        the text rows, joined again."""
        prefix, suffix = segments or (self.prefix, self.suffix)
        if not prefix and not suffix:
            return middle(x)
        return replace(self, prefix=prefix, suffix=suffix)._segmented(x, axis, middle, side)

    def _segmented(self, x: fx.Node, axis: int, middle: Any, side: Any) -> fx.Node:
        graph = self.graph
        rows = graph.call_function(aten.sym_size.int, (x, axis))
        inner = graph.call_function(operator.sub, (rows, self.prefix + self.suffix))
        pieces = []
        if self.prefix:
            pieces.append(side(graph.call_function(aten.narrow.default, (x, axis, 0, self.prefix))))
        pieces.append(middle(graph.call_function(aten.narrow.default, (x, axis, self.prefix, inner))))
        if self.suffix:
            at = graph.call_function(operator.sub, (rows, self.suffix))
            pieces.append(side(graph.call_function(aten.narrow.default, (x, axis, at, self.suffix))))
        return graph.call_function(aten.cat.default, (pieces, axis))


    def heads(self, x: fx.Node, axis: int) -> fx.Node:
        """The worker's heads of text rows (the part of the heads the all-to-all gives it)."""
        if self.ulysses == 1:
            return x
        return self.graph.call_function(part_rows, (x, axis, self.coord, self.ulysses))


    def mark(self, mark: Any, x: fx.Node, *dims: int, group: str) -> fx.Node:
        made = self.graph.call_function(mark, (x, *dims), {"group": group})
        if LAYER in self.node.meta:
            made.meta[LAYER] = self.node.meta[LAYER]
        return made


def exchange_attention(graph: fx.Graph, node: fx.Node, key: BufferWrite, value: BufferWrite,
                       ring: int, ulysses: int, ulysses_coord: int, write_subst: dict,
                       query_subst: dict, what: str, local: dict | None = None,
                       gather: str = "") -> None:
    """Rewrite attention ``node`` and its K/V writes for the token cut (module docstring).
    ``write_subst`` / ``query_subst``: the int nodes to replace in the write's offset (the
    chunk's start) and in the keys read and the query start (the exchanged queries' rows);
    ``local``: :func:`ring_form.local_subst` (the ring form where ``node`` takes it);
    ``gather``: why the gather form whatever ``node`` is."""
    info = node.meta[TOKEN]
    ex = _Exchange(graph, node, ring, ulysses, ulysses_coord, info.prefix, info.suffix)
    if ring > 1:
        reason = gather or ring_reason(node, bool(key.blocks or value.blocks), any(
            _reads(w.read.args[3], query_subst) for w in (key, value)
            if isinstance(w.read.args[3], fx.Node)), local)
        if reason:
            node.meta[RING_FORM] = RingForm("gather", reason)
        else:
            ex = replace(ex, local=local)
    spec = key.buffer.meta[CHUNK_INPUT]
    t_kv, h_kv = int(spec.axis), len(spec.shape) - 3
    t_q, h_q = info.axis, node.meta["val"].dim() - 3
    query = node.args[0]
    if ulysses > 1:
        _check_heads(node, key, h_kv, ulysses, what)
        if any(isinstance(a, fx.Node) and _rows(a) for a in node.args[7:8]):  # attn_mask
            raise SpecError(f"{what}: {node.name} takes a mask with a row per query; ulysses "
                            "exchanges the queries of several workers. fix: ulysses=1 (ring "
                            "applies)")
        with graph.inserting_before(node):
            query = ex.segmented(query, t_q, lambda x: ex.mark(
                all_to_all_mark, x, h_q, t_q, group="ulysses"), lambda x: ex.heads(x, h_q))
    for w in (key, value):
        _write(ex, w, t_kv, h_kv, write_subst, query_subst)
    with graph.inserting_before(node):
        args = list(node.args)
        args[0] = query
        if len(args) > 3:
            args[3] = clone_ints(graph, args[3], query_subst)
        node.args = tuple(args)
    if ex.local is not None:
        ring_attention(graph, node, ring, ex.mark)
    if ulysses > 1:
        with graph.inserting_before(node.next):
            back = ex.segmented(node, t_q, lambda x: ex.mark(
                all_to_all_mark, x, t_q, h_q, group="ulysses"), lambda x: ex.mark(
                all_gather_mark, x, h_q, group="ulysses"))
        made = _made_after(node, back)
        node.replace_all_uses_with(back, delete_user_cb=lambda u: u not in made)


def _write(ex: _Exchange, w: BufferWrite, t_kv: int, h_kv: int, write_subst: dict,
           query_subst: dict) -> None:
    graph = ex.graph
    src = w.source
    with graph.inserting_before(w.view):
        heads_part = w.heads.args[1:] if w.heads is not None else ()
        if w.heads is not None:  # the shard's heads, before the exchange
            src = graph.call_function(aten.narrow.default, (src, *heads_part))
            _set_heads(w.buffer, h_kv, w.heads.args[3])
            w.heads.replace_all_uses_with(w.read)
            graph.erase_node(w.heads)

        def tokens(x: fx.Node) -> fx.Node:
            if ex.ulysses > 1:
                x = ex.mark(all_to_all_mark, x, h_kv, t_kv, group="ulysses")
            if ex.ring > 1 and ex.local is None:
                x = ex.mark(all_gather_mark, x, t_kv, group="ring")
            return x

        if w.blocks:
            _frames(ex, w, src, t_kv, h_kv, write_subst)
            _text_writes(ex, w, h_kv, heads_part)
            return
        spec = w.buffer.meta[CHUNK_INPUT]
        segments = (0, 0) if w.text else (spec.prefix, spec.suffix)
        src = ex.segmented(src, t_kv, tokens, lambda x: ex.heads(x, h_kv), segments)
        offset = clone_ints(graph, w.view.args[2], ex.local or write_subst)
        rows = graph.call_function(aten.sym_size.int, (src, t_kv))
    _text_writes(ex, w, h_kv, heads_part)
    with graph.inserting_before(w.read):  # keys up to the queries' end (causal)
        w.read.args = (w.read.args[0], w.read.args[1],
                       *(clone_ints(graph, a, ex.local or query_subst)
                         for a in w.read.args[2:]))
    old = w.view.args[3]
    w.view.args = (w.buffer, w.view.args[1], offset, rows)
    w.copy.args = (w.view, src, *w.copy.args[2:])
    if isinstance(old, fx.Node) and not old.users:
        graph.erase_node(old)
    if ex.ulysses > 1:
        _set_heads(w.buffer, h_kv, w.buffer.meta[CHUNK_INPUT].shape[h_kv] // ex.ulysses)
    if ex.local is not None:
        set_parts(w.buffer, ex.ring)


def _text_writes(ex: _Exchange, w: BufferWrite, h_kv: int, heads_part: tuple) -> None:
    """The separate writes of text rows: whole on every worker; the worker's heads."""
    for view, copy in w.text:
        with ex.graph.inserting_before(copy):
            text = copy.args[1]
            if heads_part:
                text = ex.graph.call_function(aten.narrow.default, (text, *heads_part))
            copy.args = (view, ex.heads(text, h_kv), *copy.args[2:])
        if ex.local is not None:  # at the text's place in the worker's own buffer
            with ex.graph.inserting_before(view):
                view.args = (view.args[0], view.args[1],
                             *(clone_ints(ex.graph, a, ex.local) for a in view.args[2:]))


def _frames(ex: _Exchange, w: BufferWrite, src: fx.Node, t_kv: int, h_kv: int,
            write_subst: dict) -> None:
    """The writes of a video chunk (one block of rows per frame): the exchanged keys put
    back in the chunk's frame-major order (:func:`interleave_parts`), then each frame's
    block written where the stage graph writes it."""
    graph, frames = ex.graph, 1 + len(w.blocks)

    def tokens(x: fx.Node) -> fx.Node:
        if ex.ulysses > 1:
            x = ex.mark(all_to_all_mark, x, h_kv, t_kv, group="ulysses")
            x = graph.call_function(interleave_parts, (x, t_kv, ex.ulysses, frames))
        if ex.ring > 1:
            x = ex.mark(all_gather_mark, x, t_kv, group="ring")
            x = graph.call_function(interleave_parts, (x, t_kv, ex.ring, frames))
        return x

    spec = w.buffer.meta[CHUNK_INPUT]  # CogVideoX: the text rows before the frames
    src = ex.segmented(src, t_kv, tokens, lambda x: ex.heads(x, h_kv),
                       (spec.prefix, spec.suffix))
    subst = {**write_subst, w.source: src}
    for view, copy in ((w.view, w.copy), *w.blocks):
        rows = copy.args[1]
        with graph.inserting_before(view):
            at, count = (clone_ints(graph, a, subst) for a in rows.args[2:4])
            got = graph.call_function(aten.narrow.default, (src, rows.args[1], at, count))
            view.args = (view.args[0], view.args[1],
                         *(clone_ints(graph, a, subst) for a in view.args[2:4]))
        copy.args = (view, got, *copy.args[2:])
    if ex.ulysses > 1:
        _set_heads(w.buffer, h_kv, w.buffer.meta[CHUNK_INPUT].shape[h_kv] // ex.ulysses)


def _made_after(node: fx.Node, last: fx.Node) -> set[fx.Node]:
    """The nodes from ``node``'s next up to ``last`` (the exchange back just made)."""
    made, cur = set(), node.next
    while cur is not last:
        made.add(cur)
        cur = cur.next
    made.add(last)
    return made


def _check_heads(node: fx.Node, key: BufferWrite, h_kv: int, ulysses: int, what: str) -> None:
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


def clone_ints(graph: fx.Graph, value: object, subst: dict) -> object:
    """``value`` recomputed with the nodes of ``subst`` replaced (a copy of the int
    arithmetic between them; nodes that read none of them are reused)."""
    if not isinstance(value, fx.Node):
        return value
    if value in subst:
        return subst[value]
    if value.op != "call_function" or not _reads(value, subst):
        return value
    args = fx.node.map_arg(value.args, lambda a: clone_ints(graph, a, subst))
    kwargs = fx.node.map_arg(value.kwargs, lambda a: clone_ints(graph, a, subst))
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
            sub_start, sub_size, aten.sym_size.int}
"""The int arithmetic an offset is made of."""


def _set_heads(buffer: fx.Node, axis: int, heads: int) -> None:
    spec = buffer.meta[CHUNK_INPUT]
    shape = list(spec.shape)
    shape[axis] = heads
    buffer.meta[CHUNK_INPUT] = type(spec)(**{**spec.__dict__, "shape": tuple(shape)})
