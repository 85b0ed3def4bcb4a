"""Capture plus the annotation passes: the annotated graph every later stage starts from.

``tppc.plan``, ``tppc.compile`` and ``tppc.cost_report`` go through
:func:`tppc.frontend.front_end.capture_front_end`, which calls :func:`annotate` and then the
chunk-step rewrite; :func:`annotate_program` and :func:`program_of` are the same two steps for
callers that want the graphs without a front end (tests, benchmarks).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from tppc.errors import CaptureError, PassError, TppcError
from tppc.frontend.capture import capture
from tppc.ir.context import CompileContext
from tppc.ir.records import TOKEN
from tppc.passes.annotation.annotate_seq_dims import annotate_seq_dims_pass
from tppc.passes.annotation.eager_attention import fold_eager_attention_pass
from tppc.passes.annotation.group_layers import group_layers_pass
from tppc.passes.annotation.unit_repeats import unfold_unit_repeats_pass
from tppc.passes.chunking.chunk_attention import chunk_attention_pass
from tppc.passes.runner import run_passes
from tppc.passes.sharding.annotate_shards import annotate_shards

__all__ = ["ANALYSIS_PASSES", "annotate", "annotate_program", "program_of"]

ANALYSIS_PASSES = (fold_eager_attention_pass, unfold_unit_repeats_pass, annotate_seq_dims_pass,
                   group_layers_pass, annotate_shards)


def annotate(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    seq_dims: Mapping[str, int | tuple[int, ...]] | None = None,
) -> tuple[fx.GraphModule, CompileContext]:
    """Capture ``model`` and run the annotation passes (token axes, roles, layers, how each
    node shards under tensor parallelism).

    Returns:
        The annotated GraphModule and its context (``ctx.layers`` lists the layers).
    """
    gm, ctx = capture(model, args, kwargs, seq_dims=seq_dims)
    try:
        gm = run_passes(gm, ctx, ANALYSIS_PASSES)
    except TppcError as exc:
        if ctx.follower is None:
            raise
        name, axis, guard = ctx.follower
        raise CaptureError(
            f"input {name!r} axis {axis} of {ctx.model_name} is as long as the example's "
            f"{ctx.example_seq} sequence units (patch rows or tokens) and pins the length "
            f"({guard}); captured with it as a sequence input, the model cannot be run chunk "
            f"by chunk: {str(exc).splitlines()[0]} fix: build {name} inside the model from "
            f"the sequence input's size (torch.arange of the rows), or run this model "
            "eagerly") from exc
    return gm, ctx


def annotate_program(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    seq_dims: Mapping[str, int | tuple[int, ...]] | None = None,
) -> tuple[fx.GraphModule, CompileContext]:
    """:func:`annotate`, then the chunk-step rewrite: the program the cost model prices.

    Returns:
        The chunk-step GraphModule (as ``FrontEnd.chunk``) and its context.
    """
    gm, ctx = annotate(model, args, kwargs, seq_dims=seq_dims)
    return program_of(gm, ctx), ctx


def program_of(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """The chunk-step graph of an annotated graph (``chunk_attention_pass``).

    For a model with bidirectional attention that the emitter refuses, the annotated graph
    itself is returned with a warning saying why, so that the caller can still look at its
    layers (``tppc.plan`` and ``tppc.compile`` refuse such a model with the pass's error).
    """
    try:
        return run_passes(gm, ctx, [chunk_attention_pass])
    except PassError as exc:
        if not any(n.meta.get(TOKEN) is not None and n.meta[TOKEN].attention == "bidirectional"
                   for n in gm.graph.nodes):
            raise
        warnings.warn(f"pricing the annotated graph of {ctx.model_name}: the chunk-step "
                      f"emitter refuses it ({exc})", stacklevel=2)
        return gm
