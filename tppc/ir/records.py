"""Node-meta keys written by tppc passes and the frozen records stored under them.

Terms:
    sequence symbol: the sympy symbol of the dynamic sequence dimension in ``meta["val"]``.
    token axis: the axis of a value whose size is a non-constant function of that symbol.
    role: how a node relates to the token axis (see :data:`Role`).
    layer: one repeated block (``block``), or the code before (``prologue``) or after
        (``epilogue``) the blocks.

Annotations live only in ``node.meta`` under the keys below; passes never set attributes
on ``fx.Node`` objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import sympy
import torch

__all__ = [
    "CHUNK_INPUT",
    "CHUNK_SIGNATURE",
    "LAYER",
    "PART",
    "RING_FORM",
    "SHARD",
    "SHARD_SIZES",
    "STAGE_INFO",
    "TOKEN",
    "AttentionKind",
    "ChunkInput",
    "ChunkSignature",
    "InputKind",
    "KVBuffer",
    "LayerInfo",
    "LayerKind",
    "MaskSpec",
    "RingForm",
    "Role",
    "ShardRole",
    "StageInfo",
    "TokenInfo",
    "frame_blocks",
    "layer_of",
]

TOKEN = "tppc.token"
"""Key of a :class:`TokenInfo`: the node's role and the token axis of its value."""

LAYER = "tppc.layer"
"""Key of the layer name (``str``) that a node belongs to, written by ``group_layers``."""

Role = Literal["const", "positional", "token", "mixing", "global"]
"""const: no token dependence (weights, timestep/class conditioning);
positional: depends on positions only (arange, position ids, rope tables, masks);
token: row-wise along the token axis (linear, norm, activation, residual add);
mixing: attention over the token axis;
global: needs the whole sequence (pooling, a reshape that breaks the token order, loss)."""

AttentionKind = Literal["causal", "bidirectional", "recurrent"]


@dataclass(frozen=True)
class MaskSpec:
    """An attention mask that tppc rebuilds per chunk from O(L) data, never ``L × L``.

    Query ``i`` sees key ``j`` when the attention's kind allows it (causal: ``j ≤ i``), and
    ``i - j < window`` (when set), and ``i // block == j // block`` (when set), and
    ``key_valid[b, j] != 0`` (when set). A float mask
    that also adds values other than 0 to the scores of visible keys (ALiBi, relative
    position biases) is a *bias*: the chunk step evaluates its rows for the chunk's queries
    (:mod:`tppc.passes.chunking.bias_rows`) instead of rebuilding the pattern.

    Attributes:
        window: a causal sliding window of this many keys (the query's own included).
        block: causal chunked attention: each query sees the keys of its own block of this
            many positions (Llama 4's ``attention_chunk_size``).
        key_valid: name of the user input (``attention_mask``) whose nonzero entries mark
            the keys every query may see (padding masks).
        bias: the mask is an additive float bias (see above).
        key_mask: the mask is one row over the keys, broadcast along the queries, that reads
            the *values* of inputs other than the sequence inputs (a text padding mask over
            joint keys: HunyuanVideo's ``encoder_attention_mask``); the chunk step evaluates
            it whole (``O(L)``) and attention applies it as it is
            (:mod:`tppc.passes.annotation.key_masks`).
        query_rows: with ``key_mask``, the mask also varies along the queries of a joint
            ``[text | tokens]`` sequence and reads only joint inputs
            (``CompileContext.joint_inputs``: Chroma's ``m[:, None, None, :] * m[:, None, :,
            None]``); the chunk step evaluates its rows for the chunk's queries
            (``O(chunk · L)``, :meth:`tppc.passes.chunking.bias_rows.BiasRows.joint_rows`).
    """

    window: int | None = None
    key_valid: str | None = None
    bias: bool = False
    key_mask: bool = False
    block: int | None = None
    query_rows: bool = False
LayerKind = Literal["prologue", "block", "epilogue"]


