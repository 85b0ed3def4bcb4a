"""Lower bounds on the latency of every plan of a problem (any placement, any grid split).

Terms (``S`` stages on devices ``0..S-1`` of the table, layers ``0..N-1``):
    head ``h_j``: the least time layer ``j`` can take on the first chunk (tokens ``[0, c)``,
        ``c`` a multiple of the granularity, on the fastest device).
    tail ``e_j``: the least time layer ``j`` can take on the last chunk (``[L - c, L)``).
    stage bound: stage ``s`` (layers ``[lo, hi)`` on device ``s``) cannot start before the
        first chunk has crossed layers ``< lo`` and the links before it, is then busy for at
        least its one-chunk work ``W_s(lo, hi)`` (cutting a chunk never lowers its work:
        weights re-read, tile padding, the same FLOPs), and after its last job the last
        chunk still crosses layers ``≥ hi``. So every plan with that placement takes at least
        ``max_s Σ_{j<lo_s} h_j + K·W_s + Σ_{j≥hi_s} e_j`` (links included).
    placement bound: the minimum of that over every contiguous placement (a min-max
        partition DP, exact), so it bounds every plan the planner can return.
"""

from __future__ import annotations

import numpy as np

from tppc.cost_models.table import CostTable

__all__ = ["edge_costs", "placement_bound"]


def edge_costs(table: CostTable, num_stages: int, granularity: int) -> tuple[np.ndarray, ...]:
    """``(h, e, W)``: per-layer head and tail (fastest device, best grid chunk) and the
    ``(S, N)`` one-chunk work of every layer on every device."""
    L = float(table.seq_len)
    g = float(min(granularity, table.seq_len))
    ks = np.arange(g, L + g, g)
    first = np.unique(np.minimum(ks, L))  # a first chunk ends on the grid or at L
    last = L - np.arange(0.0, L, g)  # a last chunk starts on the grid
    cache: dict[int, tuple[float, float, float]] = {}

    def prices(fn) -> tuple[float, float, float]:
        if id(fn) not in cache:
            h = float(np.min(np.asarray(fn(first, np.zeros_like(first)), dtype=float)))
            e = float(np.min(np.asarray(fn(last, L - last), dtype=float)))
            w = float(np.asarray(fn(np.array([L]), np.zeros(1)), dtype=float).ravel()[0])
            cache[id(fn)] = (h, e, w)
        return cache[id(fn)]

    per = np.array([[prices(lc.time) for lc in table.layers[d]] for d in range(num_stages)])
    return per[:, :, 0].min(axis=0), per[:, :, 1].min(axis=0), per[:, :, 2]


def placement_bound(table: CostTable, num_stages: int, granularity: int,
                    steps: int = 1) -> float:
    """Least ``max_s head + steps·busy + tail`` over contiguous placements (module docstring).

    Args:
        table: the cost table (stage ``s`` runs on device ``s``).
        num_stages: ``S``; each stage takes at least one layer.
        granularity: chunks start on multiples of this many tokens.
        steps: pipelined steps ``K`` (each stage runs its work ``K`` times).
    """
    h, e, work = edge_costs(table, num_stages, granularity)
    n = table.num_layers
    head = np.concatenate([[0.0], np.cumsum(h)])  # head[lo] = Σ_{j<lo} h_j
    tail = np.concatenate([np.cumsum(e[::-1])[::-1], [0.0]])  # tail[hi] = Σ_{j≥hi} e_j
    L, g = table.seq_len, min(granularity, table.seq_len)
    act = min((lc.act_bytes_per_token for lc in table.layers[0]), default=0.0)
    links = table.links[: num_stages - 1]
    first = np.array([0.0, *(float(lk.time(act * g)) for lk in links)])
    last = np.array([*(float(lk.time(act * (L - (L - 1) // g * g))) for lk in links), 0.0])
    hop_before = np.cumsum(first)  # the first chunk's links before stage s
    hop_after = np.cumsum(last[::-1])[::-1]  # the last chunk's links after stage s
    lo, hi = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    best = np.full(n + 1, np.inf)  # best[hi]: least max over stages 0..s ending at hi
    best[0] = 0.0
    for s in range(num_stages):
        pre = np.concatenate([[0.0], np.cumsum(work[s])])
        cost = head[lo] + hop_before[s] + steps * (pre[hi] - pre[lo]) + tail[hi] + hop_after[s]
        cost = np.where(hi > lo, cost, np.inf)
        best = np.min(np.maximum(best[:, None], cost), axis=0)
    return float(best[n])
