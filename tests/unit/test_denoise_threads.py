"""The fill and the drain of pipelined patches borrow the idle stages' intra-op threads
(:func:`tppc.pipefusion.jobs.idle_threads`): hand-computed thread counts per action,
the counts the stage workers really ran with, and the result against the serial reference."""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.pipefusion import jobs as denoise_jobs
from tppc.pipefusion.jobs import idle_threads
from tppc.pipefusion.step import StepCalls
from tppc.program.actions import Action

diffusers = pytest.importorskip("diffusers")


def _lists(stages: int, patches: int) -> tuple[tuple[Action, ...], ...]:
    """recv, compute, send per patch (the first stage receives nothing, the last sends
    nothing)."""
    out = []
    for s in range(stages):
        acts: list[Action] = []
        for m in range(patches):
            if s:
                acts.append(Action(0, m, m, m + 1, "recv", s - 1))
            acts.append(Action(0, m, m, m + 1, "compute", -1))
            if s < stages - 1:
                acts.append(Action(0, m, m, m + 1, "send", s + 1))
        out.append(tuple(acts))
    return tuple(out)


def test_the_fill_and_the_drain_take_every_stages_threads_while_no_other_stage_computes(
        ) -> None:
    lists = _lists(3, 3)  # stage 0: C S C S C S; stage 1: R C S R C S R C S; stage 2: R C ...
    assert idle_threads(2, lists, 0) == {0: 6, 1: 2}
    assert idle_threads(2, lists, 1) == {1: 2}  # a middle stage: others compute beside it
    assert idle_threads(2, lists, 2) == {1: 2, 5: 6}
    assert idle_threads((1, 2, 3), lists, 0) == {0: 6, 1: 1}
    assert idle_threads((1, 2, 3), lists, 2) == {1: 3, 5: 6}
    assert idle_threads(1, _lists(2, 1), 0) == {0: 1}  # one patch: no fill to share
    assert idle_threads(1, _lists(2, 1), 1) == {1: 1}  # set at its compute, not at start
    assert idle_threads(None, lists, 1) == {}  # torch's own threads: left alone
    # a stage of two workers (a CFG group): they compute together, nobody borrows
    assert idle_threads(1, _lists(2, 3), 0, stages=(0, 0)) == {0: 1}
    assert idle_threads((1, 1), _lists(2, 3), 1, stages=(0, 0)) == {1: 1}
    assert idle_threads((1, None), lists[:2], 1) == {}  # a worker off the CPU: left alone


def test_stage_workers_run_the_fill_and_drain_on_all_threads_and_stay_exact(monkeypatch
                                                                             ) -> None:
    model, args, kwargs = examples.dit()
    cp = tppc.compile(model, args, kwargs, executor="threads", threads_per_stage=1,
                      num_stages=2, verify=False)
    assert len(cp.plan.stages) == 2
    kw = {"y": args[2]}
    seen: list[tuple[int, int, int]] = []
    real = denoise_jobs.run_stage

    def spy(stage, call, state, start, end, received):
        seen.append((stage.index, start, torch.get_num_threads()))
        return real(stage, call, state, start, end, received)

    ref = cp.denoise(args[0], diffusers.DDIMScheduler(), 2, warmup_steps=1, patches=3,
                     model_kwargs=kw, timestep_arg="t", executor="local")
    monkeypatch.setattr(denoise_jobs, "run_stage", spy)
    out = cp.denoise(args[0], diffusers.DDIMScheduler(), 2, warmup_steps=1, patches=3,
                     model_kwargs=kw, timestep_arg="t")
    starts = sorted({start for _, start, _ in seen})
    assert sorted(seen) == sorted([(0, starts[0], 2), (0, starts[1], 1), (0, starts[2], 1),
                                   (1, starts[0], 1), (1, starts[1], 1), (1, starts[2], 2)])
    assert_kernels_close(out, ref, depth=2)
    # one call per step (the drop-in): the second call's patches fill and drain the same way
    seen.clear()
    step = (args[0], args[1] * 0 + 500, args[2])
    outs = {}
    for executor in ("local", "threads"):
        calls = StepCalls(cp, warmup_steps=1, patches=3, executor=executor)
        calls(args, {})  # warm
        outs[executor] = calls(step, {})
    threaded = [(s, n) for s, _, n in seen[-6:]]
    assert sorted(threaded) == [(0, 1), (0, 1), (0, 2), (1, 1), (1, 1), (1, 2)]
    assert_kernels_close(outs["threads"], outs["local"])
