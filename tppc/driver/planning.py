"""The one planning path of ``tppc.plan``, ``tppc.compile`` and the distributed compile.

All three capture with :func:`tppc.frontend.front_end.capture_front_end` and plan each
sequence length with :func:`length_planner` under one :class:`CompileOptions`, so for the same
model, inputs and options they return the same :class:`~tppc.planner.Plan`.

Terms:
    unit: what a plan's lengths count: one position of the sequence axis the model's inputs
        carry. A token for a language model; a patch row of ``tokens_per_unit`` tokens for a
        diffusion transformer whose latent's height is the sequence axis; a block of ``k``
        tokens for a block capture (:mod:`tppc.frontend.block_capture`, ``Plan.blocks``).
        Layers are priced on tokens, chunks are cut on whole units, and the plan says its
        unit (:attr:`Plan.tokens_per_unit`, :attr:`Plan.unit`).
    planning front end: ``tppc.plan`` captures only two of a model's identical blocks
        (``plan_only``, see :mod:`tppc.frontend.front_end`); it prices the same layers, so
        its plan equals ``tppc.compile``'s, and a 70B model on the meta device plans in
        seconds without allocating its weights.
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
from tppc.driver.hybrid_planning import plan_groups_table, tensor_parallel_plan, wants_hybrid
from tppc.driver.mesh_planning import MeshPrices, capped, mesh_plan, wants_mesh
from tppc.driver.options import CompileOptions, chunk_bounds
from tppc.errors import PlanError, SpecError
from tppc.frontend.front_end import FrontEnd, capture_front_end
from tppc.ir.context import CompileContext
from tppc.planner import Plan, Workload
from tppc.planner.devices import sub_table
from tppc.planner.evaluate import plan_for
from tppc.planner.grid import default_granularity, plan_any_length
from tppc.planner.plan import unit_text

__all__ = ["Planner", "default_granularity", "example_plan", "length_planner", "plan",
           "price_plan", "tokens_per_unit"]

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
    tensor_parallel: int | tuple[int, ...] | None = None,
    time_limit: float = 10.0,
    seq_dims: Mapping[str, int | tuple[int, ...]] | None = None,
    verbose: bool = False,
    **options: Any,
) -> Plan:
    """Plan ``model`` on ``cluster``: chunk boundaries and the layer range of every device.

    The same plan as ``tppc.compile(model, args, kwargs, cluster=..., ...).plan`` (with a
    diffusion ``workload``: as its ``denoise_plan``), without emitting or running anything.

    Args:
        model: the model; parameters may live on the meta device.
        args: example inputs (moved to the meta device when the model is there).
        kwargs: example keyword inputs.
        cluster: a :class:`Cluster` or a string such as ``"8xh100-sxm"``.
        seq_len: sequence length to plan for, in units of the sequence axis (tokens for a
            language model, patch rows for a DiT; default: the example's).
        workload: multi-step diffusion, or (default) one pass: a causal prefill, or for a
            model with bidirectional attention one chunk (exact), the plan's kind
            ``"bidirectional_pass"``.
        granularity: chunk sizes are multiples of this many units, the last chunk may be
            shorter (default: :func:`tppc.planner.grid.default_granularity`; for a DiT one
            patch row).
        num_stages: number of stages (default: the planner chooses how many devices, and
            which, to use; see :mod:`tppc.planner.devices`).
        tensor_parallel: devices per stage (tensor parallelism), one int for every stage or
            a tuple per stage; default: the planner chooses by price among the degrees the
            model and the cluster's nodes allow (:mod:`tppc.planner.hybrid`); 1: none.
        time_limit: seconds for the solver; on expiry the best plan found so far is
            returned, its ``solver.status`` says ``"time_limit"``. Limits: at most
            :data:`tppc.cost_models.cluster.MAX_DEVICES` devices and
            :data:`tppc.planner.split.MAX_GRID_POINTS` grid points (``seq_len /
            granularity``); beyond them a named error says what to change.
        seq_dims: input name -> sequence axis, when not found automatically.
        verbose: print the time of each phase to stderr.
        **options: other :class:`CompileOptions` fields (``chunks`` fixes the split; for a
            diffusion transformer ``cfg_parallel``, ``ulysses``, ``ring`` and ``patches``
            fix those degrees, the planner choosing the rest by price, see
            :mod:`tppc.driver.mesh_planning`; ``memory_limit`` caps each device's memory).

    Returns:
        The :class:`Plan`; its lengths are in :attr:`Plan.unit`.

    Raises:
        SpecError: a bad option (before anything is captured).
        CaptureError, AnnotationError, PassError, PlanError: naming the problem.
    """
    opts = CompileOptions.from_kwargs(cluster=cluster, granularity=granularity,
                                      num_stages=num_stages, time_limit=time_limit,
                                      tensor_parallel=tensor_parallel, verbose=verbose,
                                      **options)
    front = capture_front_end(model, args, kwargs, seq_dims=seq_dims, plan_only=True)
    length = front.ctx.example_seq if seq_len is None else seq_len
    return length_planner(opts)(front, length, workload=workload)


def example_plan(front: FrontEnd, opts: CompileOptions, plan: Plan | None = None,
                 share: Callable[[Planner], Planner] | None = None
                 ) -> tuple[Plan, Planner | None]:
    """The plan of the example's length and the planner of the other lengths.

    Args:
        front: the captured model (never a planning front end).
        opts: the options.
        plan: a plan to use as is (the planner is then None: other lengths are refused).
        share: wraps the planner (the distributed compile: rank 0 plans, all ranks get it).

    Raises:
        SpecError: a given plan whose unit is not the model's.
        PlanError: a granularity larger than the example's length (before any planning).
    """
    if front.truncated is not None:
        raise SpecError(f"the front end of {front.ctx.model_name} holds only some of its "
                        f"blocks ({front.truncated[0]}); it can be priced, not emitted. "
                        "fix: capture with plan_only=False")
    if plan is not None:
        _check_unit(plan, front)
        return plan, None
    _check_granularity(front, opts.granularity)
    planner = length_planner(opts)
    if share is not None:
        planner = share(planner)
    return planner(front, front.ctx.example_seq), planner


def _check_granularity(front: FrontEnd, granularity: int | None) -> None:
    """Refuse a granularity larger than the example: it would run as one chunk, and the
    compile's check has no other length within the example's reach (its probe length would
    be the example plus the granularity, past what the model may accept)."""
    length = front.ctx.example_seq
    if granularity is None or granularity <= length:
        return
    unit = unit_text(tokens_per_unit(front.ctx, length), front.ctx.block_size is not None)
    raise PlanError(
        f"granularity={granularity} is larger than the example of {front.ctx.model_name}, "
        f"which has {length} {unit} along its sequence axis: chunks are multiples of "
        f"{granularity} {unit}, so the example cannot be split (nor checked at another "
        f"length). fix: pass granularity <= {length} (or granularity=None: automatic), or "
        f"an example of at least {granularity} {unit}")


def _check_unit(plan: Plan, front: FrontEnd) -> None:
    per = tokens_per_unit(front.ctx, plan.seq_len)
    if plan.tokens_per_unit not in (1, per):  # 1: written by hand (manual_plan) in units
        raise SpecError(
            f"the given plan counts {plan.unit}, {front.ctx.model_name}'s sequence axis has "
            f"{per} tokens per unit. fix: plan this model at this resolution (tppc.plan with "
            "the same inputs)")


def length_planner(opts: CompileOptions, rates: tuple[float, ...] | None = None) -> Planner:
    """The planner of every length: ``(front, length, workload=None) -> Plan``.

    ``length`` is in units of the sequence axis. A model with bidirectional attention is
    planned as one chunk unless the workload is diffusion (patches, for ``denoise``);
    ``opts.chunks`` fixes the split (the placement is still planned). ``rates``: seconds
    measured per second predicted on each device of the cluster (:meth:`CostTable.scaled`;
    refitted by :mod:`tppc.pipeline.rebalance`), None: as priced.
    """

    prices = MeshPrices()  # a DiT's meshes, priced once for every workload

    def plan_length(front: FrontEnd, length: int, workload: Workload | None = None) -> Plan:
        """The plan of ``length`` units; a diffusion ``workload`` plans patches."""
        t0 = time.perf_counter()
        costing: list[float] = []
        result = _plan_length(front, opts, length, workload, costing, rates, prices)
        if opts.verbose:
            whole = time.perf_counter() - t0
            print(f"[tppc plan] capture+annotate {front.seconds:.1f} s, costing+solving "
                  f"{whole:.2f} s (costing {sum(costing):.2f} s, solving "
                  f"{whole - sum(costing):.2f} s, time_limit {opts.time_limit} s, status "
                  f"{result.solver.status}; {length} {result.unit}, {result.num_stages} "
                  "stages)", file=sys.stderr)
        return result

    return plan_length


def tokens_per_unit(ctx: CompileContext, length: int) -> int:
    """Tokens in one unit of the sequence axis at ``length`` units: a DiT's patch columns.

    Linear token counts give it at every length (:meth:`CompileContext.tokens_per_unit`); a
    token count that is a whole multiple of the axis only at this length (``T = s**2``, a
    square whose width shares the height's symbol; latents are no longer captured so, but a
    model's own arithmetic may do it) gives ``T / length`` here, so a band of rows is priced
    at its tokens, never at its row count."""
    per = ctx.tokens_per_unit()
    if per != 1 or ctx.token_count is None or ctx.seq_symbol is None:
        return per
    tokens = ctx.token_count.subs(ctx.seq_symbol, length)
    if not tokens.is_Integer or int(tokens) <= length or int(tokens) % length:
        return 1
    return int(tokens) // length


def price_plan(front: FrontEnd, opts: CompileOptions, plan: Plan,
               rates: tuple[float, ...] | None = None) -> Plan:
    """``plan``'s placement and split simulated again on the cost table scaled by ``rates``
    (the prediction of a plan made before the rates changed)."""
    per = plan.tokens_per_unit
    if any(st.group_size > 1 for st in plan.stages):  # rows: the stages' groups
        table = plan_groups_table(front, opts, plan, rates)
        chosen = tuple(range(plan.num_stages))
    else:
        table = _table_at(front, opts, rates, [])(plan.seq_len * per)
        chosen = tuple(st.device_index for st in plan.stages)
    names = [name for st in plan.stages for name in st.layer_names]
    cuts = (0, *(st.layer_end for st in plan.stages))
    priced = plan_for(sub_table(table, chosen).with_layers(names), cuts,
                      tuple(b * per for b in plan.boundaries), plan.workload,
                      granularity=plan.granularity * per, ranged=False)
    stages = tuple(dataclasses.replace(st, device_index=old.device_index,
                                       device_indices=old.device_indices,
                                       tensor_parallel=old.tensor_parallel,
                                       cfg_parallel=old.cfg_parallel, ulysses=old.ulysses,
                                       ring=old.ring, intra_op=old.intra_op)
                   for st, old in zip(priced.stages, plan.stages, strict=True))
    return dataclasses.replace(priced, stages=stages, seq_len=plan.seq_len,
                               granularity=plan.granularity,
                               tokens_per_unit=plan.tokens_per_unit, blocks=plan.blocks,
                               boundaries=plan.boundaries, replicas=plan.replicas,
                               choice=plan.choice)


def _table_at(front: FrontEnd, opts: CompileOptions, rates: tuple[float, ...] | None,
              costing: list[float]) -> Callable[[int], CostTable]:
    """The cost table at a number of tokens (``costing`` receives the seconds of each)."""
    ctx = front.ctx

    def table_at(tokens: int) -> CostTable:
        t0 = time.perf_counter()
        table = build_cost_table(front.chunk, ctx.layers, opts.cluster, tokens,
                                 seq_symbol=ctx.seq_symbol, token_count=ctx.token_count,
                                 queue_depth=opts.queue_depth)
        costing.append(time.perf_counter() - t0)
        return capped(table if rates is None else table.scaled(rates),
                      opts.memory_limit_bytes)

    return table_at


def _plan_length(front: FrontEnd, opts: CompileOptions, length: int,
                 workload: Workload | None, costing: list[float],
                 rates: tuple[float, ...] | None = None,
                 prices: MeshPrices | None = None) -> Plan:
    """Price in tokens on a grid of whole units, return the plan in units (``costing``
    receives the seconds of each cost table built)."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise PlanError(f"seq_len={length!r} must be a positive number of units of the "
                        "sequence axis (tokens; patch rows for a DiT)")
    ctx = front.ctx
    table_at = _table_at(front, opts, rates, costing)
    bounds = None
    diffusion = workload is not None and workload.kind == "diffusion"
    objective = opts.objective if opts.objective != "latency" or workload is None \
        else workload.objective
    if not diffusion:  # one pass, named after the model's attention (planned alike)
        workload = Workload(kind="bidirectional_pass" if front.bidirectional
                            else "causal_prefill", objective=objective)
    if opts.chunks is not None:
        bounds = chunk_bounds(opts.chunks, length)
    elif front.bidirectional and not diffusion:
        bounds = (0, length)
    elif diffusion and opts.patches is not None:
        bounds = chunk_bounds(opts.patches, length)
    per = tokens_per_unit(ctx, length)
    stale = diffusion and workload.warmup_steps < workload.steps and opts.patches != 1
    tp = opts.tensor_parallel
    stages = opts.num_stages or (len(tp) if isinstance(tp, tuple) else None)
    mesh = wants_mesh(front, opts)  # a DiT: CFG x Ulysses x Ring x TP x PipeFusion
    hybrid = not mesh and wants_hybrid(front, opts) and not (
        front.bidirectional and opts.tensor_parallel is None)
    if not front.bidirectional and any(
            d not in (None, 1) for d in (opts.cfg_parallel, opts.ulysses, opts.ring)):
        raise PlanError(
            f"cfg_parallel={opts.cfg_parallel}, ulysses={opts.ulysses}, ring={opts.ring}: "
            f"{ctx.model_name} has causal attention; CFG and sequence parallelism are for "
            "bidirectional models (diffusion transformers). fix: leave them None, use "
            "tensor_parallel= and num_stages=")

    def search(tokens: int, g: int | None, cuts: tuple[int, ...] | None) -> Plan:
        def plan_length(at: Callable[[int], CostTable], k: int | None, seconds: float,
                        one_patch: bool = False) -> Plan:
            work = dataclasses.replace(workload, max_patches=1) if one_patch else workload
            return plan_any_length(at, tokens, granularity=g, num_stages=k,
                                   time_limit=seconds, workload=work, bounds=cuts)

        if mesh:
            return mesh_plan(front, opts, tokens, table_at, plan_length,
                             g or default_granularity(tokens), objective, rates,
                             workload.steps, prices, stale, patches_free=cuts is None)
        if not hybrid:
            return plan_length(table_at, stages, opts.time_limit)
        return tensor_parallel_plan(front, opts, tokens, table_at, plan_length,
                                    g or default_granularity(tokens), objective, rates)

    if per == 1:
        return search(length, opts.granularity, bounds)
    g = per * (opts.granularity or 1)
    plan = search(length * per, g, None if bounds is None else tuple(b * per for b in bounds))
    return dataclasses.replace(plan, seq_len=length, granularity=g // per, tokens_per_unit=per,
                               blocks=ctx.block_size is not None,
                               boundaries=tuple(b // per for b in plan.boundaries))
