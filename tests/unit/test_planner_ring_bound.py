"""The diffusion ring bound (tppc.planner.ring_bound) and the ring's fast makespan
(tppc.planner.refine.ring_makespan): below the brute-force optimum over every placement and
every grid split (hand-written flow shop), equal to the simulated schedule."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hst

from tests.unit.planner_helpers import hand_makespan, table
from tppc.cost_models.table import CostTable, LayerCost
from tppc.planner import plan_for, plan_from_costs
from tppc.planner.evaluate import diffusion_latency
from tppc.planner.refine import ring_makespan
from tppc.planner.ring_bound import ring_bound
from tppc.planner.workload import Workload
from tppc.program.schedule import simulate


def _dit_table(rng: np.random.Generator, n_layers: int, n_dev: int, seq: int) -> CostTable:
    """Bidirectional layers (time depends on the patch size only) with a per-patch overhead
    that makes small patches dear, random device speeds and links."""
    t = table(num_layers=n_layers, speeds=(1.0,) * n_dev, seq_len=seq,
              link_bw=float(rng.uniform(1e6, 1e9)))
    speeds = rng.uniform(0.5, 2.0, n_dev)
    scales = rng.uniform(0.2, 3.0, n_layers)
    fixed = float(rng.uniform(0.0, 3e-4))

    def fn(scale: float, speed: float):
        return lambda c, p: (fixed + 1e-6 * scale * np.asarray(c, float)) / speed

    layers = tuple(tuple(LayerCost(name=f"layer{j}", time=fn(scales[j], speeds[d]),
                                   weight_bytes=1, kv_bytes_per_token=0,
                                   act_bytes_per_token=1000)
                         for j in range(n_layers)) for d in range(n_dev))
    return CostTable(t.device_names, t.capacities, layers, t.links, seq, False)


def _brute_force(t: CostTable, num_stages: int, g: int, steps: int) -> float:
    """Least hand-simulated latency (pipelined steps only) over every placement and split."""
    n = t.seq_len // g
    best = np.inf
    for inner in itertools.combinations(range(1, t.num_layers), num_stages - 1):
        cuts = (0, *inner, t.num_layers)
        for mask in range(2 ** (n - 1)):
            bounds = [0, *(g * (k + 1) for k in range(n - 1) if mask >> k & 1), t.seq_len]
            best = min(best, hand_makespan(t, cuts, bounds, steps=steps))
    return best


@settings(max_examples=12, deadline=None)
@given(hst.integers(0, 10**6))
def test_ring_bound_is_below_the_brute_force_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_layers, n_dev = int(rng.integers(2, 5)), int(rng.integers(2, 4))
    n_dev, steps = min(n_dev, n_layers), int(rng.integers(1, 4))
    t = _dit_table(rng, n_layers, n_dev, 768)
    optimum = _brute_force(t, n_dev, 128, steps)
    assert 0 < ring_bound(t, n_dev, 128, steps) <= optimum * (1 + 1e-12)
    plan = plan_from_costs(t, granularity=128, num_stages=n_dev,
                           workload=Workload(kind="diffusion", steps=steps))
    assert plan.lower_bound <= optimum * (1 + 1e-12) <= plan.latency * (1 + 1e-12)


def test_ring_bound_sees_the_ring_the_one_patch_bound_misses() -> None:
    # 4 equal layers on 4 stages, no per-patch cost: one patch is the least work, but it
    # crosses all 4 stages in every step (4·K layer-times); 4 patches run K·1 + fill
    rng = np.random.default_rng(0)
    t = _dit_table(rng, 4, 4, 1024)
    layers = tuple(tuple(LayerCost(name=lc.name, time=lambda c, p: 1e-6 * np.asarray(c, float),
                                   weight_bytes=1, kv_bytes_per_token=0, act_bytes_per_token=0)
                         for lc in row) for row in t.layers)
    t = CostTable(t.device_names, t.capacities, layers, t.links, 1024, False)
    got = ring_bound(t, 4, 256, 10)
    # r* = 10·4·c·1e-6 for the largest patch c; W = 10·1024e-6 + head + tail ≥ 10.24 ms;
    # the split into 4 patches of 256: r* = 10.24 ms, W = 10.24 ms + 3·0.256 ms
    assert got >= 10 * 1024e-6
    assert got <= hand_makespan(t, (0, 1, 2, 3, 4), (0, 256, 512, 768, 1024), steps=10)


@settings(max_examples=40, deadline=None)
@given(hst.integers(0, 10**6))
def test_ring_makespan_is_the_simulated_makespan(seed: int) -> None:
    rng = np.random.default_rng(seed)
    s, m, steps = int(rng.integers(1, 5)), int(rng.integers(1, 7)), int(rng.integers(1, 4))
    times, links, back = rng.random((s, m)), rng.random((s - 1, m)), rng.random(m)
    want = simulate(times, links, steps=steps, back=back).makespan
    assert abs(ring_makespan(times, links, back, steps) - want) <= 1e-12 * want


def test_diffusion_latency_is_the_plans_latency() -> None:
    rng = np.random.default_rng(3)
    t = _dit_table(rng, 5, 3, 1024)
    work = Workload(kind="diffusion", steps=6, warmup_steps=1)
    for cuts, bounds in [((0, 2, 3, 5), (0, 256, 640, 1024)), ((0, 1, 4, 5), (0, 1024))]:
        want = plan_for(t, cuts, bounds, work, granularity=128).latency
        assert abs(diffusion_latency(t, cuts, bounds, work) - want) <= 1e-12 * want
