"""Memory a layer of the chunk-step graph allocates, per token: live values and positional values.

Terms:
    live bytes: while a layer runs on a chunk, the token values it has computed and not yet
        consumed (a value is live from its node until its last user inside the layer; a
        value read after the layer stays live to the layer's end). The layer's peak is the
        largest sum over its nodes, per chunk token (the MLP's gate, up and product of a
        Llama block live together: three intermediates, not one).
    view: a node whose result shares its input's storage (``view``, ``transpose``,
        ``narrow``...; ``aliases`` in :mod:`tppc.ir.op_rules`): it allocates nothing.
    positional bytes: bytes per sequence token of the positional values (rope tables) the
        layer reads; the runtime evaluates them at the full length once per call and stage.
    attention workspace: a causal ``tppc::chunk_attention`` block of ``r`` query rows over
        ``k`` keys builds a boolean mask (1 byte per row and key) that SDPA turns into a
        mask of the query's type: ``(1 + element size)`` bytes per row and key, for at most
        ``tppc.ir.ops.MASK_ELEMENTS`` rows × keys per block. On a CPU device a causal chunk
        without a padding vector or a window builds no mask (the prefix and the diagonal
        block run unmasked / ``is_causal`` and merge by log-sum-exp): no workspace per key.
        A float attention bias (ALiBi) instead reads its rows: one value per batch row,
        head, query row and key.
    state bytes: the carried states of the layer's recurrent nodes (placeholders of kind
        ``state``, :mod:`tppc.passes.chunking.carried_state`): fixed bytes, like weights,
        not per token.

Example:
    >>> peak_live_bytes(pricer.nodes, info.nodes, pricer.shapes, seq_len)  # doctest: +SKIP
    12288
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import sympy
from torch import fx

from tppc.cost_models.node_shapes import C, L, P, Shapes, tensor_vals
from tppc.ir.op_rules import op_rule
from tppc.ir.records import CHUNK_INPUT, TOKEN, ChunkInput, TokenInfo

__all__ = ["attention_workspace", "peak_live_bytes", "positional_bytes", "state_bytes"]

def _per_token(node: fx.Node, shapes: Shapes, seq_len: int) -> int:
    """Bytes per chunk token of a token value (0 when it does not scale with the chunk).

    The growth per split token (the slope in ``c``): a constant text prefix (joint attention,
    ``(c + 512, 15360)`` in a Flux single-stream block) is not multiplied by the chunk size;
    that fixed part (at most ``prefix × width``, 16 MB for Flux) is not counted.
    """
    vals = tensor_vals(node.meta.get("val"))
    if not vals:
        return 0
    return _slope(sympy.Mul(*shapes.shape(node)) * vals[0].element_size(), seq_len)


@functools.lru_cache(maxsize=4096)
def _slope(size: sympy.Expr, seq_len: int) -> int:
    """``size(c = 1) - size(c = 0)`` at ``p = 0, L = seq_len`` (0 without ``c``); memoised:
    the blocks of a model repeat the same few shapes, and ``subs`` is most of pricing."""
    if C not in size.free_symbols:
        return 0
    at = {P: 0, L: seq_len}
    value = size.subs({C: 1, **at}) - size.subs({C: 0, **at})
    return int(sympy.ceiling(value)) if value.is_number else 0


def peak_live_bytes(nodes: Mapping[str, fx.Node], layer_nodes: Sequence[str],
                    shapes: Shapes, seq_len: int) -> int:
    """Largest sum of live token values inside a layer, per chunk token (module docstring)."""
    members = set(layer_nodes)
    order = {name: i for i, name in enumerate(layer_nodes)}
    end = len(layer_nodes)
    sizes: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for name in layer_nodes:
        node = nodes[name]
        token = node.meta.get(TOKEN)
        if node.op != "call_function" or op_rule(node.target).aliases or (
                isinstance(token, TokenInfo) and token.role != "token"):
            continue
        size = _per_token(node, shapes, seq_len)
        if not size:
            continue
        sizes[name] = size
        uses = [order[u.name] for u in node.users if u.name in members]
        outside = any(u.name not in members for u in node.users)
        last_use[name] = end if outside or not uses else max(uses)
    change = [0] * (end + 2)  # a sweep: each value is live from its node to its last use
    for name, size in sizes.items():
        change[order[name]] += size
        change[last_use[name] + 1] -= size
    peak = live = 0
    for delta in change[:end]:
        live += delta
        peak = max(peak, live)
    return peak


def positional_bytes(nodes: Mapping[str, fx.Node], layer_nodes: Sequence[str],
                     shapes: Shapes) -> int:
    """Bytes per sequence token of the positional values the layer's nodes read."""
    seen: dict[str, int] = {}
    for name in layer_nodes:
        for arg in nodes[name].all_input_nodes:
            spec = arg.meta.get(CHUNK_INPUT)
            if arg.op != "placeholder" or not isinstance(spec, ChunkInput) or (
                    spec.kind != "positional") or arg.name in seen:
                continue
            vals = tensor_vals(arg.meta.get("val"))
            if not vals:
                continue
            seen[arg.name] = _per_position(sympy.Mul(*shapes.shape(arg))
                                           * vals[0].element_size())
    return sum(seen.values())


