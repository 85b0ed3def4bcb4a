"""Pass: rewrite the annotated graph into a chunk-step graph with full-length K/V buffers.

Terms:
    chunk: the tokens ``[chunk_start, chunk_start + chunk_size)`` of one sequence of length
        ``seq_len``; one call of the chunk-step graph processes one chunk.
    frontier value: a ``positional`` tensor read by a ``token``/``mixing`` node (rope tables,
        position embeddings, masks). It depends only on shapes, so it is evaluated once per
        call at the full length by the *positional program* (``gm.tppc_positional``, given
        zero-valued inputs of that length) and every chunk step receives its rows
        ``[chunk_start, chunk_start + chunk_size)`` along its token axis (a mask keeps all of
        its key columns).
    K/V buffer: one full-length tensor per attention input (key, value), holding the
        attention's K (V) as the model computes it *before* grouped-query repetition. The
        unsqueeze → expand → reshape that HF inserts before SDPA is re-applied after reading
        the buffer, so a buffer costs the bytes of the model's K/V heads, like HF's cache. When
        that chain is exactly HF's ``repeat_kv``, SDPA is called with ``enable_gqa=True``
        instead (same result, without repeating the prefix's K/V for every chunk).

Each attention node becomes: write the chunk's K and V into the buffers at
``[chunk_start, chunk_start + chunk_size)``; read keys ``[0, kv_len)`` back, where ``kv_len``
is ``chunk_start + chunk_size`` for causal attention (later positions are masked anyway)
and ``seq_len`` for bidirectional attention; slice the mask's key columns to ``kv_len``;
``is_causal=True`` becomes the explicit offset-causal mask ``key j ≤ chunk_start + row i``.
A float attention bias (ALiBi) becomes its rows for the chunk (:mod:`.bias_rows`).
For causal models the result equals the unsplit model exactly (chunked prefill).

A ``global`` epilogue (a loss, pooling over tokens) becomes the *tail* (``gm.tppc_tail``):
the chunk step returns the token values it reads, and the tail runs once on their
concatenation over all chunks.

Symbolic sizes the model derives from the sequence length (``view(x, [1, s, -1, 8])``)
become ``chunk_size``; ``const`` nodes (weights, conditioning) are kept as they are.

Inputs of the chunk-step graph (each placeholder carries a :class:`ChunkInput` under
:data:`CHUNK_INPUT`): the chunk of every token input, the const inputs it reads,
``chunk_start``, ``chunk_size``, ``seq_len``, the frontier slices, the K/V buffers.

Example:
    >>> gm = run_passes(gm, ctx, [annotate_seq_dims_pass, group_layers_pass,
    ...                           chunk_attention_pass])                   # doctest: +SKIP
    >>> [p.meta[CHUNK_INPUT].kind for p in gm.graph.find_nodes(op="placeholder")][:4]
    ['token', 'chunk_start', 'chunk_size', 'seq_len']
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

import tppc.ir.ops  # noqa: F401  (registers torch.ops.tppc)
from tppc.errors import PassError
from tppc.ir.context import CompileContext
from tppc.ir.op_rules import op_rule
from tppc.ir.records import (
    CHUNK_INPUT,
    CHUNK_SIGNATURE,
    LAYER,
    PART,
    TOKEN,
    ChunkInput,
    ChunkSignature,
    KVBuffer,
    TokenInfo,
)
from tppc.passes.annotation.buffered_mixing import buffered_operands
from tppc.passes.annotation.key_masks import inputs_by_value
from tppc.passes.chunking.attention_step import AttentionStep
from tppc.passes.chunking.bias_rows import BiasRows, value_inputs
from tppc.passes.chunking.block_state import BlockState, block_scan_part
from tppc.passes.chunking.carried_state import CarriedState, is_recurrent
from tppc.passes.chunking.chunk_buffers import BufferReads, buffered_inputs
from tppc.passes.chunking.chunk_parts import (
    cache_source,
    input_value_error,
    inputs_read,
    leaves,
    positional_program,
    sdpa_kwargs,
    tail_program,
)
from tppc.passes.chunking.context_rows import check_context
from tppc.passes.chunking.frame_rows import chunk_outputs, frame_table_rows, token_frames
from tppc.passes.chunking.length_tables import length_reason
from tppc.passes.chunking.token_rows import (
    REST_CHUNK,
    baked_table_axis,
    chunk_rows_size,
    prefixed_size,
    rest_of_step,
    row_offset,
    rows_per_unit,
    split_size,
    table_rows,
)
from tppc.passes.shapes import module_path, size_expr, tensor_val

__all__ = [
    "REST_CHUNK",
    "ChunkSignature",
    "KVBuffer",
    "chunk_attention_pass",
]

_aten = torch.ops.aten


def chunk_attention_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Return the chunk-step graph of an annotated, grouped graph (see the module docstring).

    Raises:
        PassError: a construct that cannot be chunked (names the node and the fix).
    """
    if ctx.token_count is not None and rows_per_unit(ctx.token_count, ctx) is None:
        raise PassError(
            f"the token count of {ctx.model_name} is {ctx.token_count}, not a whole number of "
            f"tokens per step of the sequence symbol {ctx.seq_symbol}; a chunk must be a band "
            "of whole rows. fix: capture with the latent's height as the sequence axis"
        )
    chunk = _Rewriter(gm, ctx).run()
    if any(n.meta[TOKEN].prefix or n.meta[TOKEN].suffix for n in gm.graph.nodes
           if TOKEN in n.meta):
        chunk.meta[REST_CHUNK] = _Rewriter(gm, ctx, carry=False).run()
    return chunk



