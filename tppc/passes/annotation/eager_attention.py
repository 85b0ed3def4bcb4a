"""Pass: fold hand-written attention into one attention node (recognised by what it computes).

Terms:
    score matrix: a value whose last two axes both grow with the sequence (queries × keys).
    eager region: ``q @ kᵀ`` (``matmul``, ``bmm``, or ``baddbmm`` with a bias) → scale
        (``mul``/``div`` by a number) → optional soft-cap (``cap · tanh(s / cap)``) → additive
        masks and biases (``add``; ``masked_fill`` or ``where`` with a very negative value; a
        floor ``max(s, finfo.min)``) → optional
        sinks (``cat`` of one logit per head along the keys, then the ``max`` shift) →
        ``softmax`` over the keys → casts, ``dropout`` at p = 0, the slice that drops the
        sinks → ``@ v``. Casts and views that only regroup the batch and head axes may sit
        anywhere on the way (Bloom's ``(b·h, q, k)`` scores viewed as ``(b, h, q, k)``).

:mod:`.eager_region` reads a region; this pass rewrites it. Each region becomes
``aten.scaled_dot_product_attention(q, k, v, mask, scale=…)`` (mask: the terms that only hide
keys as a boolean mask, the others summed into a float bias, in the softmax's batch layout),
or, with a soft-cap or sinks,
``tppc::softmax_attention`` (:mod:`tppc.ir.softmax_attention`) with the same arguments plus
``softcap`` and ``sinks``. Annotation then sees attention and classifies its mask as it does
SDPA's (causal, window, padding, bias), and ``chunk_attention`` gives it the same K/V buffers;
nothing is special-cased per model class. A softmax over a score matrix whose region has any
other op is refused by name, with the op and its source line.

Example:
    >>> gm = fold_eager_attention_pass(gm, ctx)           # LlamaForCausalLM, attn "eager"
    >>> [n.target for n in gm.graph.nodes if "attention" in str(n.target)]  # doctest: +SKIP
    [aten.scaled_dot_product_attention.default]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

import tppc.ir.softmax_attention  # noqa: F401  (registers torch.ops.tppc.softmax_attention)
from tppc.ir.context import CompileContext
from tppc.passes.annotation.eager_region import EagerRegion, read_eager_region, visible_keys
from tppc.passes.shapes import size_expr, tensor_val

__all__ = ["fold_eager_attention_pass"]

_aten = torch.ops.aten


def fold_eager_attention_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Replace every eager attention region by one attention node (see the module docstring).

    Raises:
        AnnotationError: a softmax over a score matrix whose region is not of that form.
    """
    for node in list(gm.graph.nodes):
        region = read_eager_region(node, ctx.seq_symbol)
        if region is not None:
            _rewrite(gm, region)
    gm.graph.lint()
    gm.recompile()
    return gm


# -- the rewrite ---------------------------------------------------------------------------------
def _rewrite(gm: fx.GraphModule, region: EagerRegion) -> None:
    graph = gm.graph
    out = region.output
    # the batch layout where the masks are added: batch first, as the padding rule reads
    # them (Bloom's and XGLM's (b·h) scores at the softmax would mix the batch with the heads)
    frame = max((list(tensor_val(x).shape[:-2]) for x in
                 [region.softmax.args[0], *(t[3] for t in region.terms)]), key=len)
    with graph.inserting_before(out):
        new = _Builder(graph, out)
        key = region.key
        if isinstance(key, tuple):
            key = new.call(_aten.transpose.int, (key[1], -2, -1))
        q, k, v = (new.in_frame(x, frame) for x in (region.query, key, region.value))
        mask = _mask(new, region, frame)
        if region.softcap is None and region.sinks is None:
            attn = new.call(_aten.scaled_dot_product_attention.default, (q, k, v, mask),
                            {"scale": region.scale})
        else:
            attn = new.call(torch.ops.tppc.softmax_attention.default,
                            (q, k, v, mask, 0.0, False, region.scale, False, region.softcap,
                             region.sinks))
        result = new.in_frame(attn, list(tensor_val(out).shape[:-2]))
    out.replace_all_uses_with(result)
    inputs = {a for n in region.nodes for a in n.all_input_nodes} - region.nodes
    for node in reversed(list(graph.nodes)):
        if node in region.nodes:
            for user in list(node.users):
                graph.erase_node(user)  # its _assert_tensor_metadata checks
            graph.erase_node(node)
    while inputs:  # what only the region read (the sinks' expand to the rows)
        node = inputs.pop()
        if node.op == "call_function" and not node.users and not node.is_impure():
            inputs.update(node.all_input_nodes)
            graph.erase_node(node)


def _mask(new: _Builder, region: EagerRegion, frame: list[Any]) -> fx.Node | None:
    """SDPA's mask for the region's additive terms: a boolean mask for the terms that only
    hide keys (``where(visible, 0, min)``, ``masked_fill(hidden, -inf)``), the sum of the
    others as a float bias (hidden keys set to ``-inf`` there).

    A query that sees no key then gives 0, as SDPA does, where eager averages every value
    of the sequence (future ones included): only such rows (padding) differ from eager.
    """
    visible: fx.Node | None = None
    bias: fx.Node | None = None
    for kind, term, factor, site in region.terms:
        shown = visible_keys(term) if kind == "add" and factor == 1 else None
        if kind == "hide":
            shown = new.call(_aten.logical_not.default, (term,))
        if kind == "show":  # where(shown, scores, min)
            shown = term
        if shown is not None:
            shown = new.in_frame(shown, frame, like=site)
            visible = shown if visible is None else \
                new.call(_aten.logical_and.default, (visible, shown))
            continue
        if factor != 1:
            term = new.call(_aten.mul.Tensor, (term, float(factor)))
        term = new.in_frame(term, frame, like=site)
        bias = term if bias is None else new.call(_aten.add.Tensor, (bias, term))
    if bias is None or visible is None:
        return bias if visible is None else visible
    return new.call(_aten.where.ScalarOther, (visible, bias, float("-inf")))


class _Builder:
    """New nodes with the meta of the region's output (module path, source) and a fake value."""

    def __init__(self, graph: fx.Graph, like: fx.Node) -> None:
        self.graph, self.like = graph, like
        self.mode = torch._guards.detect_fake_mode([tensor_val(like)])

    def call(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs or {})
        node.meta.update({k: v for k, v in self.like.meta.items() if k != "val"})
        fake = torch.utils._pytree.tree_map_only(fx.Node, lambda n: n.meta["val"],
                                                 (args, kwargs or {}))
        with self.mode:
            node.meta["val"] = target(*fake[0], **fake[1])
        return node

    def in_frame(self, node: fx.Node, frame: list[Any], like: fx.Node | None = None) -> fx.Node:
        """``node`` with its batch axes regrouped as ``frame`` (a term of the logits first
        expanded to the batch axes of ``like``, the scores it was added to); unchanged when
        it has as many axes as the frame."""
        val = tensor_val(node)
        if val.dim() == len(frame) + 2:
            return node
        if like is not None:
            batch = list(tensor_val(like).shape[:-2])
            node = self.call(_aten.expand.default, (node, [*batch, *self._tail(node)]))
        return self.call(_aten.reshape.default, (node, [*frame, *self._tail(node)]))

    def _tail(self, node: fx.Node) -> list[Any]:
        """The last two sizes of ``node``, a symbolic one read by ``sym_size``."""
        val = tensor_val(node)
        return [self.call(_aten.sym_size.int, (node, val.dim() - 2 + i))
                if size_expr(s).free_symbols else int(s) for i, s in enumerate(val.shape[-2:])]
