"""A placement-free lower bound that prices the chunking trade-off (per-chunk overhead vs fill).

Terms (``S`` stages on devices ``0..S-1``, layers ``0..N-1``, grid points ``x_0 = 0 < ... <
x_n = L``: multiples of the granularity, and ``L``):
    ``T_{s,j}[a, b]``: layer ``j``'s time on device ``s`` for the chunk ``[x_a, x_b)`` (prefix
        ``x_a``); a range's matrix ``M_s(lo, hi) = Σ_{lo≤j<hi} T_{s,j}``.
    head ``H_lo[b]``: ``Σ_{j<lo} min_d T_{d,j}[0, b]`` plus the links before stage ``s`` for
        ``x_b`` tokens: no plan's first chunk ``[0, x_b)`` reaches stage ``s`` sooner.
    tail ``E_hi[a]``: ``Σ_{j≥hi} min_d T_{d,j}[a, n]`` plus the links after stage ``s``.
    range value ``V_s(lo, hi)``: the least ``H_lo[b_1] + Σ_i M_s[b_{i-1}, b_i] + E_hi[b_{k-1}]``
        over every grid split ``0 = b_0 < ... < b_k = n`` (a min-sum DP on ``M_s`` with the
        head added to row 0 and the tail to column ``n``).

Validity: in any plan (placement ``[lo_s, hi_s)``, grid split, chunks in order on every stage)
stage ``s`` starts its first chunk no sooner than that chunk crosses the layers and links
before it (≥ the head at its ``b_1``), runs every chunk of the split (``Σ_i M_s``, one after
the other), and the last chunk, done no sooner, still crosses the later layers and links
(≥ the tail at its ``b_{k-1}``). So the plan takes at least ``V_s(lo_s, hi_s)`` for every
``s``, and ``min`` over contiguous placements of ``max_s V_s`` (a min-max partition DP,
exact) bounds every plan. Unlike :func:`~tppc.planner.bounds.placement_bound` it sees that
many chunks pay per-chunk work while few chunks pay a long head and tail.

Path: that min-max is combined with the path of the first and last stages
(:func:`tppc.planner.path_bound.end_pairs_bound`): some chunk crosses every layer between
the first stage's chunks before it and the last stage's after it, which prices the fill of
large chunks that the per-range values do not.

Speed: only ranges that could be some stage of a placement below the incumbent are priced
(pruned with the one-chunk bound of :mod:`tppc.planner.bounds`, which each range value is
combined with by ``max``); grids of more than ``max_grid`` steps are not priced (``None``).
"""

from __future__ import annotations

import numpy as np

from tppc.cost_models.table import CostTable
from tppc.planner.path_bound import end_pairs_bound, min_tiling_sum
from tppc.planner.table_cache import TableCache

__all__ = ["MAX_GRID", "range_bound"]

MAX_GRID = 256
"""Grid steps priced at most (``(n+1)²`` matrices per layer); above it :func:`range_bound`
returns ``None``."""


def _call(fn, c: np.ndarray, p: np.ndarray) -> np.ndarray:
    return np.broadcast_to(np.asarray(fn(c, p), dtype=float), c.shape).astype(float)


