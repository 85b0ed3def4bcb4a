"""Stage placement: which contiguous layer range each device of the chain runs.

Terms:
    cuts: ``(0, e_0, ..., N)``; stage ``s`` runs layers ``[cuts[s], cuts[s+1])`` on device
        ``s`` of the chain (the first ``S`` devices are used, in chain order).
    ``t[s, i]``: stage ``s``'s time on chunk ``i``, the sum of its layers priced on device
        ``s`` (heterogeneous chains price each layer on its own device).
    ``link[s, i]``: time to send chunk ``i``'s output of stage ``s`` (the act bytes per token
        of its last layer × the chunk's tokens) to device ``s + 1``.
    memory of a stage: the rule of :mod:`tppc.planner.memory` (weights, K/V buffers, kept
        outputs, queued and running chunks, the largest value inside a layer).
    objective (an upper bound on the flow-shop makespan, exact for identical stages):
        ``warm-up + K·Σ_i max_s t[s, i] + (S-1)·max_{i,s} (t[s, i] + link[s, i])``.

For a fixed split, :func:`place_layers` solves this as a MILP (``x[j, s]`` = layer ``j`` on
stage ``s``; ``x[j+1, s] ≤ x[j, s] + x[j, s-1]`` and non-empty stages make the ranges
contiguous and ordered), warm-started from :func:`~.layer_partition.balanced_placement`, a
DP that minimises the busiest stage's total time under the memory limits.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pulp

from tppc.cost_models.table import CostTable
from tppc.errors import PlanError
from tppc.planner._solver import available_solver, solve, variable
from tppc.planner.layer_partition import balanced_placement, infeasible_error
from tppc.planner.memory import (
    memory_parts,
    over_capacity,
    pool_of,
    positional_part,
    stage_memory,
)
from tppc.planner.provenance import SolverInfo
from tppc.planner.workload import Workload

__all__ = [
    "balanced_placement",
    "chunk_layer_times",
    "infeasible_error",
    "place_layers",
    "placement_objective",
    "stage_times",
]

MILP_MAX_TERMS = 20_000
"""Above ``layers × stages × chunks`` terms :func:`place_layers` uses a local search (the
MILP on 80 layers × 8 stages × 116 chunks does not close in 20 s here)."""


def chunk_layer_times(table: CostTable, device: int, boundaries: tuple[int, ...],
                      layers: range | None = None) -> np.ndarray:
    """``(N, M)`` seconds of every layer (or of ``layers``) on ``device`` for every chunk of
    ``boundaries``; each distinct time function is evaluated once (identical blocks)."""
    a = np.asarray(boundaries[:-1], dtype=float)
    c = np.diff(np.asarray(boundaries, dtype=float))
    row = table.layers[device]
    seen: dict[int, np.ndarray] = {}
    for j in layers if layers is not None else range(len(row)):
        if id(row[j].time) not in seen:
            seen[id(row[j].time)] = np.broadcast_to(row[j].time(c, a), c.shape)
    return np.stack([seen[id(row[j].time)]
                     for j in (layers if layers is not None else range(len(row)))])


def _links(table: CostTable, cuts: tuple[int, ...], boundaries: tuple[int, ...]) -> np.ndarray:
    c = np.diff(np.asarray(boundaries, dtype=float))
    out = np.zeros((len(cuts) - 2, c.size))
    for s in range(len(cuts) - 2):
        last = table.layers[s][cuts[s + 1] - 1]
        out[s] = table.links[s].time(last.act_bytes_per_token * c)
    return out


def stage_times(
    table: CostTable, cuts: tuple[int, ...], boundaries: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """``(times (S, M), links (S-1, M))`` of a placement on a split."""
    rows = [
        chunk_layer_times(table, s, boundaries, range(lo, hi)).sum(axis=0)
        for s, (lo, hi) in enumerate(itertools.pairwise(cuts))
    ]
    return np.stack(rows), _links(table, cuts, boundaries)


def placement_objective(
    times: np.ndarray, links: np.ndarray, repeats: float, warmup: float = 0.0
) -> float:
    """``warm-up + K·Σ_i max_s t + (S-1)·max (t + link)`` (see the module docstring)."""
    fill = times.copy()
    fill[:-1] += links
    return (
        warmup + repeats * float(times.max(axis=0).sum()) + (times.shape[0] - 1) * float(fill.max())
    )


def place_layers(
    table: CostTable,
    boundaries: tuple[int, ...],
    num_stages: int,
    workload: Workload,
    *,
    time_limit: float,
    start: tuple[int, ...] | None = None,
) -> tuple[tuple[int, ...], float, SolverInfo]:
    """Best contiguous placement for a fixed split (MILP).

    Args:
        table: the cost table.
        boundaries: token boundaries of the chunks.
        num_stages: ``S`` (devices ``0..S-1`` of the chain).
        workload: sets ``K`` and the warm-up term.
        time_limit: seconds for the solver.
        start: cuts to warm-start from (default: :func:`balanced_placement`).

    Returns:
        ``(cuts, objective, provenance)``.

    Raises:
        PlanInfeasible: when no placement fits in memory.
    """
    t0 = time.perf_counter()
    n_layers, n_chunks = table.num_layers, len(boundaries) - 1
    max_chunk = _max_chunk(boundaries, workload, table.seq_len)
    per = [chunk_layer_times(table, s, boundaries) for s in range(num_stages)]
    warm = [_warmup_layer_times(table, s, workload) for s in range(num_stages)]
    if start is None:
        start = balanced_placement(table, num_stages, [p.sum(axis=1) for p in per], max_chunk)
    if start is None:
        raise infeasible_error(table, num_stages, max_chunk)
    rep = float(workload.pipelined_steps)
    if n_layers * num_stages * n_chunks > MILP_MAX_TERMS:
        return _local_search(table, boundaries, workload, per, warm, start, max_chunk, t0)
    start_obj = placement_objective(
        *stage_times(table, start, boundaries), rep, _warmup_seconds(warm, start)
    )
    scale = start_obj if start_obj > 0 else 1.0  # solve in units of the start's objective
    per = [p / scale for p in per]
    warm_s = [(w0 / scale, w1 / scale) for w0, w1 in warm]
    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    x = {
        (j, s): variable(f"x_{j}_{s}", cat="Binary")
        for j in range(n_layers)
        for s in range(num_stages)
    }
    _contiguity_rows(prob, x, n_layers, num_stages)
    # e[j, s]: layer j is the last of stage s (s < S-1); prices the link of boundary s.
    e = {
        (j, s): variable(f"e_{j}_{s}", 0, 1)
        for j in range(n_layers - 1)
        for s in range(num_stages - 1)
    }
    for (j, s), var in e.items():
        prob += var >= x[j, s] + x[j + 1, s + 1] - 1
    chunk_c = np.diff(np.asarray(boundaries, dtype=float))
    row = [variable(f"m_{i}", 0) for i in range(n_chunks)]
    top = variable("t_max", 0)
    memory = []  # each stage's need; a memory pool's stages are charged together
    for s in range(num_stages):
        static, act = memory_parts(table, s, max_chunk)
        pos = positional_part(table, s)
        widest, tables = variable(f"act_{s}", 0), variable(f"pos_{s}", 0)
        for j in range(n_layers):
            prob += widest >= float(act[j]) * x[j, s]
            prob += tables >= float(pos[j]) * x[j, s]
        memory.append(pulp.lpSum(float(static[j]) * x[j, s] for j in range(n_layers))
                      + tables + (max_chunk * widest))
        for i in range(n_chunks):
            t_si = pulp.lpSum(float(per[s][j, i]) * x[j, s] for j in range(n_layers))
            prob += row[i] >= t_si
            if s < num_stages - 1:
                link = table.links[s]
                bytes_ = [
                    table.layers[s][j].act_bytes_per_token * chunk_c[i] for j in range(n_layers - 1)
                ]
                prob += top >= t_si + pulp.lpSum(
                    float(link.time(b)) / scale * e[j, s] for j, b in enumerate(bytes_)
                )
            else:
                prob += top >= t_si
    for pool in {pool_of(table, s) for s in range(num_stages)}:
        members = [s for s in range(num_stages) if pool_of(table, s) == pool]
        prob += pulp.lpSum(memory[s] for s in members) <= min(table.capacities[s]
                                                               for s in members)
    warm_term = pulp.lpSum(
        float(warm_s[s][0][j]) * x[j, s] for s in range(num_stages) for j in range(n_layers)
    ) + pulp.lpSum(
        float(warm_s[s][1][j]) * e[j, s] for s in range(num_stages - 1) for j in range(n_layers - 1)
    )
    prob += rep * pulp.lpSum(row) + (num_stages - 1) * top + warm_term
    _set_start(x, e, start, n_layers, num_stages)
    out = solve(prob, time_limit=max(time_limit, 0.05), warm_start=True)
    if out.status == "infeasible":
        raise PlanError(
            f"the placement MILP is infeasible although the start placement {start} fits; this "
            "is a bug in tppc.planner.placement"
        )
    cuts, claimed, note = start, start_obj, ""
    if out.status in ("optimal", "time_limit"):
        got = _cuts_from(x, n_layers, num_stages)
        if got is None and out.status == "optimal":
            raise PlanError("the placement MILP returned non-contiguous stages; this is a bug "
                            "in tppc.planner.placement")
        if got is not None:
            cuts, claimed = got, out.objective * scale
    times, links = stage_times(table, cuts, boundaries)
    objective = placement_objective(times, links, rep, _warmup_seconds(warm, cuts))
    if out.status != "optimal" and start_obj < objective:  # incumbent worse than the start
        cuts, objective, claimed = start, start_obj, start_obj
        note = "; returned the start (the solver had no better incumbent)"
    bound = out.bound * scale if math.isfinite(out.bound) else -math.inf
    gap = max(0.0, (objective - bound) / objective) if math.isfinite(bound) else math.inf
    info = SolverInfo(
        solver=f"milp-{available_solver()}",
        status="time_limit" if out.status == "no_solution" else out.status,
        objective=claimed,
        bound=bound,
        gap=gap,
        seconds=time.perf_counter() - t0,
        detail=f"placement of {n_layers} layers on {num_stages} stages{note}",
    )
    return cuts, objective, info


def _contiguity_rows(prob, x, n_layers: int, num_stages: int) -> None:
    """Each layer on one stage; stages non-empty, contiguous and in chain order."""
    for j in range(n_layers):
        prob += pulp.lpSum(x[j, s] for s in range(num_stages)) == 1
        if j + 1 < n_layers:
            for s in range(num_stages):
                prob += x[j + 1, s] <= x[j, s] + (x[j, s - 1] if s > 0 else 0)
    prob += x[0, 0] == 1
    for s in range(num_stages):
        prob += pulp.lpSum(x[j, s] for j in range(n_layers)) >= 1


def _local_search(table, boundaries, workload, per, warm, start, max_chunk, t0):
    """Move one stage boundary by one layer at a time while the objective improves.

    Exact objective at every step (prefix sums of per-layer chunk times); memory checked.
    Returns ``(cuts, objective, provenance)`` with status ``"heuristic"``.
    """
    rep = float(workload.pipelined_steps)
    pre = [np.vstack([np.zeros(p.shape[1]), np.cumsum(p, axis=0)]) for p in per]

    def value(cuts: tuple[int, ...]) -> float:
        times = np.stack(
            [pre[s][hi] - pre[s][lo] for s, (lo, hi) in enumerate(itertools.pairwise(cuts))]
        )
        return placement_objective(
            times, _links(table, cuts, boundaries), rep, _warmup_seconds(warm, cuts)
        )

    def fits(cuts: tuple[int, ...]) -> bool:
        ranges = list(itertools.pairwise(cuts))
        return all(hi > lo for lo, hi in ranges) and not over_capacity(table, [
            (s, stage_memory(table, s, lo, hi, max_chunk)) for s, (lo, hi) in enumerate(ranges)])

    cuts, best, moves = start, value(start), 0
    improved = True
    while improved:
        improved = False
        for k, step in itertools.product(range(1, len(cuts) - 1), (-1, 1)):
            cand = (*cuts[:k], cuts[k] + step, *cuts[k + 1 :])
            if fits(cand) and (v := value(cand)) < best * (1 - 1e-12):
                cuts, best, improved, moves = cand, v, True, moves + 1
    info = SolverInfo(
        solver="local-search",
        status="heuristic",
        objective=best,
        bound=-math.inf,
        gap=math.inf,
        seconds=time.perf_counter() - t0,
        detail=f"{moves} boundary moves from the balanced placement",
    )
    return cuts, best, info


def _max_chunk(boundaries: tuple[int, ...], workload: Workload, seq_len: int) -> int:
    if workload.warmup_steps > 0:
        return seq_len
    return int(max(b - a for a, b in itertools.pairwise(boundaries)))


def _warmup_layer_times(
    table: CostTable, device: int, workload: Workload
) -> tuple[np.ndarray, np.ndarray]:
    """Warm-up seconds per layer on ``device`` and per possible last layer's link."""
    n = table.num_layers
    if workload.warmup_steps == 0:
        return np.zeros(n), np.zeros(max(n - 1, 0))
    full = chunk_layer_times(table, device, (0, table.seq_len))[:, 0]
    link = np.zeros(max(n - 1, 0))
    if device < len(table.links):
        bytes_ = np.array([lc.act_bytes_per_token * table.seq_len for lc in table.layers[device]])
        link = table.links[device].time(bytes_[: n - 1])
    return workload.warmup_steps * full, workload.warmup_steps * link


