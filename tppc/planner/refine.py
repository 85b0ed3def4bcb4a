"""Candidate splits scored by simulation, the plan's own definition of latency.

The split objective ``J`` (TeraPipe's) is an upper bound on the flow-shop makespan; where it
misses a constraint (PipeFusion's ring in diffusion workloads) the planner also simulates
near-uniform splits and keeps the fastest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tppc.planner.plan import Plan

__all__ = ["diffusion_candidates", "with_detail"]


def diffusion_candidates(
    best: Plan,
    price: Callable[[tuple[int, ...]], Plan],
    n: int,
    granularity: int,
    max_chunks: int | None,
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
    """
    num_stages = best.num_stages
    top = min(n, 8 * num_stages, max_chunks or n)
    for m in range(1, top + 1):
        grid = sorted({round(i * n / m) for i in range(m + 1)})
        candidate = price(tuple(b * granularity for b in grid))
        if candidate.latency < best.latency * (1 - 1e-9):
            best = candidate
    if best.solver.detail.endswith("(simulated M chunks)"):
        return best
    detail = f"{best.solver.detail}; best of the split and near-uniform M = 1..{top} " \
        "(simulated M chunks)"
    return with_detail(best, detail)


def with_detail(plan: Plan, detail: str) -> Plan:
    """``plan`` with its solver's detail text replaced."""
    return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, detail=detail))
