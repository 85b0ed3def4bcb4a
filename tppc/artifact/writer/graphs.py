"""Stage graphs for export: K/V rows as outputs instead of in-place writes into the buffer.

Terms:
    in-place K/V write: what an emitted stage graph does per attention,
        ``copy_(narrow(buffer, axis, chunk_start, chunk_size), kv)``, then reads
        ``narrow(buffer, axis, 0, kv_len)``. A portable graph cannot mutate its inputs, and
        returning the whole updated buffer would copy the cache on every chunk.
    export stage graph: the same stage with every write removed; the chunk's new K and V
        rows are extra outputs (``kv.<buffer>``) that the runner writes into its persistent
        buffer after the chunk; each attention becomes :func:`split_attention`, which reads
        the buffer's prefix ``[0, chunk_start)`` (and, for bidirectional attention, its
        suffix ``[chunk_start + chunk_size, kv_len)``) and the chunk's own K/V directly.

So a chunk reads the keys its attention needs and writes only its own rows: per-chunk work
does not depend on the buffer's capacity.

Example:
    >>> gm, kv_names = export_stage_graph(stage)                           # doctest: +SKIP
    >>> kv_names
    ('kv.scaled_dot_product_attention_key_buffer', 'kv.scaled_dot_product_attention_value_buffer')
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

import tppc.ir.ops  # noqa: F401  (registers torch.ops.tppc)
from tppc.artifact.writer.kv_reads import buffer_read, is_buffer_narrow
from tppc.artifact.writer.state_reads import functional_states
from tppc.errors import ExportError
from tppc.passes.subgraph import copy_graph

__all__ = ["ExportError", "attention_args", "export_stage_graph", "split_attention"]

_aten = torch.ops.aten


def split_attention(query: torch.Tensor, key_buffer: torch.Tensor, value_buffer: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor, chunk_start: int, kv_len: int,
                    causal: bool, scale: float | None = None, enable_gqa: bool = False,
                    attn_mask: torch.Tensor | None = None, key_valid: torch.Tensor | None = None,
                    window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, block: int | None = None
                    ) -> torch.Tensor:
    """Attention of a chunk over ``buffer[lo:chunk_start]``, its own K/V, ``buffer[end:kv_len]``.

    The torch reference of what the ONNX translation computes: one softmax over the scores
    of the key segments (in position order). Causal: the keys are ``[lo, chunk_start + c)``
    with ``lo = max(0, chunk_start - window + 1)`` (0 without a window), each row seeing
    the keys ``i - window < j ≤ i``; bidirectional: ``[0, kv_len)`` with the suffix. A
    padding mask ``key_valid`` (``(batch, ≥ kv_len)``, 0 = hidden) hides keys of every row;
    a row that sees no key gives 0 (as ``tppc::chunk_attention``). ``softcap`` and ``sinks``
    as :func:`tppc.ir.softmax_attention.softmax_attention_math` (the cap on the scaled
    scores before the masks; one logit per head appended to each row, dropped after the
    softmax). ``block`` (chunked attention, causal): the keys ``[start // block · block,
    chunk_start + c)``, each row seeing its own block's. Buffers and K/V are ``(..., heads_kv, tokens, d)``.
    """
    c = query.shape[-2]
    end = chunk_start + c
    lo = 0 if window is None else max(0, chunk_start - window + 1)
    if block is not None and causal:
        lo = max(lo, chunk_start // block * block)
    keys = [key_buffer[..., lo:chunk_start, :], key]
    values = [value_buffer[..., lo:chunk_start, :], value]
    if not causal:
        keys.append(key_buffer[..., end:kv_len, :])
        values.append(value_buffer[..., end:kv_len, :])
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    q = query
    if enable_gqa and query.shape[-3] != key.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        q = query.unflatten(-3, (key.shape[-3], group))
        keys = [k.unsqueeze(-3) for k in keys]
        values = [v.unsqueeze(-3) for v in values]
    full = torch.cat([q @ k.transpose(-1, -2) * scale for k in keys], dim=-1)
    if softcap is not None:
        full = torch.tanh(full / softcap) * softcap
    hi = end if causal else kv_len
    visible = None
    if causal:
        rows = torch.arange(chunk_start, end, device=query.device)[:, None]
        cols = torch.arange(lo, hi, device=query.device)
        visible = cols <= rows if window is None else (cols <= rows) & (cols > rows - window)
        if block is not None:
            visible = visible & (cols // block == rows // block)
    if key_valid is not None:
        valid = key_valid[:, lo:hi].bool().reshape(
            key_valid.shape[0], *[1] * (full.dim() - 2), hi - lo)
        visible = valid if visible is None else visible & valid
    if attn_mask is not None:
        mask = attn_mask.unsqueeze(-3) if q is not query else attn_mask
        full = full.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else full + mask
    if visible is not None:
        full = full.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # (..., heads, c, 1) in the layout of the scores
        sink = sinks.to(full.dtype).expand(*query.shape[:-1], 1)
        sink = sink.unflatten(-3, q.shape[-4:-2]) if q is not query else sink
        full = torch.cat([full, sink], dim=-1)
    probs = torch.softmax(full, dim=-1)
    if key_valid is not None or attn_mask is not None:  # a row that sees no key: 0
        probs = probs.masked_fill(full.amax(-1, keepdim=True) == float("-inf"), 0.0)
    out = 0
    offset = 0
    for v in values:
        n = v.shape[-2]
        out = out + probs[..., offset:offset + n] @ v
        offset += n
    return out.flatten(-4, -3) if q is not query else out


def export_stage_graph(stage: Any) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """The export stage graph of a :class:`tppc.program.program.StageProgram` (module docstring).

    Returns the graph (a copy; the stage is untouched) and the names of its new K/V outputs
    (and new states of its state buffers, :mod:`tppc.artifact.writer.state_reads`), one per
    buffer in ``stage.buffers`` order, after the stage's own outputs.

    Raises:
        ExportError: an attention whose K/V are not read straight from a buffer.
    """
    gm = copy_graph(stage.module)
    graph = gm.graph
    new_rows: dict[str, fx.Node] = functional_states(graph, stage)  # carried states
    buffers = {b.name for b in stage.buffers if b.kind != "state"}
    offsets: dict[str, Any] = {}  # the row of the buffer the chunk's first row is written at
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _aten.copy_.default:
            view = node.args[0]
            if is_buffer_narrow(view, buffers):
                new_rows[view.args[0].name] = node.args[1]
                offsets[view.args[0].name] = view.args[2]
                graph.erase_node(node)
                if not view.users:
                    graph.erase_node(view)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.tppc.chunk_attention.default:
            _rewrite_attention(graph, node, buffers, new_rows, offsets)
    missing = buffers - set(new_rows)
    if missing:
        raise ExportError(f"stage {stage.index}: no in-place write of the chunk's rows into "
                          f"K/V buffer(s) {sorted(missing)}; tppc cannot export this stage. "
                          "fix: report the model (its attention pattern is not supported)")
    output = next(iter(graph.find_nodes(op="output")))
    outs = tuple(output.args[0])
    graph.erase_node(output)
    graph.output((*outs, *(new_rows[b.name] for b in stage.buffers)))
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm, tuple(f"kv.{b.name}" for b in stage.buffers)


_ATTENTION_ARGS = ("query", "key", "value", "chunk_start", "causal", "scale", "enable_gqa",
                   "attn_mask", "key_valid", "window", "softcap", "sinks", "block")
_ATTENTION_DEFAULTS = {"scale": None, "enable_gqa": False, "attn_mask": None,
                       "key_valid": None, "window": None, "softcap": None, "sinks": None,
                       "block": None}


def attention_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of a ``tppc::chunk_attention`` node by name (defaults filled in)."""
    args = dict(_ATTENTION_DEFAULTS)
    args.update(zip(_ATTENTION_ARGS, node.args))
    args.update(node.kwargs)
    unknown = set(args) - set(_ATTENTION_ARGS)
    if unknown:
        raise ExportError(f"attention {node.name!r} has argument(s) {sorted(unknown)} that "
                          "tppc's export does not know. fix: report the model")
    return args


