"""Token split: MILP == TeraPipe DP == brute force; causal optima are non-uniform."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tppc.errors import PlanError
from tppc.planner import brute_force_split, split_milp, split_tokens, terapipe_dp
from tppc.planner.dp import chunk_matrix
from tppc.planner.split import solve_split


def _causal(fixed: float, scale: float, span: float, tile: int):
    def cost(c: np.ndarray, p: np.ndarray) -> np.ndarray:
        padded = np.ceil(c / tile) * tile
        return fixed + scale * padded * (1.0 + (p + c / 2) / span)

    return cost


instances = st.tuples(
    st.integers(1, 10),  # grid points
    st.integers(1, 8),  # stages
    st.floats(1e-5, 1e-3),  # fixed cost per chunk
    st.floats(1e-7, 1e-5),  # cost per token
    st.floats(64.0, 8192.0),  # prefix span
    st.sampled_from([1, 16, 48]),  # tile
    st.one_of(st.none(), st.integers(1, 10)),  # max_chunks
)


def _milp_matches_brute_force(inst) -> bool:
    """Solve with the MILP alone and compare claim, evaluation and status with brute force."""
    n, stages, fixed, scale, span, tile, max_chunks = inst
    cost = _causal(fixed, scale, span, tile)
    brute = brute_force_split(chunk_matrix(cost, n, 32), num_stages=stages, max_chunks=max_chunks)
    try:
        milp = split_tokens(cost, 32 * n, stages, granularity=32, max_chunks=max_chunks,
                            solver="milp", warm_start="uniform", time_limit=20)
    except PlanError:  # the MILP returned something that is not a split
        return False
    assert milp.solver.solver.startswith("milp-")
    return (milp.solver.status == "optimal"
            and milp.solver.objective == pytest.approx(brute.objective, rel=1e-7)
            and milp.objective == pytest.approx(brute.objective, rel=1e-9))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances)
def test_milp_dp_and_brute_force_agree(inst) -> None:
    n, stages, fixed, scale, span, tile, max_chunks = inst
    m = chunk_matrix(_causal(fixed, scale, span, tile), n, 32)
    brute = brute_force_split(m, num_stages=stages, max_chunks=max_chunks)
    dp = terapipe_dp(m, num_stages=stages, max_chunks=max_chunks)
    assert dp.objective == pytest.approx(brute.objective, rel=1e-9)
    assert _milp_matches_brute_force(inst)


FIXED_INSTANCES = [(8, 4, 1e-4, 1e-6, 512.0, 16, None), (10, 8, 5e-5, 2e-6, 256.0, 1, None),
                   (6, 3, 1e-5, 1e-5, 128.0, 48, 4)]


def test_a_broken_milp_is_caught_by_the_comparison(monkeypatch) -> None:
    """Dropping the max-term rows must make the MILP disagree with brute force."""
    assert all(_milp_matches_brute_force(inst) for inst in FIXED_INSTANCES)
    monkeypatch.setattr(split_milp, "_max_term_rows", lambda *args: None)
    assert not any(_milp_matches_brute_force(inst) for inst in FIXED_INSTANCES)


def test_milp_with_no_candidate_chunks_is_an_error_not_optimal(monkeypatch) -> None:
    real = split_milp._buckets
    monkeypatch.setattr(split_milp, "_buckets", lambda *a, **k: [
        split_milp._Bucket(b.lo, b.hi, ()) for b in real(*a, **k)])
    with pytest.raises(PlanError, match="MILP is infeasible"):
        split_tokens(_causal(1e-4, 1e-6, 512.0, 1), 256, 2, granularity=32, solver="milp")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 8), st.integers(1, 6), st.floats(1.0, 4.0), st.integers(0, 10**6))
def test_dp_matches_brute_force_on_random_matrices_with_separate_max_term(n, stages, k, seed):
    rng = np.random.default_rng(seed)
    m = np.triu(rng.random((n + 1, n + 1)) + 0.1, 1)
    m[m == 0] = np.inf
    f = m + np.triu(rng.random((n + 1, n + 1)), 1)
    dp = terapipe_dp(m, f, stages, repeats=k)
    brute = brute_force_split(m, f, stages, repeats=k)
    _milp_bounds, milp_obj, info = solve_split(m, f, stages, repeats=k, solver="milp",
                                               warm_start="uniform")
    assert dp.objective == pytest.approx(brute.objective, rel=1e-9)
    assert milp_obj == pytest.approx(brute.objective, rel=1e-9)
    assert info.objective == pytest.approx(brute.objective, rel=1e-7)
    assert info.status == "optimal"


def test_milp_equals_dp_on_a_64_point_causal_grid() -> None:
    cost = _causal(1e-4, 1e-6, 4096.0, 128)
    milp = split_tokens(cost, 8192, 8, granularity=128, solver="milp", warm_start="uniform",
                        time_limit=60)
    dp = split_tokens(cost, 8192, 8, granularity=128, solver="dp")
    assert milp.solver.solver.startswith("milp-") and milp.solver.status == "optimal"
    assert milp.objective == pytest.approx(dp.objective, rel=1e-9)
    assert milp.solver.objective == pytest.approx(dp.objective, rel=1e-7)


def test_causal_optimum_has_shorter_later_chunks() -> None:
    cost = _causal(1e-4, 1e-6, 1024.0, 1)
    split = split_tokens(cost, 4096, 8, granularity=64)
    sizes = split.chunks
    assert sizes[0] > sizes[-1]
    assert len(set(sizes)) > 1


def test_split_boundaries_tile_the_sequence() -> None:
    split = split_tokens(_causal(1e-4, 1e-6, 2048.0, 1), 2048, 4, granularity=128)
    assert split.boundaries[0] == 0 and split.boundaries[-1] == 2048
    assert all(c % 128 == 0 and c > 0 for c in split.chunks)


def test_max_chunks_is_respected() -> None:
    split = split_tokens(_causal(1e-5, 1e-6, 512.0, 1), 2048, 8, granularity=64, max_chunks=3)
    assert len(split.chunks) <= 3


def test_time_limit_returns_incumbent_with_gap() -> None:
    cost = _causal(1e-4, 1e-6, 4096.0, 128)
    split = split_tokens(
        cost, 16384, 8, granularity=128, solver="milp", warm_start="uniform", time_limit=0.3
    )
    assert split.solver.status in ("time_limit", "optimal")
    if split.solver.status == "time_limit":
        assert split.solver.gap >= 0.0
    assert split.boundaries[-1] == 16384
    dp = terapipe_dp(chunk_matrix(cost, 128, 128), num_stages=8)
    assert split.objective >= dp.objective * (1 - 1e-9)


def test_seq_len_not_multiple_of_granularity_is_rejected() -> None:
    with pytest.raises(PlanError, match="not a multiple of granularity=128"):
        split_tokens(_causal(1e-4, 1e-6, 1.0, 1), 1000, 2, granularity=128)


def test_bad_stage_count_is_rejected() -> None:
    with pytest.raises(PlanError, match="num_stages=0"):
        split_tokens(_causal(1e-4, 1e-6, 1.0, 1), 1024, 0)
