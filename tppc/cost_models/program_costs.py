"""What the chunk-step emitter adds, priced; and the layers of a chunk-step graph.

Terms:
    chunk-step graph: the graph ``chunk_attention_pass`` emits (``FrontEnd.chunk``), the
        program that runs for one chunk. The cost model prices it and nothing else.
    program layer: a :class:`tppc.ir.records.LayerInfo` from ``group_layers`` whose ``nodes`` are the
        chunk-step graph's nodes carrying that layer's ``tppc.layer`` meta (the emitter copies
        the meta, so it is ``group_layers``' assignment; masks the emitter dropped are gone,
        buffer writes and ``tppc::chunk_attention`` are in).
    K/V buffer: a placeholder whose :class:`tppc.ir.records.ChunkInput` kind is ``key``/``value``;
        its bytes per token are its fixed dims times its element size.

Rules: ``tppc::chunk_attention`` is priced by :func:`.attention.attention_work` with the op's
own ``causal`` flag (causal: keys ``p + c`` read, ``p·c + c(c+1)/2`` visited; with a
``window`` w: ``min(p + c, w + c − 1)`` read, ``Σ_i min(w, p + i + 1)`` visited, and a
``block`` b of chunked attention as a window of b, an upper bound; otherwise the buffer
length ``L``), heads from the query, K/V heads from the buffers (no repeat: the op runs
SDPA with ``enable_gqa``); a buffer write ``copy_(narrow(buffer), kv)`` moves its bytes twice
(read the chunk's K/V, write them into the buffer); ``narrow`` reads are views.

Example:
    >>> layers = program_layers(front.chunk, front.ctx.layers)        # doctest: +SKIP
    >>> [n for n in layers[1].nodes if "chunk_attention" in n]        # doctest: +SKIP
    ['chunk_attention_default']
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import sympy
import torch
from torch import fx

from tppc.cost_models.attention import attention_work
from tppc.cost_models.moe import moe_node_cost
from tppc.cost_models.node_costs import NodeCost
from tppc.cost_models.node_shapes import C, L, P, Shapes, numel, tensor_vals, value_bytes
from tppc.errors import CostModelError
from tppc.ir.records import CHUNK_INPUT, CHUNK_SIGNATURE, LAYER, PART, ChunkInput, LayerInfo

__all__ = ["is_chunk_graph", "program_layers", "program_node_cost", "program_signature"]

_CHUNK_ATTENTION = "chunk_attention"


def is_chunk_graph(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` is a chunk-step graph (it carries a chunk signature)."""
    return CHUNK_SIGNATURE in gm.meta


def program_layers(gm: fx.GraphModule, layers: Sequence[LayerInfo]) -> list[LayerInfo]:
    """``layers`` with their nodes read off ``gm``'s ``tppc.layer`` meta.

    A layer absent from ``gm`` that has the same annotated nodes as one present (a block
    re-expanded by ``tppc.frontend.blocks.expand_layers``) takes that layer's nodes; a layer with no
    per-chunk node (only positional work, computed once per call) gets none. A block's
    parts (``LayerInfo.parts``) get the nodes of their ``meta[PART]``.

    An annotated graph (no chunk signature) is accepted only for models the emitter cannot
    rewrite yet (patched DiTs: see :func:`tppc.frontend.annotate.program_of`); its layers are read the
    same way, from the ``tppc.layer`` meta ``group_layers`` wrote.
    """
    members: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.meta.get(LAYER), str):
            members.setdefault(node.meta[LAYER], []).append(node.name)
            if node.meta.get(PART):
                members.setdefault(f"{node.meta[LAYER]}.{node.meta[PART]}", []).append(node.name)
    template = {info.nodes: info.name for info in layers if info.name in members}
    out = []
    for info in layers:
        name = info.name if info.name in members else template.get(info.nodes, "")
        parts = tuple(dataclasses.replace(part, nodes=tuple(
            members.get(name + part.name[len(info.name):], ()))) for part in info.parts)
        out.append(dataclasses.replace(info, nodes=tuple(members.get(name, ())), parts=parts))
    return out


