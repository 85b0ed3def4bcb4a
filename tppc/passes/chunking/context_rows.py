"""Helpers of ``chunk_attention`` for context segments on either side of the split tokens.

A joint-attention value is ``[prefix | split rows | suffix]``
(:mod:`tppc.passes.annotation.segments`); its K/V buffer holds ``[prefix | scale · seq_len rows | suffix]``, the model's own order, so
that the whole-sequence chunk writes one contiguous block and attention reads the keys in
the order the model does. The first chunk of a step carries both segments: its rows before
the suffix go to ``[0, prefix + scale · chunk_end)``, its suffix to
``[prefix + scale · seq_len, … + suffix)``. Later chunks (the rest program) hold split rows
only. What cannot be lined up that way is refused by name (:func:`check_context`).
The chunk step's output node is made by :func:`tppc.passes.chunking.frame_rows.chunk_outputs`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from tppc.errors import PassError
from tppc.ir.records import TOKEN, TokenInfo

__all__ = ["check_context", "write_rows"]

_aten = torch.ops.aten

New = Callable[[Any, tuple], fx.Node]
"""Makes a node of the attention's layer: ``new(target, args)``."""


def write_rows(new: New, buf: fx.Node, axis: int, value: Any, offset: Any, size: Any,
               suffix: int, suffix_at: Any) -> None:
    """Write a chunk's K or V ``value`` (``size`` rows along ``axis``) into ``buf`` at
    ``offset``; when the value ends with a ``suffix`` segment (the first chunk of a step),
    its split rows go to ``offset`` and the suffix to ``suffix_at``."""
    if not suffix:
        new(_aten.copy_.default, (new(_aten.narrow.default, (buf, axis, offset, size)), value))
        return
    rows = new(operator.sub, (size, suffix))
    head = new(_aten.narrow.default, (value, axis, 0, rows))
    tail = new(_aten.narrow.default, (value, axis, rows, suffix))
    new(_aten.copy_.default, (new(_aten.narrow.default, (buf, axis, offset, rows)), head))
    new(_aten.copy_.default, (new(_aten.narrow.default, (buf, axis, suffix_at, suffix)), tail))


def check_context(node: fx.Node, what: str, suffix: int | None = None) -> None:
    """Refuse a context segment after the split tokens (``suffix``, default: ``node``'s own)
    where a chunk cannot carry it.

    ``what``: ``"attention"`` (causal attention over keys with a suffix: the text after the
    image would have to see image rows of later chunks) or ``"positional"`` (a position
    table: the first chunk's rows would not be contiguous). A model output that ends with text tokens is computed by
    the global tail from whole values (``chunk_attention``'s ``_per_chunk``).
    """
    info: TokenInfo = node.meta[TOKEN]
    suffix = info.suffix if suffix is None else suffix
    if not suffix:
        return
    if what == "attention" and info.attention != "causal":
        return
    reason = {
        "attention": "causal attention over text tokens after the split tokens: the text "
                     "queries see every later position, which a chunk has not computed yet",
        "positional": "a position table whose token axis ends with a text segment: the first "
                      "chunk's rows of it are not one contiguous band",
    }[what]
    raise PassError(
        f"node {node.name!r} (module {info.module or '<top level>'}) has {suffix} "
        f"context positions after its split tokens: {reason}. fix: put the context segment "
        "before the tokens (cat([text, image])), or cut it off before this node")