def state_bytes(nodes: Mapping[str, fx.Node], layer_nodes: Sequence[str]) -> int:
    """Bytes of the carried states the layer's nodes read (each state buffer once)."""
    seen: dict[str, int] = {}
    for name in layer_nodes:
        for arg in nodes[name].all_input_nodes:
            spec = arg.meta.get(CHUNK_INPUT)
            if arg.op == "placeholder" and isinstance(spec, ChunkInput) \
                    and spec.kind == "state" and spec.dtype is not None:
                seen[arg.name] = math.prod(int(d) for d in spec.shape) \
                    * spec.dtype.itemsize
    return sum(seen.values())


@functools.lru_cache(maxsize=1024)
def _per_position(size: sympy.Expr) -> int:
    """``size`` at ``c = 1, p = 0, L = 1`` (0 when that is not a number); memoised.
    torch's ``FloorDiv`` of a fraction (``(c/4)//4`` in a grid specialised to a multiple of
    4) stays unevaluated: it is not a number either."""
    value = size.subs({C: 1, P: 0, L: 1})
    try:
        return int(sympy.ceiling(value)) if value.is_number else 0
    except TypeError:
        return 0


def attention_workspace(nodes: Mapping[str, fx.Node], layer_nodes: Sequence[str],
                        cpu: bool = False) -> int:
    """Bytes per (query row, key) of the layer's causal chunk-attention blocks (0: none);
    ``cpu``: only the calls that still build a mask there (a padding vector or a window)."""
    out = 0
    for name in layer_nodes:
        node = nodes[name]
        if node.op != "call_function" or getattr(node.target, "_opname", "") != "chunk_attention":
            continue
        causal = bool(node.args[4]) if len(node.args) > 4 else bool(node.kwargs.get("causal"))
        bias = _bias_bytes(node)
        if bias:  # a float bias' rows: one per batch row and head, every key
            out = max(out, bias)
            continue
        masked = any((node.args[i] if len(node.args) > i else node.kwargs.get(k)) is not None
                     for i, k in ((8, "key_valid"), (9, "window"), (12, "block")))
        vals = tensor_vals(node.args[0].meta.get("val")) if causal and (masked or not cpu) else ()
        if vals:
            out = max(out, 1 + vals[0].element_size())
    return out


def _bias_bytes(node: fx.Node) -> int:
    """Bytes per (query row, key) of the float bias rows a chunk attention reads (0: none)."""
    bias = node.args[7] if len(node.args) > 7 else node.kwargs.get("attn_mask")
    vals = tensor_vals(bias.meta.get("val")) if isinstance(bias, fx.Node) else ()
    if not vals or not vals[0].dtype.is_floating_point:
        return 0
    lead = [s for s in vals[0].shape[:-2]]
    if not all(isinstance(s, int) for s in lead):
        return 0
    return int(math.prod(lead)) * vals[0].element_size()
