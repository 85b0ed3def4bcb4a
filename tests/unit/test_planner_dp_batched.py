"""TeraPipe's DP with batched levels (tppc.planner.dp): the same optimum as pricing every
``t_max`` level one by one (TeraPipe's enumeration, written out here) on grids too large for
brute force."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hst

from tppc.planner.dp import chunk_matrix, min_sum_dp, terapipe_dp


def _every_level(m: np.ndarray, f: np.ndarray, stages: int, repeats: float) -> float:
    """min over every level T of K·minsum(f ≤ T) + (S-1)·T (TeraPipe's enumeration)."""
    best = np.inf
    for level in np.unique(f[np.isfinite(f)]):
        total, bounds = min_sum_dp(np.where(f <= level, m, np.inf))
        if bounds:
            worst = max(f[a, b] for a, b in itertools.pairwise(bounds))
            best = min(best, repeats * total + (stages - 1) * worst)
    return best


@settings(max_examples=20, deadline=None)
@given(hst.integers(0, 10**6))
def test_batched_dp_is_the_enumeration(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, stages = int(rng.integers(8, 40)), int(rng.integers(1, 9))
    fixed, scale, span = rng.uniform(0, 1e-3), rng.uniform(1e-7, 1e-5), rng.uniform(64, 4096)
    m = chunk_matrix(lambda c, p: fixed + scale * c * (1 + (p + c / 2) / span), n, 64)
    f = m + rng.uniform(0, 1e-4) * (m > 0)
    repeats = float(rng.integers(1, 20))
    got = terapipe_dp(m, f, stages, repeats=repeats)
    want = _every_level(m, f, stages, repeats)
    assert abs(got.objective - want) <= 1e-12 * want
    pairs = list(itertools.pairwise(got.bounds))
    value = repeats * sum(m[a, b] for a, b in pairs) + (stages - 1) * max(f[a, b] for a, b in pairs)
    assert abs(value - got.objective) <= 1e-12 * want
