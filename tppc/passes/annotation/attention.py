"""Tell causal from bidirectional attention.

Attention nodes are the ops whose role in :mod:`tppc.ir.op_rules` is ``attention``. Of
those, tppc chunks ``aten.scaled_dot_product_attention`` (what torch.export captures),
calls of ``torch.nn.functional.scaled_dot_product_attention`` and ``tppc::softmax_attention``
(hand-written attention with a soft-cap or sinks, folded by
:mod:`tppc.passes.annotation.eager_attention`); the fused kernels SDPA
decomposes to (flash, efficient, cuDNN) are refused when they attend over the split tokens
(their arguments and outputs differ). An SDPA node is causal
when ``is_causal=True``, bidirectional when it has neither a mask nor ``is_causal``, and
otherwise classified by evaluating its mask (a positional value) at small *probe lengths*,
never at the example length (so classifying costs the same for a 32k-token example as for
a 16-token one): a lower-triangular pattern at every probe is causal, an all-true one
bidirectional; a causal band is a sliding window, and a mask built from an integer input
(``attention_mask``) is a padding mask (see :mod:`tppc.passes.annotation.masks`); a float
mask that adds values to visible keys is a bias, evaluated per chunk
(:mod:`tppc.passes.chunking.bias_rows`). The probes are a short length and one longer than
every integer constant the mask's computation uses (a sliding window of ``w`` tokens shows
at lengths ``> w``), at most :data:`MAX_PROBE`.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.nn import functional as F

import tppc.ir.softmax_attention  # noqa: F401  (registers torch.ops.tppc.softmax_attention)
from tppc.errors import ActivationMaskError, AnnotationError
from tppc.ir.context import CompileContext
from tppc.ir.records import TOKEN, AttentionKind, MaskSpec
from tppc.passes.annotation.masks import mask_literals, mask_spec
from tppc.passes.shapes import ancestors, module_path, source_line, tensor_val

__all__ = ["CHUNKED_KERNELS", "MAX_PROBE", "chunked_kernel", "classify_attention",
           "probe_lengths"]

_aten = torch.ops.aten
MAX_PROBE = 8192
"""Longest probe length at which a mask is evaluated (its ``L × L`` pattern: 64 MiB)."""
_SHORT_PROBE = 7
CHUNKED_KERNELS = (_aten.scaled_dot_product_attention.default,
                   torch.ops.tppc.softmax_attention.default)
"""The captured attention ops ``chunk_attention`` rewrites into ``tppc::chunk_attention``."""


def chunked_kernel(node: fx.Node) -> bool:
    """Whether ``node`` calls one of :data:`CHUNKED_KERNELS`."""
    return node.op == "call_function" and node.target in CHUNKED_KERNELS


def classify_attention(node: fx.Node, gm: fx.GraphModule, ctx: CompileContext
                       ) -> tuple[AttentionKind, MaskSpec | None]:
    """The attention's kind and the structured mask (window, padding) tppc rebuilds per
    chunk, or None for plain causal or all-visible attention (see :mod:`.masks`).

    Raises:
        AnnotationError: a fused attention kernel.
        ActivationMaskError: a mask or float bias computed from activations.
    """
    if not chunked_kernel(node) and node.target is not F.scaled_dot_product_attention:
        raise AnnotationError(
            f"attention node {node.name!r} (op {node.target}, module "
            f"{module_path(node) or '<top level>'}) is a fused attention kernel over the split "
            "tokens; tppc chunks aten.scaled_dot_product_attention only. fix: capture without "
            "decompositions (torch.export keeps scaled_dot_product_attention) or call "
            "F.scaled_dot_product_attention")
    args = list(node.args) + [None] * 8
    mask = node.kwargs.get("attn_mask", args[3])
    is_causal = bool(node.kwargs.get("is_causal", args[5] or False))
    if is_causal:
        return "causal", None
    if mask is None:
        return "bidirectional", None
    info = mask.meta[TOKEN] if isinstance(mask, fx.Node) else None
    if info is None or not (info.role in ("positional", "const") or info.inputs):
        float_mask = getattr(tensor_val(mask), "dtype", torch.bool).is_floating_point
        construct = ("a float attention bias computed from activations" if float_mask
                     else "an attention mask computed from activations")
        where = module_path(node)
        raise ActivationMaskError(
            f"attention node {node.name!r} (module {where or '<top level>'}) has "
            f"{construct}: its attn_mask {getattr(mask, 'name', mask)!r} depends on hidden "
            "states, not only on positions, constants, parameters and integer inputs such as "
            f"attention_mask; it cannot be evaluated per chunk{_entry(node, mask)}. fix: build "
            "the mask or bias from positions, parameters and attention_mask only; a library "
            "model runs unsplit (eager or torch.compile)",
            node=node.name, module=where, mask=str(getattr(mask, "name", mask)),
            construct=construct)
    return mask_spec(node, mask, gm, ctx, probe_lengths(mask))


def _entry(attention: fx.Node, mask: object) -> str:
    """Where activations enter the mask: the first node computed for the mask alone (not for
    the attention's q, k, v) from a token value, as `` (the activations enter it at
    file:line)`` (Doge's dynamic mask: ``dt_proj`` of the values, a bias per key that a
    chunk would need for every earlier chunk's keys; tppc buffers only K and V)."""
    if not isinstance(mask, fx.Node):
        return ""
    shared = ancestors([a for a in attention.args[:3] if isinstance(a, fx.Node)])
    for n in attention.graph.nodes:
        info = n.meta.get(TOKEN)
        if n in shared or n not in ancestors([mask]) or n.op != "call_function":
            continue
        if info is not None and info.role in ("token", "mixing") and info.axis is not None:
            return f" (the activations enter it at {source_line(n)})"
    return ""


def probe_lengths(mask: fx.Node) -> tuple[int, ...]:
    """Sequence lengths at which to evaluate ``mask``: a short one and one beyond every
    integer constant of its computation (capped at :data:`MAX_PROBE`)."""
    long = min(MAX_PROBE, max([2 * _SHORT_PROBE + 1, *(v + 2 for v in mask_literals(mask))]))
    return (_SHORT_PROBE, long)

