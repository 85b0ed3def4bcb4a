"""Attention masks over the keys that read the values of context inputs (a prompt's padding).

Terms:
    context input: a user input that is not a sequence input (``ctx.seq_inputs``): the
        prompt's embeddings, its ``encoder_attention_mask``, the timestep.
    key mask: the ``attn_mask`` of an attention over the split tokens that is one row over
        the keys, broadcast along the queries (its query axis has size 1), and reads the
        *values* of context inputs. HunyuanVideo hides the padded text tokens of its joint
        sequence ``[image | text]`` with a mask built from ``encoder_attention_mask.sum()``.

Annotation cannot classify such a mask at probe lengths: its pattern depends on values that
the example fixes (a prompt mask of ones makes it all-visible, and dropping it then would
be wrong for every padded prompt). A key mask costs one row of ``L`` keys, so the chunk step
evaluates it whole from the inputs and positions (:meth:`BiasRows.whole`) and attention
applies it as it is (``MaskSpec.key_mask``): exact for any input values and any chunking,
since a chunk's queries read every key of the buffer, in the model's order. A mask that
reads context inputs by value and varies along the queries, or that also reads a sequence
input by value, is refused by name (:class:`AnnotationError`), unless every input it reads is
a joint input (``CompileContext.joint_inputs``, :mod:`tppc.frontend.joint_inputs`): Chroma's
``m[:, None, None, :] * m[:, None, :, None]`` over its ``[text | image]`` mask, a float 0/1
that SDPA adds to the scores as it is. Such a mask (``MaskSpec.query_rows``) is evaluated
by its rows for the chunk's queries, ``O(chunk · L)``, and applied as it is.

Example:
    >>> key_mask_spec(sdpa, mask, ctx)        # mask reads encoder_attention_mask  # doctest: +SKIP
    ('bidirectional', MaskSpec(key_mask=True))
"""

from __future__ import annotations

from torch import fx

from tppc.errors import AnnotationError
from tppc.ir.context import CompileContext
from tppc.ir.records import AttentionKind, MaskSpec
from tppc.passes.shapes import SHAPE_USES, module_path, size_expr, tensor_val

__all__ = ["inputs_by_value", "key_mask_spec"]


def inputs_by_value(mask: fx.Node, ctx: CompileContext
                    ) -> tuple[list[fx.Node], list[fx.Node]]:
    """The context inputs and the sequence inputs whose values ``mask`` reads (not only their
    sizes, even through an activation's: ``h.shape[1]``), each in graph order."""
    seen: set[fx.Node] = set()
    todo = [mask]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            if n.target not in SHAPE_USES:
                todo.extend(n.all_input_nodes)
    read = [p for p in mask.graph.find_nodes(op="placeholder") if p in seen]
    return ([p for p in read if p.name not in ctx.seq_inputs],
            [p for p in read if p.name in ctx.seq_inputs])


def key_mask_spec(node: fx.Node, mask: fx.Node, ctx: CompileContext
                  ) -> tuple[AttentionKind, MaskSpec] | None:
    """The kind and spec of attention ``node`` when its ``mask`` reads the values of context
    inputs: a key mask (module docstring); None when it reads none.

    Raises:
        AnnotationError: the mask varies along the queries, or also reads a sequence input.
    """
    context, sequence = inputs_by_value(mask, ctx)
    if not context:
        return None
    names = [p.name for p in context]
    val = tensor_val(mask)
    if sequence:
        _refuse(node, names, f"it also reads the values of sequence input "
                f"{sequence[0].name!r}")
    joint = [p.name for p in context if p.name in ctx.joint_inputs]
    if val is not None and val.dim() >= 2 and size_expr(val.shape[-2]) != 1 \
            and len(joint) == len(names):  # over [text | tokens]: its rows per chunk
        return "bidirectional", MaskSpec(key_mask=True, query_rows=True)
    if val is None or (val.dim() >= 2 and size_expr(val.shape[-2]) != 1):
        shape = None if val is None else tuple(val.shape)
        _refuse(node, names, f"it varies along the query axis (shape {shape}); tppc "
                "evaluates such a mask whole only when it is one row over the keys, "
                "broadcast along the queries")
    return "bidirectional", MaskSpec(key_mask=True)


def _refuse(node: fx.Node, names: list[str], why: str) -> None:
    raise AnnotationError(
        f"attention node {node.name!r} (module {module_path(node) or '<top level>'}) has a "
        f"mask that reads the values of input(s) {names}, which are not sequence inputs, so "
        f"its pattern depends on their values, not only on positions: {why}. fix: build "
        "the mask as one row over the keys (shape (batch, 1, 1, keys)), or pass the padding "
        "as a sequence input (attention_mask over the tokens)")
