"""Node-meta keys written by tppc passes and the frozen records stored under them.

Terms:
    sequence symbol: the sympy symbol of the dynamic sequence dimension in ``meta["val"]``.
    token axis: the axis of a value whose size is a non-constant function of that symbol.
    role: how a node relates to the token axis (see :data:`Role`).
    layer: one repeated block (``block``), or the code before (``prologue``) or after
        (``epilogue``) the blocks.

Annotations live only in ``node.meta`` under the keys below; passes never set attributes
on ``fx.Node`` objects. The records of chunk-step and stage graphs live in
:mod:`tppc.ir.chunk_records`, those of mesh cuts (shards, ring attention) in
:mod:`tppc.ir.mesh_records`; every key and record is importable from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import sympy

from tppc.ir.chunk_records import (
    CHUNK_INPUT,
    CHUNK_SIGNATURE,
    STAGE_INFO,
    ChunkInput,
    ChunkSignature,
    InputKind,
    KVBuffer,
    StageInfo,
    frame_blocks,
)
from tppc.ir.mesh_records import RING_FORM, SHARD, SHARD_SIZES, RingForm, ShardRole

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
        runs: ``(outer, inner)``, the constant axes merged into the token axis before and
            after the tokens (a batch and heads flattened with them, ``(b·L·h, d)``: ``(b,
            h)``); the axis holds ``outer`` runs of the tokens, each token ``inner`` rows.
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
    runs: tuple[int, int] = (1, 1)

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