def _minmax(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Forward and backward min-max DP values and the forward argmin cuts."""
    S, N = cost.shape[0], cost.shape[1] - 1
    fwd = np.full((S + 1, N + 1), np.inf)
    fwd[0, 0] = 0.0
    arg = np.zeros((S, N + 1), dtype=int)
    for s in range(S):
        c = np.maximum(fwd[s][:, None], cost[s])  # [lo, hi]
        arg[s] = np.argmin(c, axis=0)
        fwd[s + 1] = c[arg[s], np.arange(N + 1)]
    bwd = np.full((S + 1, N + 1), np.inf)
    bwd[S, N] = 0.0
    for s in range(S - 1, -1, -1):
        bwd[s] = np.min(np.maximum(cost[s], bwd[s + 1][None, :]), axis=1)
    cuts = [N]
    for s in range(S - 1, -1, -1):
        cuts.append(int(arg[s][cuts[-1]]))
    return fwd, bwd, cuts[::-1]


_CACHE: TableCache[float | None] = TableCache(size=8)
"""The last few results (:class:`TableCache`): a plan prices several placements and device
subsets of one table."""


def range_bound(table: CostTable, num_stages: int, granularity: int,
                max_grid: int = MAX_GRID) -> float | None:
    """``min`` over contiguous placements of ``max_s V_s`` (module docstring), one step.

    Args:
        table: the cost table (stage ``s`` runs on device ``s``).
        num_stages: ``S``; each stage takes at least one layer.
        granularity: chunks start on multiples of this many tokens.
        max_grid: grid steps priced at most.

    Returns:
        The bound in seconds (never below the one-chunk placement bound), or ``None`` when
        the grid has more than ``max_grid`` steps.
    """
    return _CACHE.get(table, num_stages, (granularity, max_grid),
                      lambda: _range_bound(table, num_stages, granularity, max_grid))


def _range_bound(table: CostTable, num_stages: int, granularity: int, max_grid: int
                 ) -> float | None:
    L = float(table.seq_len)
    g = float(min(granularity, table.seq_len))
    x = np.unique(np.minimum(np.arange(0.0, L + g, g), L))
    n, N, S = x.size - 1, table.num_layers, num_stages
    if n > max_grid or S < 1 or N < S:
        return None
    # heads (first chunk [0, x_b)) and tails (last chunk [x_a, L)), fastest device per layer
    # (each distinct time function once: identical blocks and devices share one)
    first = _per_layer(table, S, x[1:], np.zeros(n)).min(axis=0)  # (N, n): b = 1..n
    last = _per_layer(table, S, L - x[:-1], x[:-1]).min(axis=0)  # (N, n): a = 0..n-1
    head = np.vstack([np.zeros(n), np.cumsum(first, axis=0)])  # head[lo, b-1]
    tail = np.vstack([np.cumsum(last[::-1], axis=0)[::-1], np.zeros(n)])  # tail[hi, a]
    act = min((lc.act_bytes_per_token for d in range(S) for lc in table.layers[d]),
              default=0.0)  # the links carry at least this per token
    links = table.links[: S - 1]
    hop_in = np.array([np.asarray(lk.time(act * x[1:]), dtype=float) for lk in links]
                      ).reshape(-1, n)
    hop_out = np.array([np.asarray(lk.time(act * (L - x[:-1])), dtype=float) for lk in links]
                       ).reshape(-1, n)
    before = np.vstack([np.zeros(n), np.cumsum(hop_in, axis=0)])  # (S, n)
    after = np.vstack([np.cumsum(hop_out[::-1], axis=0)[::-1], np.zeros(n)])  # (S, n)
    # one-chunk bound per range (the pruning bound): min head + work + min tail
    work = table.times_at(L, 0.0, range(S))
    pre = np.hstack([np.zeros((S, 1)), np.cumsum(work, axis=1)])
    lo, hi = np.meshgrid(np.arange(N + 1), np.arange(N + 1), indexing="ij")
    h_min = (head[:, None, :] + before[None, :, :]).min(axis=2)  # (N+1, S)
    e_min = (tail[:, None, :] + after[None, :, :]).min(axis=2)
    cost = np.stack([h_min[lo, s] + pre[s][hi] - pre[s][lo] + e_min[hi, s] for s in range(S)])
    cost = np.where((hi > lo)[None], cost, np.inf)
    fwd, bwd, cuts = _minmax(cost)
    priced = cost.copy()
    for s in range(S):  # the incumbent: the one-chunk bound's best placement, priced exactly
        priced[s, cuts[s], cuts[s + 1]] = _price(table, s, [(cuts[s], cuts[s + 1])], x,
                                                 head, tail, before, after, cost)[0]
    incumbent = max(priced[s, cuts[s], cuts[s + 1]] for s in range(S))
    for s in range(S):
        need = np.maximum(np.maximum(fwd[s][:, None], cost[s]), bwd[s + 1][None, :])
        pairs = [(int(a), int(b)) for a, b in zip(*np.nonzero(need <= incumbent))]
        if pairs:
            got = _price(table, s, pairs, x, head, tail, before, after, cost)
            for (a, b), v in zip(pairs, got):
                priced[s, a, b] = v
    stages = float(_minmax(priced)[0][S, N])
    if S < 2:
        return stages
    return max(stages, end_pairs_bound(table, S, x, priced, act))


def _per_layer(table: CostTable, S: int, c: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``[d, l, :]``: layer ``l`` of device ``d < S`` at chunks ``(c, p)``."""
    seen: dict[int, np.ndarray] = {}
    for d in range(S):
        for lc in table.layers[d]:
            if id(lc.time) not in seen:
                seen[id(lc.time)] = _call(lc.time, c, p)
    return np.array([[seen[id(lc.time)] for lc in table.layers[d]] for d in range(S)])


def _price(table: CostTable, s: int, pairs: list[tuple[int, int]], x: np.ndarray,
           head: np.ndarray, tail: np.ndarray, before: np.ndarray, after: np.ndarray,
           cost: np.ndarray) -> np.ndarray:
    """``max(V_s(lo, hi), one-chunk bound)`` for each ``(lo, hi)`` in ``pairs``."""
    n = x.size - 1
    a, b = np.triu_indices(n + 1, 1)
    j0 = min(p[0] for p in pairs)
    j1 = max(p[1] for p in pairs)
    mats: dict[int, np.ndarray] = {}
    pre = np.zeros((j1 - j0 + 1, n + 1, n + 1))
    for j in range(j0, j1):
        fn = table.layers[s][j].time
        if id(fn) not in mats:
            m = np.zeros((n + 1, n + 1))
            m[a, b] = _call(fn, x[b] - x[a], x[a])
            mats[id(fn)] = m
        pre[j - j0 + 1] = pre[j - j0] + mats[id(fn)]
    out = np.empty(len(pairs))
    for k in range(0, len(pairs), 32):  # batches bound the memory
        chunk = pairs[k:k + 32]
        m = np.stack([pre[hi - j0] - pre[lo - j0] for lo, hi in chunk])
        m[:, 0, 1:] += np.stack([head[lo] for lo, _ in chunk]) + before[s]
        m[:, :-1, n] += np.stack([tail[hi] for _, hi in chunk]) + after[s]
        m[:, np.tril_indices(n + 1)[0], np.tril_indices(n + 1)[1]] = np.inf
        got = min_tiling_sum(m)
        out[k:k + len(chunk)] = np.maximum(got, [cost[s, lo, hi] for lo, hi in chunk])
    return out