@dataclass(frozen=True)
class TokenInfo:
    """Role of a node and the token axis of its value.

    Attributes:
        role: one of :data:`Role`.
        axis: the token axis of the node's (first) tensor value, or None.
        axis_size: that axis' size as a sympy expression of the sequence symbol, or None.
        other_axes: further axes whose size depends on the sequence (a mask's key axis).
        attention: for ``mixing`` nodes, whether the attention is causal or bidirectional,
            or ``recurrent``: a scan or causal convolution whose chunk reads the state the
            chunk before it left (:mod:`tppc.passes.annotation.recurrent`).
        module: the innermost module path of the node (``""`` at top level).
        mask: for ``mixing`` nodes, the structured mask (window, padding) that replaces the
            model's mask in the chunk step; None: plain causal or all-visible.
        inputs: a ``positional`` value that also depends on the *values* of integer
            sequence inputs (a padding mask built from ``attention_mask``); it cannot be
            evaluated from the sequence length alone.
        prefix: length of the constant, unsplit segment at the start of the token axis: the
            text tokens of a joint-attention MM-DiT concatenated before the image tokens
            (``cat([text, image], dim=axis)``, Flux). The split tokens are
            ``axis_size - prefix - suffix`` positions from ``prefix`` on. A value with
            ``axis_size == prefix`` is a context segment alone (text tokens, from either side;
            carried with the first patch of a step, never split).
        suffix: length of the constant, unsplit segment at the end of the token axis: text
            tokens concatenated after the image tokens (``cat([image, text])``, SD3).
        why: for some ``global`` values, what makes them need the whole sequence (quoted by
            the refusal).
    """

    role: Role
    axis: int | None = None
    axis_size: sympy.Expr | None = None
    other_axes: tuple[int, ...] = ()
    attention: AttentionKind | None = None
    module: str = ""
    prefix: int = 0
    mask: MaskSpec | None = None
    inputs: bool = False
    suffix: int = 0
    why: str = ""

    @property
    def prefix_only(self) -> bool:
        """Whether the value is a context segment alone (no split tokens; its whole length is
        recorded as ``prefix``, whichever side of the image tokens it was cut from)."""
        return self.prefix > 0 and self.axis_size is not None and not self.axis_size.free_symbols