def _rewrite_attention(graph: fx.Graph, node: fx.Node, buffers: set[str],
                       new_rows: dict[str, fx.Node], offsets: dict[str, Any]) -> None:
    """``node`` as :func:`split_attention`, the buffer split at the rows the chunk writes
    (``chunk_start`` for LLM tokens; ``prefix + scale · chunk_start`` for a DiT's patch rows
    after a text prefix: the chunk's start is in units, its K/V rows are not)."""
    a = attention_args(node)
    views, gqa = _buffer_reads(node, a, buffers)
    window, block = a["window"], a["block"]
    for what, size in (("sliding window", window), ("block (chunked attention)", block)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
            raise ExportError(f"attention {node.name!r} has a {what} of {size!r} keys "
                              "that is not a constant int; tppc exports windows and blocks "
                              "fixed at compile time only. fix: a model config with an int "
                              "sliding_window (attention_chunk_size)")
    valid = a["key_valid"]
    if valid is not None and not (isinstance(valid, fx.Node) and valid.op == "placeholder"):
        raise ExportError(f"attention {node.name!r} reads a padding mask computed inside the "
                          f"stage ({valid!r}), not a model input; tppc cannot export it. fix: "
                          "pass the attention_mask as a model input")
    key_buffer, value_buffer = (v.args[0] for v in views)
    rows = [new_rows.get(b.name) for b in (key_buffer, value_buffer)]
    if any(r is None for r in rows):
        raise ExportError(f"attention {node.name!r} reads a buffer before its chunk's rows "
                          "are written; tppc cannot export it. fix: report the model")
    with graph.inserting_before(node):
        start = offsets[key_buffer.name] if not a["causal"] else a["chunk_start"]
        new = graph.call_function(split_attention, (
            a["query"], key_buffer, value_buffer, rows[0], rows[1], start,
            views[0].args[3], a["causal"], a["scale"], gqa, a["attn_mask"],
            valid, window, _number(node, "softcap", a["softcap"]), a["sinks"], block))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)  # the views it read: removed with the dead code


