"""The quality option of ``cp.denoise``: targets mapped to warm-up and a patch cap, and the
planner's patch count held to the cap (``Workload.max_patches``)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from planner_helpers import hand_makespan

from tppc.cost_models.table import CostTable, LayerCost, LinkCost
from tppc.errors import PlanError, SpecError
from tppc.pipefusion.quality import (
    BALANCED_DB,
    MEASURED,
    MEASURED_STEPS,
    QualityChoice,
    quality_settings,
)
from tppc.planner import Workload, plan_from_costs


def _brute(target: float) -> tuple[int, int] | None:
    """Fewest measured warm-up steps meeting ``target``, then the most patches p such that
    every measured count <= p meets it (by enumeration)."""
    best = None
    for warm in {r.warmup_steps for r in MEASURED}:
        ok = [r.patches for r in MEASURED if r.warmup_steps == warm and all(
            s.psnr_db >= target for s in MEASURED
            if s.warmup_steps == warm and s.patches <= r.patches)]
        if ok and (best is None or warm < best[0]):
            best = (warm, max(ok))
    return best


def test_table_improves_with_warm_up() -> None:
    for patches in {r.patches for r in MEASURED}:
        rows = sorted((r for r in MEASURED if r.patches == patches), key=lambda r: r.warmup_steps)
        assert all(a.psnr_db < b.psnr_db for a, b in itertools.pairwise(rows))


@pytest.mark.parametrize("target", sorted({r.psnr_db for r in MEASURED}
                                          | {BALANCED_DB, 0.0, 1e3}))
def test_target_picks_the_least_warm_up_that_meets_it(target: float) -> None:
    got = quality_settings(target, MEASURED_STEPS, 1)
    want = _brute(target)
    if want is None:
        assert got == QualityChoice(MEASURED_STEPS, None)
    else:
        assert got == QualityChoice(max(1, want[0]), want[1])


def test_named_qualities_and_scaling() -> None:
    assert quality_settings("exact", 8, 1) == QualityChoice(8, None)
    assert quality_settings("fast", 8, 3) == QualityChoice(3, None)
    assert quality_settings(None, 8, 2, patches=16) == QualityChoice(2, None)
    assert quality_settings("balanced", 20, 1) == quality_settings(BALANCED_DB, 20, 1)
    warm, cap = quality_settings(BALANCED_DB, 40, 1)
    w20, _ = quality_settings(BALANCED_DB, 20, 1)
    assert warm == min(40, math.ceil(w20 * 40 / 20)) and cap == quality_settings(
        BALANCED_DB, 20, 1).max_patches
    assert quality_settings(BALANCED_DB, 20, 19).warmup_steps >= 19  # never lowered


def test_bad_quality_and_patches_above_the_cap_are_refused() -> None:
    with pytest.raises(SpecError, match="quality='best'"):
        quality_settings("best", 20, 1)
    with pytest.raises(SpecError, match="quality=nan"):
        quality_settings(float("nan"), 20, 1)
    low = min(r.psnr_db for r in MEASURED)
    cap = quality_settings(low, 20, 1).max_patches
    with pytest.raises(SpecError, match=f"at most {cap} patches"):
        quality_settings(low, 20, 1, patches=cap + 1)


def _table(stages: int, fixed: float) -> CostTable:
    def time(c, p):
        return fixed + 1e-6 * np.asarray(c, dtype=float) + 0 * np.asarray(p, dtype=float)

    layers = tuple(tuple(LayerCost(name=f"layer{j}", time=time, weight_bytes=10**6,
                                   kv_bytes_per_token=100, act_bytes_per_token=1000)
                         for j in range(stages)) for _ in range(stages))
    return CostTable(device_names=("dev",) * stages, capacities=(10**12,) * stages,
                     layers=layers, links=(LinkCost(latency=1e-6, bandwidth=1e12),) * (stages - 1),
                     seq_len=1024, causal=False)


def test_planner_holds_the_patch_cap() -> None:
    table = _table(4, fixed=1e-3)  # the fastest plan fills the ring: >= 4 patches
    free = plan_from_costs(table, workload=Workload(kind="diffusion", steps=10), granularity=64)
    assert len(free.chunks) >= 4
    for cap in (1, 2, 3):
        capped = plan_from_costs(table, granularity=64,
                                 workload=Workload(kind="diffusion", steps=10, max_patches=cap))
        assert len(capped.chunks) <= cap
        assert capped.latency >= free.latency * (1 - 1e-9)
        cuts = (0, *(st.layer_end for st in capped.stages))
        assert capped.latency == pytest.approx(
            hand_makespan(table, cuts, capped.boundaries, 10), rel=1e-12)


def test_workload_max_patches_is_checked() -> None:
    with pytest.raises(PlanError, match="max_patches=2"):
        Workload(max_patches=2)  # causal prefill has no patches
    with pytest.raises(PlanError, match="max_patches=0"):
        Workload(kind="diffusion", steps=4, max_patches=0)
