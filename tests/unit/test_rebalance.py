"""Dynamic balancing (tppc.pipeline.rebalance): refit the device rates, re-plan, swap exactly.

The slow device is injected, never measured on the machine as it is: a trace whose stage-1
jobs last k times their prediction, or a stage-1 job that sleeps far longer than it computes.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.backends import torch_threads
from tppc.driver.planning import price_plan
from tppc.errors import SpecError
from tppc.pipeline.rebalance import Sample, predicted_busy, refit_rates


def _gpt():
    model, args, _ = examples.gpt(seq_len=64, n_layer=4)
    with torch.no_grad():
        eager = model(*args)
    return model, args, eager


def _compile(model, args):
    return tppc.compile(model, args, num_stages=2, chunks=4, verify=False)


def _front(cp, args):
    return cp.bind(tuple(args), {})[0]


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def _exact(out, eager) -> bool:
    """Equal to eager up to float rounding (chunked attention sums in another order)."""
    assert_kernels_close(_logits(out), _logits(eager))
    return True


def _share_on(plan, device: int) -> float:
    """Fraction of the plan's predicted busy time on ``device`` (rates as planned)."""
    busy = predicted_busy(plan)
    return sum(b for st, b in zip(plan.stages, busy) if st.device_index == device) / sum(busy)


def _slow_sample(cp, args, factor: float) -> Sample:
    """A sample of ``cp``'s program whose stage-1 jobs take ``factor`` times their predicted
    time and stage-0 jobs exactly theirs (the plan's own start/end: no machine in it)."""
    _, real = cp.traced_run(tuple(args), {})
    plan = real.program.plan
    trace = tuple((s, j, plan.start[s][j], plan.start[s][j]
                   + (plan.end[s][j] - plan.start[s][j]) * (factor if s == 1 else 1.0))
                  for s in range(len(plan.stages)) for j in range(len(plan.start[s])))
    return Sample(real.front, real.program, real.rates, trace)


@pytest.fixture(scope="module")
def gpt():
    return _gpt()


@pytest.fixture(scope="module")
def kept(gpt):
    """One pipeline for the tests that never swap its program."""
    model, args, _ = gpt
    return _compile(model, args)


def test_scaled_table_multiplies_one_devices_layer_times(gpt, kept):
    _, args, _ = gpt
    cp = kept
    from tppc.cost_models.layer_costs import build_cost_table

    ctx = cp.context
    table = build_cost_table(_front(cp, args).chunk, ctx.layers, "2xcpu", 64,
                             seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)
    scaled = table.scaled((1.0, 3.0))
    plain, times = table.times_at(16, 32), scaled.times_at(16, 32)
    np.testing.assert_allclose(times[0], plain[0])
    np.testing.assert_allclose(times[1], 3.0 * plain[1])
    assert scaled.links == table.links


def test_refit_rate_is_measured_over_predicted_busy_times_the_old_rate(gpt, kept):
    _, args, _ = gpt
    cp = kept
    sample = _slow_sample(cp, args, 4.0)
    old = Sample(sample.front, sample.program, (2.0, 0.5), sample.trace)
    assert refit_rates([sample], 2) == pytest.approx((1.0, 4.0))
    assert refit_rates([old], 2) == pytest.approx((2.0, 2.0))  # 2·1 and 0.5·4


def test_price_plan_at_unit_rates_reproduces_the_plans_prediction(gpt, kept):
    _, args, _ = gpt
    cp = kept
    again = price_plan(_front(cp, args), cp.options, cp.plan, (1.0, 1.0))
    assert again.latency == pytest.approx(cp.plan.latency, rel=1e-9)
    slower = price_plan(_front(cp, args), cp.options, cp.plan, (2.0, 2.0))
    assert slower.latency > 1.9 * cp.plan.latency  # links are not scaled


def test_rebalance_moves_layers_away_from_a_slow_device_and_stays_exact(gpt):
    model, args, eager = gpt
    cp = _compile(model, args)
    first = _logits(cp(*args))
    assert _exact(first, eager)
    before = cp.plan
    report = cp.refit([_slow_sample(cp, args, 4.0)], margin=0.1)
    assert report.swapped, report.table()
    assert report.rates_after == pytest.approx((1.0, 4.0))
    assert cp.rates == report.rates_after and cp.plan is report.plan_after
    assert report.predicted_after < report.predicted_before_refit
    # fewer of the model's (unscaled) predicted seconds sit on the slow device
    unscaled = price_plan(_front(cp, args), cp.options, cp.plan, (1.0, 1.0))
    assert _share_on(unscaled, 1) < _share_on(before, 1)
    assert cp.program(64).plan is cp.plan  # the swapped program runs the next call
    assert torch.equal(_logits(cp(*args)), first)  # same chunks, same ops: bit for bit


def test_rebalance_keeps_the_program_when_the_gain_is_below_the_margin(gpt, kept):
    _, args, eager = gpt
    cp = kept
    program = cp.program(64)
    report = cp.refit([_slow_sample(cp, args, 1.0)], margin=0.1)  # measured = predicted
    assert not report.swapped and cp.program(64) is program and cp.rates is None
    assert _exact(cp(*args), eager)


def test_cp_rebalance_measures_and_reports_before_and_after(gpt, kept):
    _, args, eager = gpt
    cp = kept
    report = cp.rebalance(args, calls=2, margin=1e9)  # never swaps: no after
    assert not report.swapped and report.measured_after is None and report.calls == 2
    assert report.measured_before > 0 and all(b > 0 for b in report.busy_measured)
    assert "kept" in report.table()
    assert _exact(cp(*args), eager)


def test_auto_rebalance_swaps_between_calls_away_from_a_sleeping_stage(gpt, monkeypatch):
    model, args, eager = gpt
    cp = _compile(model, args)
    before = cp.plan
    real = torch_threads.run_stage

    def slow_stage_one(stage, *rest):  # device 1 takes 5x its own compute, whatever the load
        start = time.perf_counter()
        out = real(stage, *rest)
        if stage.index == 1:
            time.sleep(4 * (time.perf_counter() - start))
        return out

    monkeypatch.setattr(torch_threads, "run_stage", slow_stage_one)
    cp.auto_rebalance(every=2, margin=0.1)
    outs = [_logits(cp(*args)) for _ in range(3)]
    assert all(_exact(o, eager) for o in outs)
    (report,) = cp.auto.reports
    assert report.swapped and report.calls == 2, report.table()
    assert report.rates_after[1] > 2 * report.rates_after[0]
    unscaled = price_plan(_front(cp, args), cp.options, cp.plan, (1.0, 1.0))
    assert _share_on(unscaled, 1) < _share_on(before, 1)
    cp.auto_rebalance(None)
    assert cp.auto is None


def test_concurrent_callers_see_the_old_or_the_new_program_exactly(gpt):
    model, args, eager = gpt
    cp = _compile(model, args)
    sample = _slow_sample(cp, args, 4.0)
    outs: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            for _ in range(6):
                outs.append(_logits(cp(*args)))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    report = cp.refit([sample], margin=0.1)
    for t in threads:
        t.join()
    assert not errors and report.swapped and len(outs) == 12
    assert all(_exact(o, eager) for o in outs)


def test_rebalance_refuses_a_given_plan_and_bad_settings(kept):
    cp = kept
    fixed = cp.with_plan(cp.plan, verify=False)
    with pytest.raises(SpecError, match="given plan.*plan=None"):
        fixed.rebalance()
    with pytest.raises(SpecError, match="calls=0"):
        cp.rebalance(calls=0)
    with pytest.raises(SpecError, match="every=0"):
        cp.auto_rebalance(every=0)