class _Rewriter(AttentionStep, BufferReads, CarriedState, BlockState):
    """Builds the chunk-step graph and the positional program from an annotated graph."""

    def __init__(self, gm: fx.GraphModule, ctx: CompileContext, *, carry: bool = True) -> None:
        self.gm, self.ctx, self.sym, self.carry = gm, ctx, ctx.seq_symbol, carry
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.mode: dict[fx.Node, str] = {}
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.kv_end: fx.Node | None = None
        self.buffers: list[KVBuffer] = []
        self.buffer_nodes: dict[tuple[str, str], fx.Node] = {}
        self.full_inputs: dict[str, fx.Node] = {}
        self.bias: BiasRows | None = None

    def run(self) -> fx.GraphModule:
        output = next(n for n in self.gm.graph.nodes if n.op == "output")
        tail, tail_inputs = tail_program(self.gm, output, self.sym, per_chunk=self._per_chunk)
        roots = tail_inputs if tail is not None else leaves(output)
        self._classify([r for r in roots if isinstance(r, fx.Node)])
        frontier = [n for n in self.gm.graph.nodes if self.mode.get(n) == "frontier"]
        attention = [n for n in self.gm.graph.nodes if self.mode.get(n) == "copy"
                     and op_rule(n.target).role == "attention"
                     and n.meta[TOKEN].role == "mixing"]
        buffered = [n for n in self.gm.graph.nodes  # linear attention, neighbourhood convs
                    if self.mode.get(n) == "copy" and buffered_operands(n) is not None]
        self._placeholders(frontier, attention + buffered)
        self._state_inputs([n for n in self.gm.graph.nodes  # scans, causal convolutions
                            if self.mode.get(n) == "copy" and is_recurrent(n)
                            and block_scan_part(n) is None])
        self._block_state_inputs([n for n in self.gm.graph.nodes  # recurrences over blocks
                                  if self.mode.get(n) == "copy"])
        for node in self.gm.graph.nodes:
            if self.mode.get(node) == "copy" and node not in self.env:
                self.env[node] = self._emit(node)
            elif self.mode.get(node) == "whole":
                self.env[node] = self.graph.node_copy(node, lambda a: self._whole_input(a)
                                                      if a.op == "placeholder" else self.env[a])
        axes, rows = chunk_outputs(self.graph, self.env, roots, self._rows)
        self.graph.eliminate_dead_code()
        chunk_gm = fx.GraphModule(self.gm, self.graph, class_name="ChunkStep")
        chunk_gm.add_submodule("tppc_positional", positional_program(self.gm, frontier))
        if tail is not None:
            chunk_gm.add_submodule("tppc_tail", tail)
        pytree = self.gm.graph._codegen.pytree_info  # type: ignore[attr-defined]
        chunk_gm.meta[CHUNK_SIGNATURE] = ChunkSignature(
            user_inputs=tuple(p.name for p in self.placeholders),
            in_spec=pytree.in_spec if pytree else None,
            out_spec=pytree.out_spec if pytree else None,
            output_axes=axes,
            frontier=tuple(n.name for n in frontier),
            buffers=tuple(self.buffers),
            attention=tuple(n.name for n in attention),
            tail=tail is not None,
            output_rows=rows,
            length_tables=tuple(n.name for n in frontier if length_reason(n, self.sym))
            + tuple(n.name for n, mode in self.mode.items() if mode == "whole"),
        )
        return chunk_gm

    # -- which original nodes the chunk step needs, and how ---------------------------------
    def _classify(self, roots: list[fx.Node]) -> None:
        todo = list(roots)
        while todo:
            node = todo.pop()
            if node in self.mode:
                continue
            self.mode[node] = mode = self._mode_of(node)
            if mode == "copy":
                todo.extend(inputs_read(node))
            elif mode == "whole":
                todo.extend(a for a in node.all_input_nodes if a.op != "placeholder")

    def _mode_of(self, node: fx.Node) -> str:
        info: TokenInfo = node.meta[TOKEN]
        if node.op == "placeholder":
            return "token_input" if info.role == "token" else "const_input"
        if is_recurrent(node):
            return "copy"  # a causal convolution's value has k − 1 rows more than its input
        if info.role in ("token", "mixing") and info.axis is not None \
                and not info.prefix_only and rows_per_unit(split_size(info), self.ctx) is None:
            raise PassError(
                f"node {node.name!r} (op {node.target}, module {info.module or '<top level>'}) "
                f"makes a token axis of {info.axis_size} positions from {self.sym}; it cannot "
                "run chunk by chunk. fix: move it after the blocks (it then runs once on the "
                "full sequence) or remove it"
            )
        if info.role != "positional":
            return "copy"
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            expr = size_expr(val)
            if self.ctx.capture_mode == "specialized":
                return "copy"  # sizes read from the chunk's own shapes (height and width)
            if expr == self.sym:
                return "chunk_size"
            if node.target is _aten.sym_size.int and not chunk_rows_size(expr, self.ctx):
                raise PassError(
                    f"node {node.name!r} (module {module_path(node) or '<top level>'}) is a "
                    f"size {expr} of the sequence length {self.sym}; chunk_attention supports "
                    "sizes equal to the sequence length. fix: index the sequence axis directly"
                )
            return "copy"
        if isinstance(val, torch.Tensor):
            if info.inputs and info.axis is None and not info.other_axes:
                return "whole"  # of the call's inputs whole: max(position_ids) + 1
            if info.inputs:
                raise input_value_error(node, info)
            if info.axis is not None and rows_per_unit(split_size(info), self.ctx) is None:
                raise PassError(
                    f"positional node {node.name!r} has token axis {info.axis} of size "
                    f"{info.axis_size}, not a whole number of positions per step of "
                    f"{self.sym}; it cannot be sliced per chunk. fix: build position tables "
                    "of the sequence length"
                )
            return "frontier"
        return "copy"

    # -- placeholders ------------------------------------------------------------------------
    def _placeholders(self, frontier: list[fx.Node], attention: list[fx.Node]) -> None:
        for index, p in enumerate(self.placeholders):
            mode = self.mode.get(p)
            if mode == "token_input":
                axis = self.ctx.seq_inputs[p.name][0]
                scale = rows_per_unit(size_expr(tensor_val(p).shape[axis]), self.ctx) or 1
                frames = token_frames(size_expr(tensor_val(p).shape[axis]), self.ctx)
                spec = ChunkInput("token", p.name, index, axis, scale=scale, frames=frames)
                self.env[p] = self._input(p.name, spec, p)
            elif mode == "const_input":
                self.env[p] = self._input(p.name, ChunkInput("const", p.name, index), p)
        self.start = self._input("chunk_start", ChunkInput("chunk_start"))
        self.size = self._input("chunk_size", ChunkInput("chunk_size"))
        self.seq_len = self._input("seq_len", ChunkInput("seq_len"))
        for n in (n for n in self.mode if self.mode[n] == "chunk_size"):
            self.env[n] = self.size
        for index, node in enumerate(frontier):
            info = node.meta[TOKEN]
            check_context(node, "positional")
            spec = ChunkInput("positional", node.name, index, info.axis,
                              scale=self._scale(info), prefix=info.prefix,
                              frames=self._frames(info))
            self.env[node] = self._input(f"pos_{node.name}", spec, node)
        for attn in attention:
            for which, arg in buffered_inputs(attn).items():
                source, _ = cache_source(arg, self.sym)
                val = tensor_val(source)
                axis = source.meta[TOKEN].axis
                shape = tuple(None if i == axis else int(s) for i, s in enumerate(val.shape))
                info = source.meta[TOKEN]  # its own segments: image queries may read text
                spec = ChunkInput(which, attn.name, axis=axis, shape=shape, dtype=val.dtype,
                                  layer=attn.meta.get(LAYER, ""), scale=self._scale(info),
                                  prefix=info.prefix, suffix=info.suffix)
                name = f"{attn.name}_{which}_buffer"
                ph = self._input(name, spec)
                ph.meta[LAYER] = spec.layer
                if PART in attn.meta:
                    ph.meta[PART] = attn.meta[PART]
                self.buffers.append(KVBuffer(name, spec))
                self.buffer_nodes[attn.name, which] = ph
            mask = attn.meta[TOKEN].mask
            if mask is not None and mask.key_valid is not None:
                self._full_input(mask.key_valid)
            if mask is not None and (mask.bias or mask.key_mask):
                m = sdpa_kwargs(attn)["attn_mask"]
                for p in value_inputs(m) if mask.bias else inputs_by_value(m, self.ctx)[0]:
                    self._whole_input(p)
        self.bias = BiasRows(self.graph, self.ctx, (self.start, self.size, self.seq_len),
                             self._whole_input)

    def _input(self, name: str, spec: ChunkInput, like: fx.Node | None = None) -> fx.Node:
        ph = self.graph.placeholder(name)
        if like is not None:
            ph.meta.update(like.meta)
        ph.meta[CHUNK_INPUT] = spec
        return ph

    # -- body --------------------------------------------------------------------------------
    def _emit(self, node: fx.Node) -> Any:
        if not self.carry:
            rest = rest_of_step(node, self.env)
            if rest is not None:
                return rest
            rows = prefixed_size(node, self.ctx)
            if rows is not None:  # a later chunk's size has no text rows
                return row_offset(self.graph, self.size, rows, 0)
        if block_scan_part(node) is not None:
            return self._block_scan(node)
        if buffered_operands(node) is not None:
            return self._buffered_mixing(node)
        if is_recurrent(node):
            return self._recurrent(node)
        if op_rule(node.target).role == "attention" and node.meta[TOKEN].role == "mixing":
            return self._attention(node)  # cross-attention (const K/V) is row-wise: copied
        args = {a: self.env[a] for a in node.all_input_nodes}
        if node.meta[TOKEN].role in ("token", "mixing"):
            for a in node.all_input_nodes:
                j = baked_table_axis(node, a, self.ctx)
                if j is not None and self._frames(node.meta[TOKEN]) > 1:
                    args[a] = frame_table_rows(self.graph, self.env, node, args[a], j, (
                        self.start, self.seq_len), self._rows(node.meta[TOKEN]), self.carry)
                elif j is not None:
                    offset = row_offset(self.graph, self.start, self._scale(node.meta[TOKEN]),
                                        0 if self.carry else node.meta[TOKEN].prefix)
                    args[a] = table_rows(self.graph, self.env, node, args[a], j, offset)
        return self.graph.node_copy(node, lambda a: args[a])

    def _per_chunk(self, info: TokenInfo) -> bool:
        """Whether a token value is computed chunk by chunk (else the tail needs it; a value
        ending with a text segment is whole only there)."""
        return info.role in ("token", "mixing") and info.axis is not None and not info.suffix \
            and rows_per_unit(split_size(info), self.ctx) is not None

    def _scale(self, info: TokenInfo) -> int:
        return rows_per_unit(split_size(info), self.ctx) or 1

    def _frames(self, info: TokenInfo) -> int:
        return token_frames(split_size(info), self.ctx)

    def _rows(self, info: TokenInfo) -> tuple[int, int, int]:
        return self._scale(info), info.prefix, self._frames(info)

    def _full_input(self, name: str) -> fx.Node:
        """The placeholder of user input ``name`` whole (kind ``full``): key validity."""
        if name not in self.full_inputs:
            index = next(i for i, p in enumerate(self.placeholders) if p.name == name)
            axis = self.ctx.seq_inputs[name][0]
            ph = self.graph.placeholder(f"full_{name}")
            ph.meta.update(self.placeholders[index].meta)
            ph.meta[CHUNK_INPUT] = ChunkInput("full", name, index, axis)
            self.full_inputs[name] = ph
        return self.full_inputs[name]

    def _whole_input(self, p: fx.Node) -> fx.Node:
        """User input ``p`` whole in the chunk step (a float bias reads its values)."""
        if p.name in self.ctx.seq_inputs:
            return self._full_input(p.name)
        if p not in self.env:
            index = self.placeholders.index(p)
            self.env[p] = self._input(p.name, ChunkInput("const", p.name, index), p)
        return self.env[p]

    def _kv_end(self) -> fx.Node:
        if self.kv_end is None:
            self.kv_end = self.graph.call_function(operator.add, (self.start, self.size))
            self.kv_end.meta[TOKEN] = TokenInfo("positional")
        return self.kv_end

    def _new(self, target: Any, args: tuple, layer: fx.Node,
             kwargs: dict[str, Any] | None = None) -> fx.Node:
        """A token node of ``layer``'s layer (and sub-layer: ``PART``)."""
        node = self.graph.call_function(target, args, kwargs or {})
        node.meta[TOKEN] = TokenInfo("token")
        node.meta[LAYER] = layer.meta.get(LAYER, "")
        if PART in layer.meta:
            node.meta[PART] = layer.meta[PART]
        return node
