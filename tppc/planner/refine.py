"""Candidate splits scored by simulation, the plan's own definition of latency.

The split objective ``J`` (TeraPipe's) is an upper bound on the flow-shop makespan; where it
misses a constraint (PipeFusion's ring in diffusion workloads) the planner also simulates
near-uniform splits and keeps the fastest.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from tppc.planner.plan import Plan

__all__ = ["diffusion_candidates", "improve_split", "ring_makespan", "with_detail"]


def diffusion_candidates(
    best: Plan,
    price: Callable[[tuple[int, ...]], Plan],
    n: int,
    granularity: int,
    max_chunks: int | None,
    makespan: Callable[[tuple[int, ...]], float] | None = None,
) -> Plan:
    """Keep the fastest simulated plan among the solver's split and near-uniform splits.

    The split objective ``J`` ignores PipeFusion's ring: chunk ``m`` of step ``t + 1`` waits
    for chunk ``m`` of step ``t`` to leave the last stage, so with fewer chunks than stages
    every step runs serially. Splits of ``M = 1 .. 8·S`` near-equal chunks are simulated on the
    same placement and the fastest (by simulated latency, the plan's definition) is kept.

    Args:
        best: the solver's plan.
        price: simulates the solver's placement on given token boundaries.
        n: grid points (``seq_len / granularity``).
        granularity: tokens per grid point.
        max_chunks: at most this many chunks.
        makespan: the same latency as ``price(bounds).latency`` for token boundaries, cheaper
            (:func:`ring_makespan`); candidates are ranked with it and only the fastest is
            packaged with ``price``.
    """
    num_stages = best.num_stages
    top = min(n, 8 * num_stages, max_chunks or n)
    grids = [tuple(b * granularity for b in sorted({round(i * n / m) for i in range(m + 1)}))
             for m in range(1, top + 1)]
    if makespan is None:
        for bounds in grids:
            candidate = price(bounds)
            if candidate.latency < best.latency * (1 - 1e-9):
                best = candidate
    else:
        value, bounds = min((makespan(b), b) for b in grids)
        if value < best.latency * (1 - 1e-9):
            candidate = price(bounds)
            best = candidate if candidate.latency < best.latency * (1 - 1e-9) else best
    if best.solver.detail.endswith("(simulated M chunks)"):
        return best
    detail = f"{best.solver.detail}; best of the split and near-uniform M = 1..{top} " \
        "(simulated M chunks)"
    return with_detail(best, detail)


def ring_makespan(times: np.ndarray, links: np.ndarray, back: np.ndarray, steps: int) -> float:
    """The flow shop's makespan with PipeFusion's ring (what
    :func:`tppc.program.schedule.simulate` gives for :func:`~tppc.program.schedule.flow_shop`
    lists), by its recursion alone: chunk ``i`` of step ``t`` starts on stage ``s`` once stage
    ``s`` finished the job before and the chunk arrived from ``s - 1``; on stage 0 after the
    first step, once the same chunk of the step before came back from the last stage (with
    one stage, nothing comes back).

    Args:
        times: ``(S, M)`` stage seconds per chunk.
        links: ``(S-1, M)`` link seconds per boundary and chunk.
        back: ``(M,)`` seconds from the last stage back to stage 0.
        steps: pipelined steps.
    """
    t = np.asarray(times, dtype=float).T.tolist()  # [chunk][stage]
    lk = np.asarray(links, dtype=float).T.tolist()
    bk = np.asarray(back, dtype=float).tolist()
    num_stages, m = len(t[0]), len(t)
    clock = [0.0] * num_stages
    last = [0.0] * m  # the chunk's end on the last stage in the step before
    for step in range(steps):
        for i in range(m):
            ti, li = t[i], lk[i]
            ready = max(clock[0], last[i] + bk[i]) if step and num_stages > 1 else clock[0]
            prev = clock[0] = ready + ti[0]
            for s in range(1, num_stages):
                ready = max(clock[s], prev + li[s - 1])
                prev = clock[s] = ready + ti[s]
            last[i] = prev
    return float(clock[-1])


def with_detail(plan: Plan, detail: str) -> Plan:
    """``plan`` with its solver's detail text replaced."""
    return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, detail=detail))


def improve_split(
    bounds: tuple[int, ...],
    makespan: Callable[[tuple[int, ...]], float],
    *,
    deadline: float,
    max_passes: int = 50,
) -> tuple[tuple[int, ...], float, int]:
    """Local search over chunk boundaries against the simulated makespan (the plan's latency).

    TeraPipe's objective ``Σ t_i + (S-1)·max t_i`` is exact only for identical stages; with
    unequal stages and links the flow shop can do better. Starting from its optimum, each
    pass tries moving one boundary by one grid step, removing one, or splitting a chunk in
    two, and keeps the first move that lowers the simulated makespan; it stops at a local
    optimum, after ``max_passes`` passes or at ``deadline``. Every accepted move is priced by
    the same simulation that defines the plan's latency, so the result is never worse than
    the start; its distance to optimal is stated by the plan's gap to its lower bound.

    Args:
        bounds: grid boundaries ``(0, ..., n)``.
        makespan: simulated latency of grid boundaries (``inf`` when not allowed).
        deadline: ``time.perf_counter()`` value to stop at.
        max_passes: improving passes at most.

    Returns:
        ``(bounds, makespan, accepted moves)``.
    """
    best, value, moves = tuple(bounds), makespan(tuple(bounds)), 0
    for _ in range(max_passes):
        improved = False
        for cand in _neighbours(best):
            if time.perf_counter() > deadline:
                return best, value, moves
            v = makespan(cand)
            if v < value * (1 - 1e-12):
                best, value, moves, improved = cand, v, moves + 1, True
                break
        if not improved:
            break
    return best, value, moves


def _neighbours(bounds: tuple[int, ...]):
    """Boundary shifts by one grid step, removals and chunk splits of ``bounds``."""
    for i in range(1, len(bounds) - 1):
        for step in (-1, 1):
            b = bounds[i] + step
            if bounds[i - 1] < b < bounds[i + 1]:
                yield (*bounds[:i], b, *bounds[i + 1:])
        yield (*bounds[:i], *bounds[i + 1:])
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        if b - a >= 2:
            yield (*bounds[: i + 1], (a + b) // 2, *bounds[i + 1:])
