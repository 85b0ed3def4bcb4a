"""Ring attention on a token-cut worker graph: each worker keeps its own K/V block, the
blocks go around the ring group in ``ring - 1`` shifts, and the partial attentions merge by
their log-sum-exps (Liu et al., *Ring Attention with Blockwise Transformers*, 2023; xDiT's
and yunchang's ``ring_flash_attn``).

Terms:
    own block: the rows of the keys and values the worker writes itself: its ring block of
        every chunk (after Ulysses' exchange: the ``ulysses`` sub-chunks of its ring
        coordinate, its heads). Its K/V buffers hold only these, ``1/ring`` of the
        sequence's rows (``ChunkInput.parts``), laid out as the stage graph lays out the
        buffer of a sequence ``ring`` times shorter: the worker's rows of chunk
        ``[a, a + c)`` at the rows of chunk ``[a / ring, (a + c) / ring)``
        (:func:`local_subst`: ``chunk_start`` and ``seq_len`` divided by ``ring`` in the
        write offsets and the read length). Bidirectional attention without a mask does not
        care where a key sits, so this is exact for any order of the blocks.
    text: joint attention's text rows (a prefix or suffix of the buffer) are computed
        whole on every worker, as in the gather form; each worker's buffer keeps them and
        attends to them in its first step only; only the image rows circulate.
    steps: step 0 attends the worker's whole buffer (text and own block); step ``s`` attends
        the block received by the ``s``-th ``ring_shift`` (member ``m - s``'s), merged into
        the partial so far (:mod:`tppc.passes.meshcut.ring_kernels`). A worker holds its own
        block, the block it sends and the one it receives: its K/V buffers are ``1/ring``
        of the gather form's, plus two blocks in flight per attention.
    gather form: what an attention the ring form does not cover runs instead (the chunk's
        K/V gathered around the ring, one attention over the whole buffer), with the reason
        in ``node.meta[RING_FORM]`` (:func:`ring_reason`): causal attention (the blocks
        would need per-block causal masks), a mask, key padding, a window, a soft-cap or
        sinks, a video's frame blocks, a read that depends on the chunk.

The shifts run as actions of the ring group (``ring_shift``: send to the next member,
receive from the previous) between the worker's parts; the executors do not overlap them
with the partial attentions (a collective ends a part), so each shift is exposed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from tppc.ir.records import CHUNK_INPUT, RING_FORM, RingForm
from tppc.passes.meshcut.ring_kernels import attend_block, finish, join_kv, step
from tppc.passes.sharding.shard_graph import ring_shift_mark

__all__ = ["graph_reason", "local_subst", "ring_attention", "ring_reason", "set_parts"]

aten = torch.ops.aten

_UNSUPPORTED = ("attn_mask", "key_valid", "window", "softcap", "sinks", "block")
"""Arguments of ``tppc::chunk_attention`` (positions 7..12) the ring form refuses."""


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def ring_reason(node: fx.Node, frames: bool, reads_chunk: bool, local: dict | None) -> str:
    """Why attention ``node`` takes the gather form under a ring (``""``: the ring form).

    Args:
        node: a ``tppc::chunk_attention`` node.
        frames: its K/V writes are a video's frame blocks.
        reads_chunk: its keys' read length depends on the chunk (not the sequence alone).
        local: :func:`local_subst` (None: the graph has no ``seq_len`` input).
    """
    if _arg(node, 4, "causal", False):
        return "causal attention (each block would need its own causal mask)"
    for i, name in enumerate(_UNSUPPORTED, start=7):
        if _arg(node, i, name) is not None:
            return f"its {name} argument (the ring form attends unmasked blocks only)"
    if frames:
        return "its K/V are written as a video's frame blocks"
    if local is None:
        return "the stage has no seq_len input to size a worker's own K/V block"
    if reads_chunk:
        return "its keys' read length depends on the chunk"
    return ""


def graph_reason(node: fx.Node) -> str:
    """:func:`ring_reason` of a chunk-step (or stage) graph's attention ``node`` as the
    cost model sees it: its arguments and its key buffer's frames (``""``: the ring form)."""
    buffer = node.args[1] if len(node.args) > 1 else None
    while isinstance(buffer, fx.Node) and buffer.op == "call_function" and buffer.args:
        buffer = buffer.args[0]
    spec = buffer.meta.get(CHUNK_INPUT) if isinstance(buffer, fx.Node) else None
    return ring_reason(node, spec is not None and spec.frames > 1, False, {})


def local_subst(graph: fx.Graph, after: fx.Node, start: fx.Node, first: fx.Node,
                seq_len: fx.Node | None, ring: int) -> dict[fx.Node, fx.Node] | None:
    """The int nodes that place a worker's own rows in its buffer (module docstring): the
    sub-chunk start ``first`` (which replaced ``chunk_start``) and ``seq_len`` as the chunk's
    start and the sequence's length over ``ring``; None without ``seq_len``."""
    if seq_len is None:
        return None
    with graph.inserting_after(after):
        length = graph.call_function(operator.floordiv, (seq_len, ring))
    with graph.inserting_after(length):
        at = graph.call_function(operator.floordiv, (start, ring))
    return {first: at, seq_len: length}


def set_parts(buffer: fx.Node, ring: int) -> None:
    """Mark ``buffer`` as a worker's own block (``1/ring`` of the sequence's rows)."""
    spec = buffer.meta[CHUNK_INPUT]
    buffer.meta[CHUNK_INPUT] = type(spec)(**{**spec.__dict__, "parts": ring})


def ring_attention(graph: fx.Graph, node: fx.Node, ring: int,
                   mark: Callable[..., fx.Node]) -> None:
    """Rewrite attention ``node`` (reading the worker's own K/V buffers) into ``ring``
    steps with ``ring - 1`` shifts of its block (module docstring); ``node`` becomes the
    merged output. ``mark(target, x, group=...)`` makes a collective mark."""
    query, key, value = node.args[:3]
    spec = key.args[0].meta[CHUNK_INPUT]
    axis, prefix, suffix = int(spec.axis), spec.prefix, spec.suffix
    scale, gqa = _arg(node, 5, "scale"), bool(_arg(node, 6, "enable_gqa", False))
    split = int(spec.shape[-1])
    with graph.inserting_before(node):
        state = graph.call_function(attend_block, (query, key, value, scale, gqa))
        out, lse = (graph.call_function(operator.getitem, (state, i)) for i in (0, 1))
        block = graph.call_function(join_kv, (_image(graph, key, axis, prefix, suffix),
                                              _image(graph, value, axis, prefix, suffix)))
        for _ in range(ring - 1):
            block = mark(ring_shift_mark, block, group="ring")
            state = graph.call_function(step, (out, lse, query, block, split, scale, gqa))
            out, lse = (graph.call_function(operator.getitem, (state, i)) for i in (0, 1))
    node.target, node.args, node.kwargs = finish, (out, query), {}
    node.meta[RING_FORM] = RingForm("ring")


def _image(graph: fx.Graph, x: fx.Node, axis: int, prefix: int, suffix: int) -> fx.Node:
    """The image rows of a buffer read (the text prefix and suffix left out)."""
    if not prefix and not suffix:
        return x
    rows = graph.call_function(aten.sym_size.int, (x, axis))
    inner = graph.call_function(operator.sub, (rows, prefix + suffix))
    return graph.call_function(aten.narrow.default, (x, axis, prefix, inner))