def _warmup_seconds(warm: list[tuple[np.ndarray, np.ndarray]], cuts: tuple[int, ...]) -> float:
    total = 0.0
    for s, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        total += float(warm[s][0][lo:hi].sum())
        if s < len(cuts) - 2:
            total += float(warm[s][1][hi - 1])
    return total


def _set_start(x, e, cuts: tuple[int, ...], n_layers: int, num_stages: int) -> None:
    for (j, s), var in x.items():
        var.setInitialValue(1 if cuts[s] <= j < cuts[s + 1] else 0)
    for (j, s), var in e.items():
        var.setInitialValue(1 if j == cuts[s + 1] - 1 else 0)


def _cuts_from(x, n_layers: int, num_stages: int) -> tuple[int, ...] | None:
    stage_of = []
    for j in range(n_layers):
        vals = [x[j, s].value() or 0 for s in range(num_stages)]
        stage_of.append(int(np.argmax(vals)))
    if stage_of[0] != 0 or any(b - a not in (0, 1) for a, b in itertools.pairwise(stage_of)):
        return None
    if stage_of[-1] != num_stages - 1:
        return None
    cuts = [0] + [j + 1 for j in range(n_layers - 1) if stage_of[j + 1] != stage_of[j]]
    return (*cuts, n_layers)
