"""The improvement-only phases stop near a lower bound: never more than the ratio off the
brute-force optimum, and never before a cut inside a block could beat the whole-layer bound."""

from __future__ import annotations

import itertools

import numpy as np

from tests.unit.planner_helpers import hand_makespan, table
from tppc.planner.joint import plan_from_costs
from tppc.planner.polish import NEAR_BOUND

SKIPPED = "improvements skipped"
RATIO = 1.12  # these 6-chunk toys sit 1.00-1.22 off their bound: the rule stops some


def _optimum(t, num_stages: int, g: int) -> float:
    """Least simulated latency over every placement and every grid split (hand oracle)."""
    n, best = t.seq_len // g, np.inf
    for inner in itertools.combinations(range(1, t.num_layers), num_stages - 1):
        cuts = (0, *inner, t.num_layers)
        for mask in range(2 ** (n - 1)):
            bounds = [0, *(g * (k + 1) for k in range(n - 1) if mask >> k & 1), t.seq_len]
            best = min(best, hand_makespan(t, cuts, bounds))
    return best


def test_a_plan_that_stops_near_its_bound_is_within_the_ratio_of_the_optimum() -> None:
    stopped = 0
    for seed in range(12):
        rng = np.random.default_rng(seed)
        layers = int(rng.integers(2, 5))
        t = table(num_layers=layers, speeds=(1.0, float(rng.uniform(0.5, 2.0))), seq_len=768,
                  link_bw=float(rng.uniform(1e9, 1e11)),
                  layer_scales=tuple(rng.uniform(0.5, 2.0, layers)))
        plan = plan_from_costs(t, granularity=128, num_stages=2, near_bound=RATIO)
        full = plan_from_costs(t, granularity=128, num_stages=2, near_bound=1.0)
        optimum = _optimum(t, 2, 128)
        assert SKIPPED not in full.solver.detail
        assert optimum <= plan.latency * (1 + 1e-12)
        if SKIPPED in plan.solver.detail:
            stopped += 1
            assert plan.latency <= RATIO * plan.lower_bound * (1 + 1e-12)  # the rule
            assert plan.latency <= RATIO * optimum * (1 + 1e-12)  # what it promises
        else:  # the phases ran as with no early stop
            assert plan.boundaries == full.boundaries and plan.latency == full.latency
    assert stopped >= 3  # the rule is exercised, not vacuous


def test_the_default_ratio_is_small() -> None:
    assert 1.0 < NEAR_BOUND <= 1.05
