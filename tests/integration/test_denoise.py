"""PipeFusion denoising (issue 13): against the eager serial loop ``model → scheduler.step``."""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, serial_denoise, two_stage_plan
from tppc import examples
from tppc.errors import SpecError

diffusers = pytest.importorskip("diffusers")


def _two_stages(factory):
    model, args, kwargs = factory()
    one = tppc.compile(model, args, kwargs, executor="local", verify=False)  # validated below
    plan = two_stage_plan(one)
    return model, args, kwargs, one.with_plan(plan, executor="threads", verify=True)


def _case(name):
    """(factory, timestep arg, model kwargs, scheduler, output transform)."""
    half = lambda o: o[:, :4]  # noqa: E731  (drop the learned sigma)
    if name == "dit":
        return examples.dit, "t", lambda a, k: {"y": a[2]}, diffusers.DDIMScheduler, None
    rest = lambda a, k: {n: v for n, v in k.items() if n != "timestep"}  # noqa: E731
    return {
        "hf_dit": (examples.hf_dit, "timestep", rest, diffusers.DDIMScheduler, None),
        "hf_cogvideox": (_one_frame_video, "timestep", rest, diffusers.DDIMScheduler, None),
        "hf_flux": (examples.hf_flux, "timestep", rest,
                    diffusers.FlowMatchEulerDiscreteScheduler, None),
        "hf_hunyuan_dit": (examples.hf_hunyuan_dit, "timestep", rest,
                           diffusers.EulerDiscreteScheduler, half),
        "hf_pixart": (examples.hf_pixart, "timestep", rest,
                      diffusers.DPMSolverMultistepScheduler, half),
    }[name]


def _one_frame_video():
    return examples.hf_cogvideox(frames=1)


MODELS = ["dit", "hf_cogvideox", "hf_dit", "hf_flux", "hf_hunyuan_dit", "hf_pixart"]


@pytest.fixture(scope="module", params=MODELS)
def case(request):
    factory, arg, kw, sched_cls, transform = _case(request.param)
    model, args, kwargs, cp = _two_stages(factory)
    return model, args[0], kw(args, kwargs), arg, sched_cls, transform, cp


def _denoise(case, x, steps, warmup, patches=2):
    _model, _, kw, arg, sched_cls, transform, cp = case
    return cp.denoise(x, sched_cls(), steps, warmup_steps=warmup, patches=patches,
                      model_kwargs=kw, timestep_arg=arg, output_transform=transform)


def test_warmup_on_every_step_equals_the_serial_loop(case) -> None:
    model, x, kw, arg, sched_cls, transform, _ = case
    ref = serial_denoise(model, x, sched_cls(), 3, timestep_arg=arg, model_kwargs=kw,
                         output_transform=transform)
    assert_kernels_close(_denoise(case, x, 3, 3), ref, depth=3)


@pytest.mark.parametrize("executor", ["local", "threads"])
def test_a_second_call_does_not_see_the_first(case, executor) -> None:
    """Bit for bit on both executors: the worker threads borrow idle threads only while no
    other stage computes (:func:`tppc.pipefusion.jobs.idle_threads`; a count set beside a
    running GEMM once changed its result by an ulp on Flux, through MKL's one count)."""
    _model, x, kw, arg, sched_cls, transform, cp = case
    run = {"warmup_steps": 1, "patches": 2, "model_kwargs": kw, "timestep_arg": arg,
           "output_transform": transform, "executor": executor}
    cp.denoise(torch.randn_like(x) * 3, sched_cls(), 3, **run)
    other = torch.randn_like(x)
    fresh = cp.with_plan(cp.plan, verify=False)  # the same capture, fresh state
    again = fresh.denoise(other, sched_cls(), 3, **run)
    second = cp.denoise(other, sched_cls(), 3, **run)
    torch.testing.assert_close(second, again, rtol=0, atol=0)


def test_stale_patches_are_close_and_warmup_steps_bring_them_closer(case) -> None:
    model, x, kw, arg, sched_cls, transform, _ = case
    ref = serial_denoise(model, x, sched_cls(), 4, timestep_arg=arg, model_kwargs=kw,
                         output_transform=transform)
    errors = [float(((_denoise(case, x, 4, w) - ref) ** 2).mean()) for w in (1, 3)]
    scale = float((ref**2).mean())
    assert errors[0] > 0, "patches after the warm-up should attend to stale K/V"
    assert errors[0] < 0.1 * scale
    assert errors[1] < errors[0]


def test_threads_and_local_executors_agree() -> None:
    _model, args, _, cp = _two_stages(examples.dit)
    sched = diffusers.DDIMScheduler
    runs = [cp.denoise(args[0], sched(), 3, warmup_steps=1, patches=3, model_kwargs={"y": args[2]},
                       timestep_arg="t", executor=ex) for ex in ("local", "threads")]
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


def test_a_scheduler_that_is_not_element_wise_is_refused() -> None:
    _, args, _, cp = _two_stages(examples.dit)
    with pytest.raises(SpecError, match="element-wise"):
        cp.denoise(args[0], diffusers.DDPMScheduler(), 2, model_kwargs={"y": args[2]},
                   timestep_arg="t")


def test_warmup_on_the_workers_threads_restores_the_callers_threads() -> None:
    model, args, kwargs = examples.dit()
    plan = two_stage_plan(tppc.compile(model, args, kwargs, executor="local"))
    cp = tppc.compile(model, args, kwargs, executor="threads", threads_per_stage=1, plan=plan)
    kw, sched = {"y": args[2]}, diffusers.DDIMScheduler
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = cp.denoise(args[0], sched(), 3, warmup_steps=2, patches=2, model_kwargs=kw,
                         timestep_arg="t")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    ref = cp.denoise(args[0], sched(), 3, warmup_steps=2, patches=2, model_kwargs=kw,
                     timestep_arg="t", executor="local")
    assert_kernels_close(out, ref, depth=3)


def test_video_latents_of_several_frames_denoise_in_bands_of_rows_in_every_frame() -> None:
    model, args, kwargs, cp = _two_stages(examples.hf_cogvideox)  # 2 frames of 4x4 patches
    assert any(len(run.chunks) == 3 and run.warmup for run in cp.validation.runs)
    kw = {n: v for n, v in kwargs.items() if n != "timestep"}
    sched = diffusers.DDIMScheduler
    ref = serial_denoise(model, args[0], sched(), 3, model_kwargs=kw)
    out = cp.denoise(args[0], sched(), 3, warmup_steps=3, patches=3, model_kwargs=kw)
    assert_kernels_close(out, ref, depth=3)
    # stale bands: checked against one chunk after a full warm-up on the first such call
    stale = cp.denoise(args[0], sched(), 3, warmup_steps=1, patches=3, model_kwargs=kw)
    assert stale.isfinite().all() and not torch.allclose(stale, ref)