def _buffer_reads(node: fx.Node, a: dict[str, Any], buffers: set[str]
                  ) -> tuple[tuple[fx.Node, fx.Node], bool]:
    """The ``narrow`` reads of the key and value buffers under the attention's K/V, and its
    ``enable_gqa`` (set when a view chain repeats the heads, as ``repeat_kv`` does)."""
    reads = [buffer_read(a[what], buffers) for what in ("key", "value")]
    if any(r is None or r.narrow.args[2] != 0 for r in reads):
        ops = sorted({str(v.target) for what in ("key", "value")
                      for v in _chain_ops(a[what])})
        raise ExportError(f"attention {node.name!r} reads K/V that are not a prefix of a K/V "
                          f"buffer seen through views that keep or repeat its heads (ops on "
                          f"the way: {ops or 'none'}); tppc cannot export it. fix: run it "
                          "with backend='torch', or report the model")
    groups = {r.group for r in reads}
    if len(groups) != 1 or (a["enable_gqa"] and groups != {1}):
        raise ExportError(f"attention {node.name!r} repeats the heads of its keys and values "
                          f"differently (groups {sorted(groups)}, enable_gqa="
                          f"{a['enable_gqa']}); tppc cannot export it. fix: report the model")
    return (reads[0].narrow, reads[1].narrow), bool(a["enable_gqa"]) or groups != {1}


def _chain_ops(node: Any) -> list[fx.Node]:
    """The ops from ``node`` down to the first placeholder along first arguments (at most
    8): what an unrecognised K/V read goes through."""
    out: list[fx.Node] = []
    while isinstance(node, fx.Node) and node.op == "call_function" and len(out) < 8:
        out.append(node)
        node = node.args[0] if node.args else None
    return out


def _number(node: fx.Node, what: str, value: Any) -> float | None:
    """A soft-cap fixed at compile time (a float), as the ONNX graph holds it."""
    if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
        return value
    raise ExportError(f"attention {node.name!r} has a {what} of {value!r} that is not a "
                      "number fixed at compile time; tppc cannot export it. fix: report the "
                      "model")
