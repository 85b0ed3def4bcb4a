"""Joint plan: placement and token split together, from a :class:`CostTable`.

Objective (see :mod:`tppc.planner.placement`): for cuts ``P`` and a split ``C``,
``J(P, C) = warm-up(P) + K·Σ_i max_s t[s, i] + (S-1)·max_{s,i} (t[s, i] + link[s, i])``,
an upper bound on the flow-shop makespan that is exact for identical stages. The plan's
``latency`` is the simulated makespan of the chosen ``(P, C)`` (never above ``J`` for
prefill).

Methods:
    exhaustive: every contiguous placement (``C(N-1, S-1)`` of them), each with its exact
        split (TeraPipe's DP on ``m = max_s t_s``, ``f = max_s (t_s + link_s)``, chunks that
        overflow memory masked out). Exact; used when the placement count is small.
    alternate: start from the memory-feasible placement that balances full-sequence time,
        then alternate the exact split for the placement (MILP) and the best placement for
        the split (MILP), until ``J`` stops improving. Every round keeps the previous
        solution feasible, so ``J`` never increases; it is a local optimum. Measured gap to
        exhaustive search on small random instances: see ``BENCHMARKS.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Literal

import numpy as np

from tppc.cost_models.table import CostTable
from tppc.errors import PlanError
from tppc.planner._solver import available_solver
from tppc.planner.certify import search_split, split_bound
from tppc.planner.devices import choose_devices
from tppc.planner.dp import terapipe_dp
from tppc.planner.evaluate import diffusion_latency, plan_for
from tppc.planner.layer_partition import balanced_placement, infeasible_error
from tppc.planner.placement import place_layers
from tppc.planner.plan import Plan, say_expired
from tppc.planner.polish import NEAR_BOUND, NearBound, try_coarser_grids
from tppc.planner.provenance import SolverInfo, SplitSearch
from tppc.planner.refine import diffusion_candidates, improve_split, ring_makespan
from tppc.planner.split import check_grid, solve_split
from tppc.planner.split_matrices import (
    SplitContext,
    smallest_chunk,
    split_matrices,
    stage_matrix,
)
from tppc.planner.sublayers import cut_inside_blocks
from tppc.planner.workload import Workload

__all__ = ["plan_for", "plan_from_costs"]

PLACEMENT_STEP_LIMIT = 2.0
"""Seconds for one placement MILP of the alternation; on expiry its incumbent (never worse
than the current placement, which seeds it) is kept and the status says ``time_limit``."""

SEARCH_LIMIT = 1.0
"""Seconds for the certified split search of one placement at most (and at most a quarter
of the time the solve took before it); on expiry the best split found is kept and
:attr:`Plan.split` says ``"time_limit"`` with its gap."""

EXHAUSTIVE_LIMIT = 400
"""``method="auto"`` searches exhaustively up to this many placements (and ≤ 64 grid points)."""


def plan_from_costs(
    table: CostTable,
    *,
    workload: Workload | None = None,
    granularity: int = 128,
    num_stages: int | None = None,
    time_limit: float = 10.0,
    max_chunks: int | None = None,
    method: Literal["auto", "exhaustive", "alternate"] = "auto",
    max_rounds: int = 6,
    coarser_grids: int = 2,
    certify: bool = True,
    ranged: bool = True,
    near_bound: float | None = None,
) -> Plan:
    """Choose stage placement and chunk boundaries for a priced model.

    Args:
        table: per-device, per-layer prices (``table.seq_len`` is the sequence length).
        workload: causal prefill (default) or multi-step diffusion.
        granularity: chunk sizes are multiples of this many tokens.
        num_stages: stages on devices ``0..S-1`` of the chain; default: the planner chooses
            the devices too (:mod:`tppc.planner.devices`; a slow device may stay idle, and
            the plan's notes say why).
        time_limit: seconds for all solver calls together; on expiry the incumbent is kept
            and the plan's solver status says ``"time_limit"``.
        max_chunks: at most this many chunks per step.
        method: ``"exhaustive"``, ``"alternate"``, or ``"auto"`` (exhaustive when small).
        max_rounds: alternation rounds at most.
        coarser_grids: also plan on the grids ``2·g, 4·g, ...`` (this many) and keep the plan
            with the smallest simulated latency (:func:`~.polish.try_coarser_grids`).
        certify: run the certified split search (:mod:`tppc.planner.certify`) on the chosen
            placement; the coarser grids skip it (their splits are on the finer grid too).
        ranged: price the range bound in its plans (``plan_for``); coarser grids keep the finer one.
        near_bound: skip the phases that only improve a plan (local moves, certified
            search, cuts inside blocks, coarser grids) once the plan is within this ratio of
            a lower bound of every plan they can find (:class:`~.polish.NearBound`; default
            :data:`~.polish.NEAR_BOUND`, ``1.0`` runs them all).

    Returns:
        The plan, with its simulated schedule, lower bound and provenance.

    Raises:
        PlanError: empty cluster or model, bad granularity, more stages than layers/devices.
        PlanInfeasible: no placement fits in memory (names each device's need).
    """
    workload = workload or Workload()
    max_chunks = workload.patch_cap(max_chunks)  # a quality limit on diffusion patches
    t0 = time.perf_counter()
    near = NEAR_BOUND if near_bound is None else near_bound
    if num_stages is None and table.num_devices > 1 and table.num_layers > 0:
        def on(sub: CostTable, k: int, seconds: float) -> Plan:
            return plan_from_costs(sub, workload=workload, granularity=granularity,
                                   num_stages=k, time_limit=seconds, max_chunks=max_chunks,
                                   method=method, max_rounds=max_rounds,
                                   coarser_grids=coarser_grids, certify=certify, ranged=ranged,
                                   near_bound=near)

        check_grid(table.seq_len, granularity)
        return choose_devices(table, on, workload, granularity, time_limit)
    num_stages = _check(table, num_stages)
    n = check_grid(table.seq_len, granularity)
    placements = math.comb(table.num_layers - 1, num_stages - 1)
    if method == "auto":
        method = "exhaustive" if placements <= EXHAUSTIVE_LIMIT and n <= 64 else "alternate"
    ctx = SplitContext(table, workload, granularity, num_stages, max_chunks, t0 + time_limit,
                       ranged)
    stop = NearBound(table, num_stages, workload, granularity, near)
    if method == "exhaustive":
        cuts, bounds, info = _exhaustive(ctx)
    elif method == "alternate":
        cuts, bounds, info = _alternate(ctx, max_rounds)
    else:
        raise PlanError(f"method={method!r}; use 'auto', 'exhaustive' or 'alternate'")
    info = SolverInfo(**{**info.__dict__, "seconds": time.perf_counter() - t0})
    best = plan_for(table, cuts, tuple(b * granularity for b in bounds), workload,
                    granularity=granularity, solver=info,
                    ranged=ranged and time.perf_counter() < ctx.deadline)
    if workload.kind == "diffusion" and workload.pipelined_steps and num_stages > 1:
        solver = best.solver
        best = diffusion_candidates(
            best,
            lambda b: plan_for(table, cuts, b, workload, granularity=granularity, solver=solver),
            n, granularity, max_chunks, lambda b: diffusion_latency(table, cuts, b, workload))
    if workload.kind != "diffusion" and num_stages > 1 \
            and time.perf_counter() < ctx.deadline:  # improvements only within the limit
        for phase in (_improve, _in_block_cuts):  # and until near the bound
            best = stop.note(best) if stop.reached(best) else phase(
                ctx, cuts, bounds, best, t0, certify)
    def coarser(coarse: int, budget: float) -> Plan:
        return plan_from_costs(table, workload=workload, granularity=coarse,
                               num_stages=num_stages, time_limit=budget, max_chunks=max_chunks,
                               method=method, max_rounds=max_rounds, coarser_grids=0,
                               certify=False, ranged=False, near_bound=near)

    best = try_coarser_grids(best, table.seq_len, granularity, coarser_grids, t0, time_limit,
                             stop, coarser)
    return say_expired(best, ctx.deadline)


def _improve(ctx: SplitContext, cuts: tuple[int, ...], bounds: tuple[int, ...],
             best: Plan, t0: float, certify: bool) -> Plan:
    """TeraPipe's split improved on the simulated makespan: local moves
    (:func:`improve_split`), then the certified search (:mod:`tppc.planner.certify`)."""
    table, n, g = ctx.table, ctx.n, ctx.g
    m, _f, _warm = split_matrices(ctx, cuts)
    pairs = list(itertools.pairwise(cuts))
    stage = [np.where(np.isfinite(m), stage_matrix(ctx, s, lo, hi), np.inf)
             for s, (lo, hi) in enumerate(pairs)]
    sizes = np.maximum(np.arange(n + 1)[None, :] - np.arange(n + 1)[:, None], 0) * g
    links = [table.links[s].time(table.layers[s][hi - 1].act_bytes_per_token * sizes)
             for s, (_lo, hi) in enumerate(pairs[:-1])]

    def makespan(grid: tuple[int, ...]) -> float:
        a, b = np.array(grid[:-1]), np.array(grid[1:])
        if (ctx.max_chunks and a.size > ctx.max_chunks) or not np.isfinite(m[a, b]).all():
            return math.inf
        times = np.stack([t[a, b] for t in stage])
        sends = np.stack([lk[a, b] for lk in links]) if links else np.zeros((0, a.size))
        return ring_makespan(times, sends, np.zeros(a.size), 1)  # = simulate(...).makespan

    now = time.perf_counter()
    deadline = min(ctx.deadline, now + max(1.0, now - t0))
    new, value, moves = improve_split(tuple(bounds), makespan, deadline=deadline)
    detail = best.solver.detail
    if moves and value < best.latency * (1 - 1e-12):
        detail += (f"; then {moves} boundary moves on the simulated makespan "
                   f"({100 * (1 - value / best.latency):.2f}% faster than TeraPipe's split)")
    else:
        new, value = tuple(bounds), best.latency
    s0 = time.perf_counter()
    found = None
    if not certify:
        return best if new == tuple(bounds) else plan_for(
            table, cuts, tuple(b * g for b in new), ctx.workload, granularity=g,
            solver=dataclasses.replace(best.solver, detail=detail), ranged=ctx.ranged)
    if not ctx.max_chunks:  # the search does not count chunks
        budget = min(SEARCH_LIMIT, max(0.02, 0.25 * (s0 - t0)))  # a quarter of the solve so far
        found = search_split(stage, links, new, deadline=min(ctx.deadline, s0 + budget))
        if found.makespan < value * (1 - 1e-12):
            detail += (f"; certified search {100 * (1 - found.makespan / value):.2f}% faster "
                       "than the local moves")
            new, value = found.bounds, found.makespan
    status = "not run (max_chunks)" if found is None else found.status
    plan = best if new == tuple(bounds) else plan_for(
        table, cuts, tuple(b * g for b in new), ctx.workload, granularity=g,
        solver=dataclasses.replace(best.solver, detail=detail), ranged=ctx.ranged)
    # a proven optimum is this plan's latency; otherwise the relaxation's bound
    lower = (plan.latency if status == "optimal" else plan.lower_bound  # any plan's bound
             if time.perf_counter() > ctx.deadline else split_bound(stage, links, ctx.deadline))
    split = SplitSearch(
        method="exact DP over (position, stage completion times), dominance + bound pruning",
        status=status, bound=lower, gap=max(0.0, 1 - lower / plan.latency),
        seconds=time.perf_counter() - s0)
    return dataclasses.replace(plan, split=split)


def _in_block_cuts(ctx: SplitContext, cuts: tuple[int, ...], bounds: tuple[int, ...],
                   best: Plan, t0: float, certify: bool) -> Plan:
    """:func:`cut_inside_blocks` with this search's split (DP) and its improvement."""
    now = time.perf_counter()  # in-block cuts get at most as long as the search had
    stop = min(ctx.deadline, now + max(0.5, now - t0))
    g = ctx.g
    solver = best.solver

    def price(table: CostTable, cuts: tuple[int, ...]) -> Plan:
        m, f, _warm = split_matrices(ctx.for_table(table), cuts)
        sol = terapipe_dp(m, f, ctx.S, repeats=ctx.K, max_chunks=ctx.max_chunks,
                          deadline=stop)
        split = sol.bounds if math.isfinite(sol.objective) else bounds
        return plan_for(table, cuts, tuple(b * g for b in split), ctx.workload,
                        granularity=g, solver=solver, ranged=False)  # the bound: polish

    def polish(table: CostTable, cuts: tuple[int, ...], plan: Plan) -> Plan:
        plan = plan_for(table, cuts, plan.boundaries, ctx.workload, granularity=g, solver=solver,
                        ranged=ctx.ranged)
        return _improve(ctx.for_table(table), cuts, tuple(b // g for b in plan.boundaries),
                        plan, t0, certify)

    reference = price(ctx.table, cuts).latency if tuple(b * g for b in bounds) != \
        best.boundaries else best.latency
    return cut_inside_blocks(ctx.table, best, reference, price, polish,
                             out_of_time=lambda: time.perf_counter() > stop)


def _check(table: CostTable, num_stages: int | None) -> int:
    if table.num_devices == 0:
        raise PlanError("the cluster has no devices; give at least one (e.g. cluster='2xh100')")
    if table.num_layers == 0:
        raise PlanError("the cost table has no layers; the model must have at least one")
    if num_stages is None:
        return min(table.num_devices, table.num_layers)
    if num_stages < 1:
        raise PlanError(f"num_stages={num_stages} must be at least 1")
    if num_stages > table.num_layers:
        raise PlanError(
            f"num_stages={num_stages} exceeds the model's {table.num_layers} layers; "
            f"use num_stages <= {table.num_layers}"
        )
    if num_stages > table.num_devices:
        raise PlanError(
            f"num_stages={num_stages} exceeds the cluster's {table.num_devices} devices; "
            f"use num_stages <= {table.num_devices} or a larger cluster"
        )
    return num_stages


def _exhaustive(ctx: SplitContext) -> tuple[tuple[int, ...], tuple[int, ...], SolverInfo]:
    best: tuple[float, tuple[int, ...], tuple[int, ...]] = (math.inf, (), ())
    count, complete = 0, True
    for inner in itertools.combinations(range(1, ctx.table.num_layers), ctx.S - 1):
        cuts = (0, *inner, ctx.table.num_layers)
        m, f, warm = split_matrices(ctx, cuts)
        sol = terapipe_dp(
            m, f, ctx.S, repeats=ctx.K, max_chunks=ctx.max_chunks, upper_bound=best[0] - warm,
            deadline=ctx.deadline,
        )
        count += 1
        complete = complete and sol.complete
        if warm + sol.objective < best[0]:
            best = (warm + sol.objective, cuts, sol.bounds)
        if time.perf_counter() > ctx.deadline and best[1]:
            complete = False
            break
    if not best[1]:
        raise infeasible_error(ctx.table, ctx.S, smallest_chunk(ctx))
    info = SolverInfo(
        solver="exhaustive+terapipe-dp",
        status="optimal" if complete else "time_limit",
        objective=best[0],
        bound=best[0] if complete else -math.inf,
        gap=0.0 if complete else math.inf,
        seconds=0.0,
        detail=f"{count} of {math.comb(ctx.table.num_layers - 1, ctx.S - 1)} placements, "
        "exact split each",
    )
    return best[1], best[2], info


def _alternate(ctx: SplitContext, max_rounds: int
               ) -> tuple[tuple[int, ...], tuple[int, ...], SolverInfo]:
    table = ctx.table
    full = list(table.times_at(table.seq_len, 0.0, range(ctx.S)))
    cuts = balanced_placement(table, ctx.S, full, smallest_chunk(ctx))
    if cuts is None:
        raise infeasible_error(table, ctx.S, smallest_chunk(ctx))
    best = math.inf
    bounds: tuple[int, ...] = ()
    statuses, rounds = [], 0
    for rounds in range(1, max_rounds + 1):  # noqa: B007 - rounds is reported
        m, f, warm = split_matrices(ctx, cuts)
        new_bounds, obj, info = solve_split(  # the DP is exact and far faster than the MILP
            m, f, ctx.S, repeats=ctx.K, max_chunks=ctx.max_chunks, time_limit=ctx.left(),
            solver="dp",
        )
        statuses.append(info.status)
        if warm + obj < best * (1 - 1e-9):
            best, bounds = warm + obj, new_bounds
        if ctx.S == 1 or ctx.S == table.num_layers or time.perf_counter() >= ctx.deadline:
            break
        tokens = tuple(b * ctx.g for b in bounds)
        new_cuts, obj, info = place_layers(
            table, tokens, ctx.S, ctx.workload, start=cuts,
            time_limit=min(ctx.left(), PLACEMENT_STEP_LIMIT),
        )
        statuses.append(info.status)
        if obj >= best * (1 - 1e-9):
            break
        best, cuts = obj, new_cuts
    exact = ctx.S == 1 or ctx.S == table.num_layers
    status = "time_limit" if "time_limit" in statuses else ("optimal" if exact else "decomposed")
    placer = "local-search" if "heuristic" in statuses else available_solver()
    info = SolverInfo(
        solver=f"alternate(split: exact, placement: {placer})",
        status=status,
        objective=best,
        bound=best if exact else -math.inf,
        gap=0.0 if exact else math.inf,
        seconds=0.0,
        detail=f"{rounds} rounds",
    )
    return cuts, bounds, info