@dataclass(frozen=True)
class LayerInfo:
    """One pipeline-able layer of the graph, as found by ``group_layers``.

    Attributes:
        index: position in execution order (prologue is 0 when present).
        name: module path of the block (``"model.layers.3"``), or ``"prologue"``/``"epilogue"``.
        kind: prologue, block or epilogue.
        nodes: names of the graph nodes in the layer, in graph order.
        params: fully qualified names of the parameters and buffers the layer reads.
        param_count: number of parameter elements (buffers excluded).
        param_bytes: bytes of parameters and buffers.
        attention_nodes: names of the ``mixing`` nodes in the layer.
        attention_kinds: the kind of each attention node, in the same order.
        inputs: names of the token values produced before the layer and used in it.
        outputs: names of the token values produced in the layer and used after it.
        through: names of the token values produced before the layer and used after it
            (long skip connections, block i -> block N-i): a stage boundary inside or
            after this layer must forward them.
        parts: a block's two sub-layers (``<name>.attn``, ``<name>.mlp``), split at its
            waist (:mod:`tppc.passes.annotation.waist`), where a stage boundary may also fall; empty
            when the block has no waist. A plan that cuts the block names its parts as
            layers.
    """

    index: int
    name: str
    kind: LayerKind
    nodes: tuple[str, ...]
    params: tuple[str, ...]
    param_count: int
    param_bytes: int
    attention_nodes: tuple[str, ...]
    attention_kinds: tuple[AttentionKind, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    through: tuple[str, ...] = ()
    parts: tuple[LayerInfo, ...] = ()


PART = "tppc.part"
"""Node-meta key: the sub-layer suffix (``"attn"``/``"mlp"``) of a node of a block that has
parts; its sub-layer is ``f"{meta[LAYER]}.{meta[PART]}"`` (see :func:`layer_of`)."""


def layer_of(meta: dict, split: set[str] | frozenset[str] = frozenset()) -> str:
    """The layer a node runs in: its sub-layer when its block is in ``split``, else its
    layer (``meta[LAYER]``)."""
    layer = meta.get(LAYER, "")
    part = meta.get(PART)
    return f"{layer}.{part}" if part and layer in split else layer


CHUNK_INPUT = "tppc.chunk_input"
"""Placeholder-meta key of a :class:`ChunkInput`."""

CHUNK_SIGNATURE = "tppc.chunk_signature"
"""``GraphModule.meta`` key of the :class:`ChunkSignature` of a chunk-step graph."""

InputKind = Literal["token", "const", "chunk_start", "chunk_size", "seq_len", "positional",
                    "key", "value", "state", "boundary", "full", "hoisted"]


@dataclass(frozen=True)
class ChunkInput:
    """What a placeholder of a chunk-step (or stage) graph receives.

    Attributes:
        kind: ``token`` (a chunk of a user input), ``const`` (a whole user input),
            ``chunk_start`` / ``chunk_size`` / ``seq_len`` (ints), ``positional`` (a slice of
            a frontier value), ``key`` / ``value`` (a K/V buffer), ``boundary`` (a token value
            sent by the previous stage; only in stage graphs), ``full`` (a user input with a
            sequence axis, whole: the key-validity mask of every position so far),
            ``hoisted`` (a const sub-graph's value, :mod:`tppc.passes.stages.hoist_consts`),
            ``state`` (the carried state of a recurrent node: ``shape`` fixed, no token axis).
        source: the user input's name, the frontier node's name, the attention node's name,
            or the boundary value's name.
        index: flat user-input index (token, const) or positional-program output index.
        axis: the token axis to slice (token, positional) or the buffer's token axis.
        shape: key/value buffers: the buffer shape with ``None`` at the token axis; a state
            buffer: its whole shape.
        dtype: key/value buffers: the element type.
        layer: key/value buffers: the layer that owns the buffer.
        scale: positions of the token axis per unit of the sequence symbol (a DiT's patch
            columns, a latent's patch size; 1 for LLM tokens), see
            :mod:`tppc.passes.chunking.token_rows`.
        prefix: the unsplit text segment before the split positions (joint attention).
        suffix: the unsplit text segment after the split positions (K/V buffers only: the
            first chunk of a step writes it after the last split row).
        frames: video frames folded into the token axis (frame-major tokens of a latent
            whose patch rows are the sequence symbol): a chunk of patch rows is then a band
            of rows in every frame, ``frames`` blocks of the axis (:meth:`blocks`).
        parts: key/value buffers of a Ring attention worker: it holds ``1/parts`` of the
            sequence's rows (its own K/V block, :mod:`tppc.passes.meshcut.ring_form`) beside
            the whole text segments.
    """

    kind: InputKind
    source: str = ""
    index: int | None = None
    axis: int | None = None
    shape: tuple[int | None, ...] = ()
    dtype: torch.dtype | None = None
    layer: str = ""
    scale: int = 1
    prefix: int = 0
    suffix: int = 0
    frames: int = 1
    parts: int = 1

    def rows(self, start: int, end: int) -> tuple[int, int]:
        """``(offset, count)`` of the chunk ``[start, end)`` along the token axis; the first
        chunk (``start == 0``) carries the prefix."""
        lo = 0 if start == 0 else self.prefix + self.scale * start
        return lo, self.prefix + self.scale * end - lo

    def blocks(self, start: int, end: int, length: int) -> list[tuple[int, int]]:
        """``(offset, count)`` of each contiguous block of the chunk ``[start, end)`` of a
        sequence of ``length`` units, in the chunk's own order (:func:`frame_blocks`)."""
        return frame_blocks(self.scale, self.prefix, self.frames, start, end, length)


def frame_blocks(scale: int, prefix: int, frames: int, start: int, end: int, length: int
                 ) -> list[tuple[int, int]]:
    """The contiguous blocks ``(offset, count)`` of the chunk ``[start, end)`` along a token
    axis of ``prefix + scale · length`` positions holding ``frames`` frames one after the
    other: the rows ``[start, end)`` of every frame (``scale / frames`` positions per unit and
    frame), the first block from 0 when ``start == 0`` (the chunk carries the prefix).

    >>> frame_blocks(8, 2, 2, 1, 3, 4)   # 2 frames of 4 rows of 4, text prefix of 2
    [(6, 8), (22, 8)]
    """
    if frames == 1:
        lo = 0 if start == 0 else prefix + scale * start
        return [(lo, prefix + scale * end - lo)]
    per = scale // frames
    out = [(prefix + per * (f * length + start), per * (end - start)) for f in range(frames)]
    if start == 0 and prefix:
        out[0] = (0, prefix + out[0][1])
    return out


SHARD = "tppc.shard"
"""Key of a node's :class:`ShardRole` (``annotate_shards``: how it runs under tensor
parallelism, for every degree the sizes in :data:`SHARD_SIZES` allow)."""

SHARD_SIZES = "tppc.shard_sizes"
"""``GraphModule.meta`` key: the sizes a tensor-parallel degree must divide (head counts,
the segments of sharded axes); a degree that divides all of them shards every
``column``/``row`` node of the graph."""


@dataclass(frozen=True)
class ShardRole:
    """How a node runs on ``t`` workers of a tensor-parallel group.

    Attributes:
        kind: ``replicated`` (every worker computes all of it), ``sharded`` (every worker
            computes its part: ``1/t`` of the work; its value is cut on ``axis``),
            ``column`` (a linear whose weight rows are cut: output sharded on its last axis),
            ``row`` (a linear whose weight columns are cut: its output is a partial sum,
            all-reduced right after it; a bias is added once, after the sum), ``gather``
            (a sharded value gathered whole on ``axis`` before a replicated use).
        axis: the cut axis of the node's value (``sharded``/``column``/``gather``).
        segments: that axis's segments (sizes); each is cut into ``t`` equal parts and
            worker ``r`` holds part ``r`` of every segment (a fused QKV: three).
        collective: the group's collective after the node: ``all_reduce`` (``row``),
            ``all_gather`` (``gather``), else ``""``.
    """

    kind: Literal["replicated", "sharded", "column", "row", "gather"]
    axis: int | None = None
    segments: tuple[int, ...] = ()
    collective: str = ""


RING_FORM = "tppc.ring_form"
"""Key of a self-attention's :class:`RingForm` in a worker graph cut by a ring
(:mod:`tppc.passes.meshcut.ring_form`)."""


@dataclass(frozen=True)
class RingForm:
    """How a worker runs an attention over a ring group.

    Attributes:
        form: ``ring`` (its own K/V block, the blocks passed around the group, partials
            merged by their log-sum-exps) or ``gather`` (the chunk's K/V gathered whole).
        reason: why the gather form (empty for ``ring``).
    """

    form: Literal["ring", "gather"]
    reason: str = ""


STAGE_INFO = "tppc.stage_info"
"""``GraphModule.meta`` key of the :class:`StageInfo` of a stage graph."""


@dataclass(frozen=True)
class StageInfo:
    """What a stage graph is.

    Attributes:
        index: stage number.
        layers: names of its layers.
        inputs: names of its boundary inputs (sent by the previous stage), in order.
        outputs: names of its boundary outputs (the last stage: ``()``; it returns the
            model's flat outputs).
        buffers: names of the K/V buffer placeholders it owns.
    """

    index: int
    layers: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    buffers: tuple[str, ...]


@dataclass(frozen=True)
class KVBuffer:
    """One K or V buffer: placeholder name and its :class:`ChunkInput`."""

    name: str
    spec: ChunkInput


@dataclass(frozen=True)
class ChunkSignature:
    """How to call a chunk-step graph and assemble its outputs.

    Attributes:
        user_inputs: names of the captured graph's flat user inputs, in order.
        in_spec: pytree spec of ``(args, kwargs)`` of the model's forward.
        out_spec: pytree spec of the model's outputs.
        output_axes: per flat output, the token axis along which chunks are concatenated
            (``None``: not a token value; the last chunk's value is returned).
        frontier: names of the positional program's outputs, in order.
        buffers: every K/V buffer, in graph order.
        attention: names of the attention nodes, in graph order.
        tail: True when a ``global`` epilogue (``gm.tppc_tail``) turns the full-length chunk
            outputs into the model's outputs; False when the chunk outputs are the model's.
        output_rows: per flat output, ``(scale, prefix, frames)`` of its token axis (see
            :mod:`tppc.passes.chunking.token_rows`, :func:`frame_blocks`), None where
            ``output_axes`` is None.
    """

    user_inputs: tuple[str, ...]
    in_spec: Any
    out_spec: Any
    output_axes: tuple[int | None, ...]
    frontier: tuple[str, ...]
    buffers: tuple[KVBuffer, ...]
    attention: tuple[str, ...]
    tail: bool = False
    output_rows: tuple[tuple[int, ...] | None, ...] = ()
