"""Split matrices of a placement: what the exact split (TeraPipe's DP) reads.

Terms:
    grid point: a multiple of the granularity ``g``; ``n = seq_len // g`` of them.
    chunk ``[a, b)``: grid points ``a < b``; its tokens are ``a·g .. b·g``.
    ``m[a, b]``: the slowest stage's time for the chunk (``inf`` where it overflows some
        stage's memory, or ``a >= b``).
    ``f[a, b]``: the slowest stage's time plus its outgoing link.
    warm-up: seconds of the workload's full-sequence warm-up steps on the placement.

:class:`SplitContext` holds one planning call's inputs and caches (per-layer chunk
matrices, per-stage sums, the last placement's matrices) so that the joint search
(:mod:`tppc.planner.joint`) prices each placement once.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter

import numpy as np

from tppc.cost_models.table import CostTable
from tppc.planner.dp import chunk_matrix
from tppc.planner.memory import (
    memory_parts,
    over_capacity,
    pool_of,
    positional_part,
    stage_memory,
)
from tppc.planner.workload import Workload

__all__ = ["SplitContext", "smallest_chunk", "split_matrices", "stage_matrix"]


class SplitContext:
    """Shared inputs of one planning call, and its matrix caches (not part of the API)."""

    def __init__(self, table: CostTable, workload: Workload, granularity: int,
                 num_stages: int, max_chunks: int | None, deadline: float,
                 ranged: bool = True) -> None:
        self.table, self.workload, self.g = table, workload, granularity
        self.S, self.max_chunks, self.deadline = num_stages, max_chunks, deadline
        self.ranged = ranged  # price the range bound in the improvements' plans too
        self.n = table.seq_len // granularity
        self.K = float(workload.pipelined_steps)
        self._cache: dict[int, np.ndarray] = {}
        self._stage_cache: dict[tuple[int, int, int], np.ndarray] = {}
        self._split_cache: tuple[tuple[int, ...] | None, tuple] = (None, ())

    def left(self) -> float:
        return max(self.deadline - time.perf_counter(), 0.05)

    def layer_matrix(self, device: int, layer: int) -> np.ndarray:
        fn = self.table.layers[device][layer].time
        key = id(fn)  # identical layers and identical devices share one function
        if key not in self._cache:
            self._cache[key] = chunk_matrix(fn, self.n, self.g)
        return self._cache[key]

    def for_table(self, table: CostTable) -> SplitContext:
        """This context for ``table`` (the same layers, some of them cut at their waist)."""
        sub = SplitContext(table, self.workload, self.g, self.S, self.max_chunks,
                           self.deadline, self.ranged)
        sub._cache = self._cache  # unchanged layers keep their time functions
        return sub


def smallest_chunk(ctx: SplitContext) -> int:
    """Tokens of the smallest chunk a placement must hold (the warm-up runs all at once)."""
    return ctx.table.seq_len if ctx.workload.warmup_steps else ctx.g


def split_matrices(ctx: SplitContext, cuts: tuple[int, ...]
                   ) -> tuple[np.ndarray, np.ndarray, float]:
    """``(m, f, warm-up seconds)`` of a placement; chunks that overflow memory are ``inf``
    (kept for the placement's next use: the split, then its improvement, read them)."""
    if ctx._split_cache[0] != cuts:
        ctx._split_cache = (cuts, _split_matrices_of(ctx, cuts))
    m, f, warm = ctx._split_cache[1]
    return m.copy(), f.copy(), warm


def _split_matrices_of(ctx: SplitContext, cuts: tuple[int, ...]
                       ) -> tuple[np.ndarray, np.ndarray, float]:
    """Links and memory depend on a chunk's size ``b - a`` only: priced on the ``n + 1``
    sizes, then gathered (the same values as pricing every ``(a, b)``, a fraction of the
    work at 1024 grid points)."""
    table, n, g = ctx.table, ctx.n, ctx.g
    steps = np.arange(n + 1)
    k = np.maximum(steps[None, :] - steps[:, None], 0)  # grid steps of chunk [a, b)
    sizes = steps * g
    m = np.zeros((n + 1, n + 1))
    f = np.zeros((n + 1, n + 1))
    too_big = np.zeros(n + 1, dtype=bool)  # chunk sizes that overflow some stage's memory
    pools: dict[int, list[float]] = {}  # pool -> [capacity, Σ held, Σ widest per token]
    warm = 0.0
    for s, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        t = stage_matrix(ctx, s, lo, hi)
        link = 0.0
        if s < ctx.S - 1:
            act = table.layers[s][hi - 1].act_bytes_per_token
            link = table.links[s].time(act * sizes)[k]
        m = np.maximum(m, t)
        f = np.maximum(f, t + link)
        static_parts, transient = memory_parts(table, s)
        held = float(static_parts[lo:hi].sum()) + float(positional_part(table, s)[lo:hi].max())
        pool = pools.setdefault(pool_of(table, s), [float(table.capacities[s]), 0.0, 0.0])
        pool[0] = min(pool[0], float(table.capacities[s]))  # a pool's stages together
        pool[1] += held
        pool[2] += float(transient[lo:hi].max())
        if ctx.workload.warmup_steps:
            warm += ctx.workload.warmup_steps * float(
                t[0, n] + (link[0, n] if s < ctx.S - 1 else 0)
            )
    for cap, held, widest in pools.values():
        room = cap - held
        if widest > 0:
            too_big |= sizes * widest > room
        if room < 0:
            too_big[:] = True
    m[too_big[k]] = np.inf
    if ctx.workload.warmup_steps and over_capacity(table, [
        (s, stage_memory(table, s, lo, hi, table.seq_len))
        for s, (lo, hi) in enumerate(itertools.pairwise(cuts))
    ]):
        m[:] = np.inf  # warm-up runs the full sequence at once
    lower = k == 0  # a <= b: no chunk
    m[lower] = np.inf
    f[lower] = np.inf
    return m, f, warm


def stage_matrix(ctx: SplitContext, s: int, lo: int, hi: int) -> np.ndarray:
    """Σ of the layers' chunk matrices; identical layers (one function) are added once.
    The last few are kept (read only: callers never write into them)."""
    key = (s, lo, hi)
    if key not in ctx._stage_cache:
        if len(ctx._stage_cache) >= ctx.S:  # one placement: 8 MB each at 1024 points
            ctx._stage_cache.clear()
        ctx._stage_cache[key] = _stage_sum(ctx, s, lo, hi)
    return ctx._stage_cache[key]


def _stage_sum(ctx: SplitContext, s: int, lo: int, hi: int) -> np.ndarray:
    counts = Counter(id(ctx.table.layers[s][j].time) for j in range(lo, hi))
    first = {id(ctx.table.layers[s][j].time): j for j in range(hi - 1, lo - 1, -1)}
    return sum(k * ctx.layer_matrix(s, first[key]) for key, k in counts.items())
