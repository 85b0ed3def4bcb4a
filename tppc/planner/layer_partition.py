"""Contiguous layer partitions by DP: the balanced placement and the one that fits best.

Terms (see :mod:`tppc.planner.placement`):
    cuts: ``(0, e_0, ..., N)``; stage ``s`` runs layers ``[cuts[s], cuts[s+1])`` on device ``s``.
    score: a stage's cost for a layer range, given its memory need (:mod:`tppc.planner.memory`);
        the DP minimises the largest score over the stages.

:func:`balanced_placement` scores a stage by its total time (``inf`` above its capacity): the
start of the placement MILP and of the alternating search (when it overfills a memory pool,
the placement of the least memory in all, if that fits). :func:`infeasible_error` scores it
by need over capacity, to say how far the best placement is from fitting. The DP charges each
stage alone; the stages of one memory pool (the ``cpu`` devices of one node) are then charged
together (:func:`tppc.planner.memory.over_capacity`): a placement that overfills a pool is
never returned, and the error names the pool.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from tppc.cost_models.table import CostTable
from tppc.errors import PlanInfeasible
from tppc.planner.memory import (
    memory_parts,
    over_capacity,
    positional_part,
    smallest_fit,
    stage_memory,
)

__all__ = ["balanced_placement", "infeasible_error"]


def balanced_placement(
    table: CostTable, num_stages: int, busy: list[np.ndarray], max_chunk: int
) -> tuple[int, ...] | None:
    """Cuts minimising the busiest stage's total time, within memory; None if none fits.

    Args:
        table: the cost table.
        num_stages: ``S``; stage ``s`` runs on device ``s``.
        busy: ``busy[s][j]`` total time of layer ``j`` on device ``s`` (any weighting).
        max_chunk: largest chunk in tokens (sizes in-flight activations).
    """

    def score(s: int, lo: np.ndarray, e: int, mem: np.ndarray) -> np.ndarray:
        pre = np.concatenate([[0.0], np.cumsum(busy[s])])
        return np.where(mem <= table.capacities[s], pre[e] - pre[lo], np.inf)

    cuts = _partition(table, num_stages, max_chunk, score)
    if cuts is None or not _pools_over(table, cuts, max_chunk):
        return cuts

    def held(s: int, lo: np.ndarray, e: int, mem: np.ndarray) -> np.ndarray:
        return np.where(mem <= table.capacities[s], mem, np.inf)

    # the fastest overfills a pool: the placement of the least memory in all (the static
    # bytes are the same in every placement; exact for one pool), if it fits
    cuts = _partition(table, num_stages, max_chunk, held, combine=np.add)
    return None if cuts is None or _pools_over(table, cuts, max_chunk) else cuts


def _pools_over(table: CostTable, cuts: tuple[int, ...], max_chunk: int
                ) -> list[tuple[tuple[int, ...], float, int]]:
    """The memory pools the stages of ``cuts`` overfill (``over_capacity``)."""
    return over_capacity(table, [(s, stage_memory(table, s, lo, hi, max_chunk))
                                 for s, (lo, hi) in enumerate(itertools.pairwise(cuts))])


def _partition(table: CostTable, num_stages: int, max_chunk: int, score,
               combine=np.maximum) -> tuple[int, ...] | None:
    """Contiguous cuts minimising ``max_s score(s, lo, e, memory)`` by DP (``combine=np.add``:
    the sum over the stages; None: all inf)."""
    n_layers = table.num_layers
    best = np.full(n_layers + 1, np.inf)
    best[0] = 0.0
    args = np.zeros((num_stages, n_layers + 1), dtype=int)
    for s in range(num_stages):
        static, act = memory_parts(table, s, max_chunk)
        pos = positional_part(table, s)
        pre_mem = np.concatenate([[0.0], np.cumsum(static)])
        nxt = np.full(n_layers + 1, np.inf)
        for e in range(1, n_layers + 1):
            lo = np.arange(e)
            widest = np.maximum.accumulate(act[:e][::-1])[::-1]  # max act over [b, e)
            tables = np.maximum.accumulate(pos[:e][::-1])[::-1]
            mem = pre_mem[e] - pre_mem[lo] + tables + max_chunk * widest
            cand = combine(best[lo], score(s, lo, e, mem))
            k = int(np.argmin(cand))
            nxt[e], args[s, e] = cand[k], k
        best = nxt
    if not math.isfinite(best[n_layers]):
        return None
    cuts, e = [n_layers], n_layers
    for s in range(num_stages - 1, -1, -1):
        e = int(args[s, e])
        cuts.append(e)
    return tuple(reversed(cuts))


def infeasible_error(table: CostTable, num_stages: int, max_chunk: int) -> PlanInfeasible:
    """A :class:`PlanInfeasible` naming each device's capacity and need, and a cluster that fits.

    Needs are those of the placement that minimises the largest need-to-capacity ratio.
    """
    cuts = _min_ratio_cuts(table, num_stages, max_chunk)
    lines = [
        f"the model does not fit on {num_stages} devices with chunks of up to {max_chunk} tokens:"
    ]
    for s, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        need = stage_memory(table, s, lo, hi, max_chunk)
        cap = table.capacities[s]
        mark = "  <-- over" if need > cap else ""
        lines.append(
            f"  device {s} ({table.device_names[s]}): layers [{lo}, {hi}) need "
            f"{need / 1e9:.2f} GB, capacity {cap / 1e9:.2f} GB{mark}"
        )
    shared = [(st, need, cap) for st, need, cap in _pools_over(table, cuts, max_chunk)
              if len(st) > 1]
    for stages, need, cap in shared:
        lines.append(
            f"  devices {', '.join(map(str, stages))} share one memory pool (the RAM of "
            f"one node): together they need {need / 1e9:.2f} GB, capacity "
            f"{cap / 1e9:.2f} GB  <-- over")
    if shared:
        lines.append("more devices of that node share the same memory: use devices with "
                     "memory of their own (other nodes), or a shorter sequence")
        return PlanInfeasible("\n".join(lines))
    name, cap = table.device_names[0], table.capacities[0]
    fit = smallest_fit(table, cap, max_chunk)
    if fit is None:
        lines.append(
            f"no number of {name} devices fits: a single layer needs more than "
            f"{cap / 1e9:.2f} GB; use a device with more memory"
        )
    else:
        lines.append(
            f"smallest cluster of the same device that fits: {fit}x{name}; or use "
            "devices with more memory, or a shorter sequence"
        )
    return PlanInfeasible("\n".join(lines))


def _min_ratio_cuts(table: CostTable, num_stages: int, max_chunk: int) -> tuple[int, ...]:
    """Cuts minimising max(need / capacity) over the stages."""

    def score(s: int, lo: np.ndarray, e: int, mem: np.ndarray) -> np.ndarray:
        return mem / table.capacities[s]

    cuts = _partition(table, num_stages, max_chunk, score)
    assert cuts is not None  # every score is finite
    return cuts