def _buffer(node: object, owner: fx.Node) -> ChunkInput:
    """The K/V buffer placeholder a ``narrow`` read of the chunk-step graph reads."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.args:
        node = node.args[0]
    spec = node.meta.get(CHUNK_INPUT) if isinstance(node, fx.Node) else None
    if not isinstance(spec, ChunkInput) or spec.kind not in ("key", "value"):
        raise CostModelError(
            f"node {owner.name} (tppc::chunk_attention) reads {node} as key/value, not a K/V "
            "buffer placeholder; the emitter's buffers are placeholders of kind key/value")
    return spec


def _per_token(spec: ChunkInput) -> int:
    return math.prod(d for d in spec.shape if d is not None)


def program_signature(node: fx.Node) -> tuple:
    """What besides shapes decides a node's price: the K/V buffers of a chunk attention."""
    if node.op != "call_function" or _name(node) != _CHUNK_ATTENTION:
        return ()
    return tuple((b.shape, b.dtype) for b in (_buffer(node.args[1], node),
                                              _buffer(node.args[2], node)))


def _name(node: fx.Node) -> str:
    return getattr(node.target, "_opname", "") if node.op == "call_function" else ""


def program_node_cost(node: fx.Node, shapes: Shapes, dtype: str) -> NodeCost | None:
    """The price of a node the emitter adds (None for any other node)."""
    if _name(node) == _CHUNK_ATTENTION:
        return _chunk_attention(node, shapes, dtype)
    moe = moe_node_cost(node, shapes, dtype)
    if moe is not None:
        return moe
    if node.target is torch.ops.aten.copy_.default and not tensor_vals(node.args[0].meta.get("val")):
        nbytes = 2 * value_bytes(shapes, [node.args[1]])
        return NodeCost(node.name, "copy_", "memory", sympy.Integer(0), (), sympy.Integer(0),
                        sympy.expand(nbytes), dtype)
    return None


def _chunk_attention(node: fx.Node, shapes: Shapes, dtype: str) -> NodeCost:
    query = node.args[0]
    causal = bool(node.args[4]) if len(node.args) > 4 else bool(node.kwargs.get("causal"))
    key, value = _buffer(node.args[1], node), _buffer(node.args[2], node)
    q = shapes.shape(query)
    if not q or len(q) < 3:
        raise CostModelError(f"node {node.name}: its query {query} has no shape in meta['val']; "
                             "the emitter copies meta['val'] of the query")
    item = tensor_vals(query.meta["val"])[0].element_size()
    kv_heads = sympy.cancel(sympy.Integer(_per_token(key)) / q[-1])
    window = node.args[9] if len(node.args) > 9 else node.kwargs.get("window")
    block = node.args[12] if len(node.args) > 12 else node.kwargs.get("block")
    if window is None:  # a block of b keys: each row sees at most b (priced as a window)
        window = block
    window = int(window) if causal and window is not None else None
    keys = (P + C if window is None else sympy.Min(P + C, C + window - 1)) if causal else L
    mask = node.args[7] if len(node.args) > 7 else node.kwargs.get("attn_mask")
    mask_bytes = sympy.Integer(0)
    if isinstance(mask, fx.Node) and tensor_vals(mask.meta.get("val")):
        rows = numel((shapes.shape(mask) or (1,))[:-1])
        mask_bytes = rows * keys * tensor_vals(mask.meta["val"])[0].element_size()
    work = attention_work(q[-2], P, causal=causal, heads=numel(q[:-2]), head_dim=q[-1],
                          kv_heads=kv_heads, value_dim=sympy.cancel(_per_token(value) / kv_heads),
                          itemsize=item, keys=keys, writes_kv=False, window=window)
    matrix = sum((2 * b * m * n * k for b, m, n, k in work.matmuls), sympy.Integer(0))
    per_key = sum(_per_token(b) * (b.dtype.itemsize if b.dtype is not None else item)
                  for b in (key, value))
    return NodeCost(node.name, _CHUNK_ATTENTION, "attention", sympy.expand(matrix),
                    work.matmuls, work.vector_flops, sympy.expand(work.bytes + mask_bytes),
                    dtype, kv_bytes_per_key=int(per_key), causal_keys=work.causal)
