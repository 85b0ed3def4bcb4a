"""Package a given placement and split as a :class:`Plan`: simulate it, price its memory and
bound it from below. Used by the search (``joint``) and to price baselines."""

from __future__ import annotations

import itertools

import numpy as np

from tppc.cost_models.table import CostTable
from tppc.errors import PlanError
from tppc.planner.bounds import placement_bound
from tppc.planner.memory import over_capacity, stage_memory
from tppc.planner.placement import stage_times
from tppc.planner.plan import Plan, StagePlan
from tppc.planner.provenance import SolverInfo
from tppc.planner.range_bound import range_bound
from tppc.planner.refine import ring_makespan
from tppc.planner.ring_bound import ring_bound
from tppc.planner.workload import Workload
from tppc.program.schedule import flow_shop, simulate

__all__ = ["diffusion_latency", "lower_bounds", "plan_for"]


def plan_for(
    table: CostTable,
    cuts: tuple[int, ...],
    boundaries: tuple[int, ...],
    workload: Workload | None = None,
    *,
    granularity: int = 1,
    solver: SolverInfo | None = None,
    ranged: bool = True,
) -> Plan:
    """Simulate a given placement and split and package it as a :class:`Plan`.

    Also used to price baselines (an even layer split, uniform chunks...).

    Args:
        table: the cost table.
        cuts: ``(0, e_0, ..., N)``; stage ``s`` runs layers ``[cuts[s], cuts[s+1])`` on
            device ``s``.
        boundaries: token offsets ``(0, ..., seq_len)`` of the chunks.
        workload: what one call computes (default causal prefill).
        granularity: recorded in the plan.
        solver: provenance (default: ``"given"``).
        ranged: include the range bound in the lower bound (:func:`lower_bounds`; a planner
            past its deadline leaves it out: seconds at 256 grid points).
    """
    workload = workload or Workload()
    num_stages = len(cuts) - 1
    if boundaries[0] != 0 or boundaries[-1] != table.seq_len:
        raise PlanError(f"boundaries {boundaries[:3]}... must run from 0 to {table.seq_len}")
    steps = workload.pipelined_steps
    if steps == 0:
        boundaries = (0, table.seq_len)  # every step is a synchronous warm-up step
    times, links, back, warmup = _priced(table, cuts, boundaries, workload)
    if steps:
        actions = flow_shop(tuple(itertools.pairwise(boundaries)), num_stages, steps)
        sched = simulate(times, links, steps=steps, back=back, actions=actions)
        start, end = sched.start + warmup, sched.end + warmup
        latency = warmup + sched.makespan
    else:
        start = end = np.zeros((num_stages, 0))
        latency = warmup
    work, path = lower_bounds(table, num_stages, workload, granularity, ranged=ranged)
    max_chunk = table.seq_len if workload.warmup_steps else max(np.diff(boundaries))
    stages = tuple(
        StagePlan(
            index=s,
            layer_start=lo,
            layer_end=hi,
            device_index=s,
            device_name=table.device_names[s],
            memory_bytes=stage_memory(table, s, lo, hi, int(max_chunk)),
            capacity_bytes=int(table.capacities[s]),
            layer_names=tuple(lc.name for lc in table.layers[s][lo:hi]),
        )
        for s, (lo, hi) in enumerate(itertools.pairwise(cuts))
    )
    lower = max(work, path)
    solver = solver or SolverInfo(
        solver="given", status="given", objective=latency, bound=lower, gap=0.0, seconds=0.0
    )
    if solver.status == "decomposed":  # state the gap against the plan's lower bound
        gap = max(0.0, (solver.objective - lower) / solver.objective)
        solver = SolverInfo(**{**solver.__dict__, "bound": lower, "gap": gap})
    notes = tuple(_over_note(stages, over, need, cap) for over, need, cap in over_capacity(
        table, [(st.device_index, st.memory_bytes) for st in stages]))
    return Plan(
        workload=workload,
        seq_len=table.seq_len,
        granularity=granularity,
        boundaries=tuple(int(b) for b in boundaries),
        stages=stages,
        start=tuple(tuple(map(float, r)) for r in start),
        end=tuple(tuple(map(float, r)) for r in end),
        latency=float(latency),
        warmup_seconds=warmup,
        lower_bound=lower,
        lower_bound_work=work,
        lower_bound_path=path,
        solver=solver,
        notes=notes,
    )


