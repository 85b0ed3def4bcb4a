"""The certified split search (tppc.planner.certify) against brute force over every split,
simulated by tppc.program.schedule; broken prunes are caught by the same comparison."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tppc.planner import certify
from tppc.planner.certify import search_split, split_bound
from tppc.program.schedule import simulate


def _instance(seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Random causal stages (own overhead, rate, attention span) and links on a small grid."""
    rng = np.random.default_rng(seed)
    S, n = int(rng.integers(1, 5)), int(rng.integers(2, 10))
    a, b = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    c, p = (b - a).astype(float), a.astype(float)
    valid = b > a
    t = []
    for _ in range(S):
        fixed, rate, span = rng.uniform(0.0, 2.0), rng.uniform(0.2, 3.0), rng.uniform(1, 20)
        t.append(np.where(valid, fixed + rate * c * (1 + (p + c / 2) / span), np.inf))
    lk = [np.where(valid, rng.uniform(0, 0.5) + rng.uniform(0, 0.5) * c, np.inf)
          for _ in range(S - 1)]
    return t, lk


def _brute(t: list[np.ndarray], lk: list[np.ndarray]) -> float:
    n = t[0].shape[0] - 1
    best = np.inf
    for mask in range(2 ** (n - 1)):
        bounds = [0, *(k + 1 for k in range(n - 1) if mask >> k & 1), n]
        a, b = np.array(bounds[:-1]), np.array(bounds[1:])
        times = np.stack([m[a, b] for m in t])
        links = np.stack([m[a, b] for m in lk]) if lk else None
        best = min(best, simulate(times, links).makespan)
    return best


def _simulated(t, lk, bounds) -> float:
    a, b = np.array(bounds[:-1]), np.array(bounds[1:])
    links = np.stack([m[a, b] for m in lk]) if lk else None
    return simulate(np.stack([m[a, b] for m in t]), links).makespan


def _check(seed: int) -> bool:
    t, lk = _instance(seed)
    n = t[0].shape[0] - 1
    res = search_split(t, lk, (0, n), deadline=time.perf_counter() + 30)
    assert res.status == "optimal"
    assert res.makespan == pytest.approx(_simulated(t, lk, res.bounds), rel=1e-12)
    return bool(np.isclose(res.makespan, _brute(t, lk), rtol=1e-9, atol=0))


@pytest.mark.parametrize("seed", range(40))
def test_search_finds_the_brute_force_optimum(seed: int) -> None:
    assert _check(seed)


@pytest.mark.parametrize("seed", range(40))
def test_split_bound_is_below_the_brute_force_optimum(seed: int) -> None:
    t, lk = _instance(seed)
    assert split_bound(t, lk) <= _brute(t, lk) * (1 + 1e-12)


def test_split_bound_is_tight_for_identical_stages_without_links() -> None:
    # identical stages: the makespan is Σ t + (S-1)·max t, exactly the relaxation
    t, _ = _instance(3)
    t3 = [t[0]] * 3
    lk = [np.zeros_like(t[0])] * 2
    assert split_bound(t3, lk) == pytest.approx(_brute(t3, lk), rel=1e-12)


def test_a_too_strong_prune_is_caught(monkeypatch) -> None:
    real = certify.suffix_bounds
    monkeypatch.setattr(certify, "suffix_bounds", lambda t, lk: real(t, lk) * 1.3)
    assert not all(_check(seed) for seed in range(40))


def test_a_wrong_dominance_rule_is_caught(monkeypatch) -> None:
    # keep only the label with the earliest first-stage time: not a dominance rule
    monkeypatch.setattr(certify, "_pareto", lambda C: np.array([int(np.argmin(C[:, 0]))]))
    assert not all(_check(seed) for seed in range(40))


def test_deadline_returns_the_incumbent_with_its_status() -> None:
    t, lk = _instance(5)
    n = t[0].shape[0] - 1
    res = search_split(t, lk, (0, n), deadline=time.perf_counter() - 1)
    assert (res.status, res.bounds) == ("time_limit", (0, n))
    assert res.makespan == pytest.approx(_simulated(t, lk, (0, n)))


def test_label_cap_is_reported() -> None:
    t, lk = _instance(7)
    t = [t[0]] * 4
    lk = [np.zeros_like(t[0]) + 0.01] * 3
    res = search_split(t, lk, (0, t[0].shape[0] - 1), deadline=time.perf_counter() + 30,
                       max_labels=0)
    assert res.status == "label_limit"
    assert res.bounds[0] == 0 and res.bounds[-1] == t[0].shape[0] - 1


def test_the_plan_reports_a_proven_split_and_round_trips() -> None:
    from tests.unit.planner_helpers import hand_makespan, table
    from tppc.planner import Plan, plan_from_costs

    t = table(num_layers=4, speeds=(1.0, 2.5, 0.7), seq_len=1024, link_bw=1e9)
    plan = plan_from_costs(t, granularity=128, num_stages=3)
    assert plan.split is not None and plan.split.status == "optimal"
    assert plan.split.gap == 0.0 and plan.split.bound == plan.latency
    cuts = (0, *(st.layer_end for st in plan.stages))
    best = min(hand_makespan(t, cuts, [0, *(128 * (k + 1) for k in range(7) if mask >> k & 1),
                                       1024]) for mask in range(2 ** 7))
    assert plan.latency == pytest.approx(best, rel=1e-12)  # no split of the placement is faster
    assert Plan.from_json(plan.to_json()) == plan
    assert "split exact DP" in plan.summary()
