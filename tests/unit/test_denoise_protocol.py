"""``cp.denoise`` calls what diffusers' loop calls (issue 18): ``scale_model_input`` on the
model's input of every step (a patch's rows with that patch's scheduler copy), then
``step``. The oracle is that loop written out here, on the eager model."""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, serial_denoise, two_stage_plan
from tppc import examples

diffusers = pytest.importorskip("diffusers")

SCHEDULERS = ["EulerDiscreteScheduler", "DDIMScheduler", "DPMSolverMultistepScheduler"]


@pytest.fixture(scope="module", params=["dit", "hf_dit"])
def case(request):
    """(model, latents, timestep arg, model kwargs, two-stage pipeline per timestep dtype:
    Euler's timesteps are floats, DDIM's ints, and a pipeline takes its example's dtype)."""
    if request.param == "dit":
        model, args, kwargs = examples.dit(size=8, depth=2)
        arg, kw = "t", {"y": args[2]}
    else:
        model, args, kwargs = examples.hf_dit()
        arg, kw = "timestep", {k: v for k, v in kwargs.items() if k != "timestep"}
    plan = two_stage_plan(tppc.compile(model, args, kwargs, executor="local"))
    pipelines = {}

    def pipeline(dtype: torch.dtype) -> tppc.CompiledPipeline:
        if dtype not in pipelines:
            a, k = list(args), dict(kwargs)
            if arg == "t":
                a[1] = a[1].to(dtype)
            else:
                k[arg] = k[arg].to(dtype)
            pipelines[dtype] = tppc.compile(model, tuple(a), k, executor="local", plan=plan)
        return pipelines[dtype]

    return model, args[0], arg, kw, pipeline


def _denoise(case, scheduler, warmup, patches):
    _, x, arg, kw, pipeline = case
    cp = pipeline(scheduler.timesteps.dtype if scheduler.timesteps is not None
                  else torch.int64)
    return cp.denoise(x, scheduler, 3, warmup_steps=warmup, patches=patches,
                      model_kwargs=kw, timestep_arg=arg)


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("warmup,patches", [(3, 2), (1, 1)])
def test_denoise_equals_the_diffusers_loop(case, name, warmup, patches) -> None:
    """Every step warmed up, or one patch after one warm-up step (the patch path: its
    scheduler copy scales and steps the whole image): both are the loop exactly."""
    model, x, arg, kw, _ = case
    sched = getattr(diffusers, name)
    want = serial_denoise(model, x, sched(), 3, timestep_arg=arg, model_kwargs=kw)
    scheduler = sched()
    scheduler.set_timesteps(3)  # the timestep dtype picks the pipeline
    got = _denoise(case, scheduler, warmup, patches)
    assert_kernels_close(got, want, depth=3)


def _spy(log: list, name: str, real):
    """``real`` (a scheduler method) logging ``(scheduler id, name, timestep, rows)``."""
    def spy(self, *args, **kwargs):
        sample = args[0] if name == "scale_model_input" else args[2]
        log.append((id(self), name, float(args[1]), sample.shape[-2]))
        return real(self, *args, **kwargs)
    return spy


def test_each_patch_copy_scales_then_steps_its_own_rows(case, monkeypatch) -> None:
    euler = diffusers.EulerDiscreteScheduler
    log: list = []
    # the element-wise check steps copies of its own (ids of freed copies may come again)
    monkeypatch.setattr("tppc.pipefusion.denoise.check_elementwise", lambda *a: None)
    for name in ("scale_model_input", "step"):
        monkeypatch.setattr(euler, name, _spy(log, name, getattr(euler, name)))
    x = case[1]
    sched = euler()
    sched.set_timesteps(3)
    _denoise(case, sched, 1, 2)
    t0, t1, t2 = (float(t) for t in sched.timesteps)
    h = x.shape[-2]
    assert [e[1:] for e in log if e[0] == id(sched)] == [("scale_model_input", t0, h),
                                                          ("step", t0, h)]
    copies = list(dict.fromkeys(e[0] for e in log if e[0] != id(sched)))
    assert len(copies) == 2
    for copy in copies:  # each patch: scale and step of its rows, in the loop's order
        calls = [e[1:3] for e in log if e[0] == copy]
        assert calls == [("scale_model_input", t1), ("step", t1), ("scale_model_input", t2),
                         ("step", t2)]
    assert sum(e[3] for e in log if e[0] in copies and e[1] == "step") == 2 * h