def _over_note(stages: tuple[StagePlan, ...], over: tuple[int, ...], need: float,
               cap: int) -> str:
    """The note of stages ``over`` that overfill one memory pool (one device, or the ``cpu``
    devices of one node)."""
    if len(over) == 1:
        st = stages[over[0]]
        return (f"stage {st.index} on {st.device_name} needs {need / 1e9:.2f} GB of "
                f"{cap / 1e9:.2f} GB")
    names = ", ".join(str(stages[i].index) for i in over)
    return (f"stages {names} on {stages[over[0]].device_name} (one memory pool: devices "
            f"{', '.join(str(stages[i].device_index) for i in over)}) need {need / 1e9:.2f} "
            f"GB together of {cap / 1e9:.2f} GB")


def _priced(table: CostTable, cuts: tuple[int, ...], boundaries: tuple[int, ...],
            workload: Workload) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, float]:
    """``(times, links, back or None, warm-up seconds)`` of a placement on a split."""
    num_stages = len(cuts) - 1
    times, links = stage_times(table, cuts, boundaries)
    full_t, full_l = stage_times(table, cuts, (0, table.seq_len))
    warmup = workload.warmup_steps * float(full_t.sum() + full_l.sum())
    back = None
    if workload.kind == "diffusion" and num_stages > 1:  # return link priced as the slowest
        act = table.layers[num_stages - 1][cuts[-1] - 1].act_bytes_per_token
        sizes = np.diff(np.asarray(boundaries, dtype=float))
        back = np.max([lk.time(act * sizes) for lk in table.links[: num_stages - 1]], axis=0)
    return times, links, back, warmup


def diffusion_latency(table: CostTable, cuts: tuple[int, ...], boundaries: tuple[int, ...],
                      workload: Workload) -> float:
    """``plan_for(table, cuts, boundaries, workload).latency`` of a diffusion workload with
    pipelined steps, by the flow shop's recursion (:func:`~tppc.planner.refine.ring_makespan`)
    instead of the lowered action lists: what a search ranks many splits with."""
    times, links, back, warmup = _priced(table, cuts, boundaries, workload)
    if back is None:
        back = np.zeros(times.shape[1])
    return warmup + ring_makespan(times, links, back, workload.pipelined_steps)


def lower_bounds(
    table: CostTable, num_stages: int, workload: Workload, granularity: int,
    *, ranged: bool = True,
) -> tuple[float, float]:
    """``(busiest stage, last chunk across every layer)``, both with warm-up included.

    The first is :func:`~tppc.planner.bounds.placement_bound`: over every placement, the
    least ``max_s`` (first chunk reaching stage ``s``) + (its work) + (last chunk leaving
    it); never below ``serial / S`` (each layer on the fastest device). Valid for every plan
    on devices ``0..S-1`` whose chunks start on the granularity grid, when cutting a chunk
    never reduces its work (true of roofline costs: weights re-read, padding, same FLOPs).
    With one pipelined step and a grid of at most ``MAX_GRID`` steps it is also at least
    :func:`~tppc.planner.range_bound.range_bound` (the work of every chunk of the best split
    per layer range, not one chunk's, and the path of the first and last stages), unless
    ``ranged`` is false (the device-set search ranks its candidates with the cheaper bound).
    """
    L = float(table.seq_len)
    c = min(float(granularity), L)

    def fastest(cc: float, pp: float) -> float:
        per = table.times_at(cc, pp, range(num_stages))
        return float(per.min(axis=0).sum())

    serial = fastest(L, 0.0)
    warm = workload.warmup_steps * serial
    steps = workload.pipelined_steps
    work = warm + steps * serial / num_stages
    if steps:
        work = max(work, warm + placement_bound(table, num_stages, granularity, steps))
    if workload.kind == "diffusion" and steps and num_stages > 1:
        work = max(work, warm + ring_bound(table, num_stages, granularity, steps))
    if steps == 1 and ranged:
        tight = range_bound(table, num_stages, granularity)
        if tight is not None:
            work = max(work, warm + tight)
    path = warm + (fastest(c, L - c) if steps else 0.0)
    if steps > 1:  # every step's chunks cross every layer, one step after the other
        path = max(path, warm + steps * serial / num_stages)
    return work, path
