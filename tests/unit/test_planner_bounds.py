"""The placement bound (tppc.planner.bounds): hand-computed, below every plan, below the
brute-force optimum over every placement and every grid split."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from tests.unit.planner_helpers import hand_makespan, table
from tppc.cost_models.table import CostTable, LayerCost
from tppc.planner import plan_for, plan_from_costs
from tppc.planner.bounds import placement_bound


def _linear(num_layers: int, stages: int, seq_len: int, rate: float = 1e-3) -> CostTable:
    """Layers costing ``rate · c`` (no overhead), fast links: the bound is tight."""
    t = table(num_layers=num_layers, speeds=(1.0,) * stages, seq_len=seq_len, link_bw=1e30)
    layers = tuple(tuple(LayerCost(name=lc.name, time=lambda c, p: rate * np.asarray(c, float),
                                   weight_bytes=1, kv_bytes_per_token=0, act_bytes_per_token=0)
                         for lc in row) for row in t.layers)
    return CostTable(t.device_names, t.capacities, layers, tuple(
        type(lk)(latency=0.0, bandwidth=1e30) for lk in t.links), seq_len, True)


def test_bound_is_hand_computed_and_tight_on_linear_layers() -> None:
    # 2 layers of rate·c on 2 devices, L = 1024, g = 128: one layer per stage; stage 1 waits
    # for the first 128 tokens of layer 0, stage 0 is followed by the last 128 on layer 1.
    t = _linear(2, 2, 1024)
    assert placement_bound(t, 2, 128) == pytest.approx(1e-3 * (1024 + 128))
    plan = plan_for(t, (0, 1, 2), tuple(range(0, 1025, 128)), granularity=128)
    assert plan.latency == pytest.approx(plan.lower_bound)  # chunks of g reach it
    # 4 layers on 2 stages: 2 + 2 layers, so 2·1024 + 2·128 (one stage's work + 2 edges)
    assert placement_bound(_linear(4, 2, 1024), 2, 128) == pytest.approx(1e-3 * (2048 + 256))


def test_bound_is_at_least_serial_over_stages() -> None:
    t = table(num_layers=6, speeds=(1.0, 1.0, 1.0), seq_len=2048)
    serial = sum(float(lc.time(np.array([2048.0]), np.zeros(1))[0]) for lc in t.layers[0])
    assert placement_bound(t, 3, 128) > serial / 3


def _brute_force(t: CostTable, num_stages: int, g: int) -> float:
    """Least simulated latency over every placement and every grid split (hand oracle)."""
    n = t.seq_len // g
    best = np.inf
    for inner in itertools.combinations(range(1, t.num_layers), num_stages - 1):
        cuts = (0, *inner, t.num_layers)
        for mask in range(2 ** (n - 1)):
            bounds = [0, *(g * (k + 1) for k in range(n - 1) if mask >> k & 1), t.seq_len]
            best = min(best, hand_makespan(t, cuts, bounds))
    return best


@settings(max_examples=15, deadline=None)
@given(hst.integers(0, 10**6))
def test_bound_is_below_the_brute_force_optimum_and_the_planner(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_layers, n_dev = int(rng.integers(2, 5)), int(rng.integers(2, 4))
    n_dev = min(n_dev, n_layers)
    t = table(num_layers=n_layers, speeds=tuple(rng.uniform(0.3, 3.0, n_dev)), seq_len=768,
              link_bw=float(rng.uniform(1e8, 1e11)),
              layer_scales=tuple(rng.uniform(0.1, 5.0, n_layers)))
    optimum = _brute_force(t, n_dev, 128)
    plan = plan_from_costs(t, granularity=128, num_stages=n_dev)
    assert plan.lower_bound <= optimum * (1 + 1e-12)
    assert optimum <= plan.latency * (1 + 1e-12)
    assert plan.latency >= plan.lower_bound * (1 - 1e-12)


@settings(max_examples=25, deadline=None)
@given(hst.integers(0, 10**6))
def test_every_random_plan_is_above_the_bound(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_layers, n_dev = int(rng.integers(1, 7)), int(rng.integers(1, 4))
    n_dev = min(n_dev, n_layers)
    seq = int(rng.choice([512, 1024, 2048]))
    t = table(num_layers=n_layers, speeds=tuple(rng.uniform(0.2, 3.0, n_dev)), seq_len=seq,
              link_bw=float(rng.uniform(1e8, 1e12)),
              layer_scales=tuple(rng.uniform(0.1, 5.0, n_layers)))
    inner = sorted(rng.choice(np.arange(1, n_layers), n_dev - 1, replace=False)) \
        if n_dev > 1 else []
    grid = np.arange(128, seq, 128)
    cut = sorted(rng.choice(grid, int(rng.integers(0, grid.size + 1)), replace=False))
    plan = plan_for(t, (0, *map(int, inner), n_layers), (0, *map(int, cut), seq),
                    granularity=128)
    assert plan.latency >= plan.lower_bound * (1 - 1e-12)
