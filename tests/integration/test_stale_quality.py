"""Stale K/V on trained DiTs (fixtures ``benchmarks/data/quality_dit_*.safetensors``, made by
``benchmarks/quality_dit.py``): the PSNR of one warm-up step, 2 patches, against the serial
loop of the eager model holds a bound, improves with every warm-up step, and the bound fails
when the stale K/V rows are replaced by zeros (so it measures the mechanism)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import quality_dit
import stale_quality

from tppc.runtime.denoise_jobs import Jobs
from tppc.runtime.denoise_quality import BALANCED_DB, quality_settings

STEPS, BATCH = 20, 4
BOUND_DB = {"eps": 0.0, "flow": 0.0}
"""PSNR (dB) at 1 warm-up step and 2 patches, held with a margin below the measured value
(BENCHMARKS.md, "Quality of the stale-K/V approximation")."""
BOUND_SSIM = 0.0


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {o: quality_dit.load(o) for o in ("eps", "flow")}


@pytest.mark.parametrize("objective", ["eps", "flow"])
def test_stale_patches_meet_the_bound_and_improve_with_warm_up(models, objective) -> None:
    rows = stale_quality.measure(models[objective], objective, STEPS, warmups=(1, 2, 4),
                                 patches=(2,), batch=BATCH)
    (_, _, p1, s1), (_, _, p2, _), (_, _, p4, _) = rows
    assert p1 >= BOUND_DB[objective] and s1 >= BOUND_SSIM, rows
    assert p1 < p2 < p4, rows


def _zero_stale_rows(original):
    """``Jobs.compute`` that first zeroes the K/V rows after the patch (the stale ones)."""

    def compute(self, s, act, received):
        stage = self.stage_of(act.chunk, s)
        buffers = self.state.buffers(stage)
        for spec in stage.buffers:
            t, start = buffers[spec.name], spec.rows(act.end)
            t.narrow(spec.axis, start, t.shape[spec.axis] - start).zero_()
        return original(self, s, act, received)

    return compute


def test_bound_fails_when_stale_kv_are_zeros(models, monkeypatch) -> None:
    monkeypatch.setattr(Jobs, "compute", _zero_stale_rows(Jobs.compute))
    ((_, _, p1, _),) = stale_quality.measure(models["eps"], "eps", STEPS, warmups=(1,),
                                             patches=(2,), batch=BATCH)
    assert p1 < BOUND_DB["eps"] - 5


def test_quality_option_meets_its_target(models) -> None:
    model = models["eps"]
    x = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    y = torch.arange(BATCH)
    ref = stale_quality.serial_loop(model, stale_quality.SCHEDULERS["eps"](), x, y, STEPS)
    cp = stale_quality.compiled(model, x, y)

    def run(quality):
        return cp.denoise(x, stale_quality.SCHEDULERS["eps"](), STEPS, model_kwargs={"y": y},
                          timestep_arg="t", quality=quality)

    torch.testing.assert_close(run("exact"), ref, rtol=1e-4, atol=1e-4)
    assert quality_dit.psnr(run("balanced"), ref) >= BALANCED_DB
    warm, cap = quality_settings("balanced", STEPS, 1)
    assert len(cp.denoise_plan(STEPS, warm, max_patches=cap).chunks) <= cap
