"""``tppc.plan``: capture, annotate, price and plan a model without running it.

Works on a model built on the meta device (no weights allocated), so a user can plan a
70B model for a cluster they do not have. A model whose blocks are all the same computation
is captured with two of them and the layer list re-expanded (see :mod:`tppc.frontend.blocks`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.layer_costs import build_cost_table
from tppc.cost_models.table import CostTable
from tppc.driver.options import CompileOptions, check_seconds, chunk_bounds
from tppc.errors import PlanError
from tppc.frontend.annotate import annotate, program_of
from tppc.frontend.blocks import expand_layers, few_blocks
from tppc.frontend.front_end import FrontEnd
from tppc.planner import Plan, Workload
from tppc.planner.grid import default_granularity, plan_any_length

__all__ = ["Planner", "default_granularity", "length_planner", "plan"]

#: ``planner(front, length, workload=None) -> Plan``: the plan of one sequence length.
Planner = Callable[..., Plan]


def plan(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    cluster: Cluster | str = "2xcpu",
    seq_len: int | None = None,
    workload: Workload | None = None,
    granularity: int | None = None,
    num_stages: int | None = None,
    time_limit: float = 10.0,
    seq_dims: Mapping[str, int | tuple[int, ...]] | None = None,
    verbose: bool = False,
) -> Plan:
    """Plan ``model`` on ``cluster``: chunk boundaries and the layer range of every device.

    Args:
        model: the model; parameters may live on the meta device.
        args: example inputs (moved to the meta device when the model is there).
        kwargs: example keyword inputs.
        cluster: a :class:`Cluster` or a string such as ``"8xh100-sxm"``.
        seq_len: sequence length to plan for, in tokens (default: the example's).
        workload: causal prefill (default) or multi-step diffusion.
        granularity: chunk sizes are multiples of this, the last chunk may be shorter
            (default: :func:`tppc.planner.grid.default_granularity`; for a DiT one patch
            row of tokens).
        num_stages: number of stages (default: the planner chooses how many devices, and
            which, to use; see :mod:`tppc.planner.devices`).
        time_limit: seconds for pricing and solving together (capture excluded); on expiry
            the best plan found so far is returned, its ``solver.status`` says
            ``"time_limit"``. Limits: at most :data:`tppc.cost_models.cluster.MAX_DEVICES`
            devices and :data:`tppc.planner.split.MAX_GRID_POINTS` grid points
            (``seq_len / granularity``); beyond them a named error says what to change.
        seq_dims: input name -> sequence axis, when not found automatically.
        verbose: print the time of each phase to stderr.

    Returns:
        The :class:`Plan`.
    """
    check_seconds("time_limit", time_limit)
    t0 = time.perf_counter()
    if _on_meta(model):
        args, kwargs = _to_meta((tuple(args), dict(kwargs or {})))
    with few_blocks(model) as truncated:
        gm, ctx = annotate(model, args, kwargs, seq_dims=seq_dims)
    if truncated is not None:
        layers = expand_layers(ctx.layers, *truncated)
        if sum(layer.kind == "block" for layer in layers) == truncated[1]:
            ctx.layers = layers
        else:  # the blocks group_layers found are not the list we shortened: capture it all
            gm, ctx = annotate(model, args, kwargs, seq_dims=seq_dims)
    program = program_of(gm, ctx)  # the chunk-step graph: what runs, and what is priced
    t1 = time.perf_counter()
    if seq_len is None:
        if ctx.token_count is None:
            raise PlanError(f"{ctx.model_name} has no attention node; nothing to pipeline")
        seq_len = int(ctx.token_count.subs(ctx.seq_symbol, ctx.example_seq))
    if granularity is None and ctx.tokens_per_unit() > 1:
        granularity = ctx.tokens_per_unit()  # a DiT: chunks of whole patch rows

    def table_at(tokens: int) -> CostTable:
        return build_cost_table(program, ctx.layers, cluster, tokens, seq_symbol=ctx.seq_symbol,
                                token_count=ctx.token_count)

    left = max(0.1, time_limit - (time.perf_counter() - t1))  # costing counts, capture not
    result = plan_any_length(table_at, seq_len, granularity=granularity,
                             num_stages=num_stages, time_limit=left, workload=workload)
    if verbose:
        print(f"[tppc plan] capture+annotate {t1 - t0:.1f} s, costing+solving "
              f"{time.perf_counter() - t1:.2f} s", file=sys.stderr)
    return result


def _on_meta(model: torch.nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def _to_meta(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, tree)


def length_planner(opts: CompileOptions) -> Planner:
    """The planner ``tppc.compile`` re-plans each new length with: ``(front, length, workload)``."""

    def plan_length(front: FrontEnd, length: int, workload: Workload | None = None) -> Plan:
        """The plan of ``length``; a diffusion ``workload`` plans patches (``denoise``)."""

        def table_at(tokens: int) -> Any:
            return build_cost_table(front.chunk, front.ctx.layers, opts.cluster, tokens,
                                    seq_symbol=front.ctx.seq_symbol,
                                    token_count=front.ctx.token_count,
                                    queue_depth=opts.queue_depth)

        bounds = None
        diffusion = workload is not None and workload.kind == "diffusion"
        if opts.chunks is not None:
            bounds = chunk_bounds(opts.chunks, length)
        elif front.bidirectional and not diffusion:
            bounds = (0, length)
        per = front.ctx.tokens_per_unit()
        if per > 1:  # a DiT: priced in tokens on a grid of whole patch rows, returned in rows
            g = per * (opts.granularity or 1)
            plan = plan_any_length(table_at, length * per, granularity=g,
                                   num_stages=opts.num_stages, time_limit=opts.time_limit,
                                   workload=workload,
                                   bounds=None if bounds is None else tuple(b * per
                                                                           for b in bounds))
            return dataclasses.replace(plan, seq_len=length, granularity=g // per,
                                       boundaries=tuple(b // per for b in plan.boundaries))
        return plan_any_length(table_at, length, granularity=opts.granularity,
                               num_stages=opts.num_stages, time_limit=opts.time_limit,
                               workload=workload, bounds=bounds)

    return plan_length
