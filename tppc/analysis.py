"""Capture plus the annotation passes: the annotated graph every later stage starts from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from tppc.capture import capture
from tppc.context import CompileContext
from tppc.passes.annotate_seq_dims import annotate_seq_dims_pass
from tppc.passes.group_layers import group_layers_pass
from tppc.passes.runner import run_passes

__all__ = ["ANALYSIS_PASSES", "annotate"]

ANALYSIS_PASSES = (annotate_seq_dims_pass, group_layers_pass)


def annotate(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    seq_dims: Mapping[str, int | tuple[int, ...]] | None = None,
) -> tuple[fx.GraphModule, CompileContext]:
    """Capture ``model`` and run the annotation passes (token axes, roles, layers).

    Returns:
        The annotated GraphModule and its context (``ctx.layers`` lists the layers).
    """
    gm, ctx = capture(model, args, kwargs, seq_dims=seq_dims)
    gm = run_passes(gm, ctx, ANALYSIS_PASSES)
    return gm, ctx
