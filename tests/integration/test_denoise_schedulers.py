"""``cp.denoise`` speaks diffusers' scheduler protocol (issue 21): ``set_timesteps``
arguments (``mu``, ``sigmas``, ``timesteps``), a timestep transform, the scheduler's timestep
dtype, and schedulers accepted by what their step does (element-wise per latent position),
never by class name. The oracle is the loop of a diffusers pipeline written out here, on the
eager model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, serial_denoise
from tppc import examples
from tppc.pipefusion.schedulers import check_elementwise, start_timesteps

diffusers = pytest.importorskip("diffusers")


def _loop(model, x, scheduler, kwargs, transform=None, steps=None, **set_kw):
    """A diffusers pipeline's loop (Flux's with ``transform = t / 1000``)."""
    return serial_denoise(model, x, scheduler, steps, model_kwargs=kwargs,
                          timestep_transform=transform, **set_kw)


@pytest.fixture(scope="module")
def flux():
    model, args, kwargs = examples.hf_flux()
    cp = tppc.compile(model, args, kwargs, executor="local", num_stages=2)
    return model, args[0], {k: v for k, v in kwargs.items() if k != "timestep"}, cp


@pytest.fixture(scope="module")
def dit():
    """diffusers' DiT compiled with a float timestep example (the schedulers' dtypes vary)."""
    model, args, kwargs = examples.hf_dit()
    kwargs = {**kwargs, "timestep": torch.tensor([10.0])}
    cp = tppc.compile(model, args, kwargs, executor="local", num_stages=2)
    return model, args[0], {k: v for k, v in kwargs.items() if k != "timestep"}, cp


def test_flow_matching_with_dynamic_shifting_mu_sigmas_and_a_timestep_transform(flux) -> None:
    """Flux's loop: ``sigmas`` and ``mu`` to ``set_timesteps``, ``t / 1000`` to the model."""
    model, x, kw, cp = flux
    sched = diffusers.FlowMatchEulerDiscreteScheduler
    n, mu = 4, 0.8
    sigmas = np.linspace(1.0, 1 / n, n)

    def transform(t):
        return t.to(x.dtype) / 1000

    want = _loop(model, x, sched(use_dynamic_shifting=True), kw, transform=transform,
                 sigmas=sigmas, mu=mu)
    got = cp.denoise(x, sched(use_dynamic_shifting=True), n, warmup_steps=None,
                     model_kwargs=kw, sigmas=sigmas, mu=mu, timestep_transform=transform)
    assert_kernels_close(got, want, depth=n)
    stale = cp.denoise(x, sched(use_dynamic_shifting=True), n, warmup_steps=1, patches=2,
                       model_kwargs=kw, sigmas=sigmas, mu=mu, timestep_transform=transform)
    assert stale.shape == want.shape and not torch.equal(stale, want)  # stale K/V: close only


def test_dynamic_shifting_without_mu_names_the_argument(flux) -> None:
    _, x, kw, cp = flux
    with pytest.raises(ValueError, match="mu"):
        cp.denoise(x, diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True), 2,
                   model_kwargs=kw)


@pytest.mark.parametrize("name", ["EulerDiscreteScheduler", "DDIMScheduler",
                                  "DPMSolverMultistepScheduler"])
def test_each_scheduler_equals_the_loop_in_its_own_timestep_dtype(dit, name) -> None:
    """Float (Euler) or int64 (DDIM, DPM-Solver) timesteps into a float-compiled timestep:
    no timestep to pass by hand; every step warm is the loop to the kernel tolerance."""
    model, x, kw, cp = dit
    sched = getattr(diffusers, name)
    want = _loop(model, x, sched(), kw, steps=3)
    got = cp.denoise(x, sched(), 3, warmup_steps=3, model_kwargs=kw)
    assert_kernels_close(got, want, depth=3)


def test_custom_timesteps_go_to_set_timesteps(dit) -> None:
    model, x, kw, cp = dit
    sched = diffusers.EulerDiscreteScheduler
    want = _loop(model, x, sched(), kw, timesteps=[900, 500, 100])
    got = cp.denoise(x, sched(), None, warmup_steps=None, model_kwargs=kw,
                     timesteps=[900, 500, 100])
    assert_kernels_close(got, want, depth=3)


def test_an_argument_the_scheduler_does_not_take_is_named(dit) -> None:
    _, x, kw, cp = dit
    with pytest.raises(tppc.SpecError, match="DDIMScheduler.set_timesteps takes no mu="):
        cp.denoise(x, diffusers.DDIMScheduler(), 2, model_kwargs=kw, mu=0.5)


def test_fractional_timesteps_into_an_integer_input_are_captured_again_for_their_dtype(
        monkeypatch) -> None:
    """DiT compiled with an int64 example timestep, denoised by Euler (float32 timesteps,
    fractional): the model is captured again for float32 (one more capture), and every step
    warm equals the loop."""
    model, args, kwargs = examples.hf_dit()
    cp = tppc.compile(model, args, kwargs, executor="local", num_stages=2)
    kw = {k: v for k, v in kwargs.items() if k != "timestep"}
    captured, real = [], tppc.pipeline.captures.capture_front_end

    def counted(model, args, kwargs, **kw):
        captured.append(kwargs["timestep"].dtype)
        return real(model, args, kwargs, **kw)

    monkeypatch.setattr("tppc.pipeline.captures.capture_front_end", counted)
    want = _loop(model, args[0], diffusers.EulerDiscreteScheduler(), kw, steps=3)
    got = cp.denoise(args[0], diffusers.EulerDiscreteScheduler(), 3, warmup_steps=None,
                     model_kwargs=kw)
    assert_kernels_close(got, want, depth=3)
    assert captured == [torch.float32]
    cp.denoise(args[0], diffusers.EulerDiscreteScheduler(), 3, warmup_steps=1, patches=2,
               model_kwargs=kw)
    assert captured == [torch.float32]  # cached


class _RenamedEuler(diffusers.EulerDiscreteScheduler):
    """Euler under a name no list knows: accepted for what its step does."""


class _MixingDDIM(diffusers.DDIMScheduler):
    """DDIM whose step subtracts the sample's mean: every element depends on all the others."""

    def step(self, model_output, timestep, sample, **kwargs):
        out = super().step(model_output, timestep, sample, **kwargs)
        return type(out)(prev_sample=out.prev_sample - out.prev_sample.mean(),
                         pred_original_sample=out.pred_original_sample)


def test_a_scheduler_is_accepted_by_what_its_step_does(dit) -> None:
    model, x, kw, cp = dit
    want = _loop(model, x, diffusers.EulerDiscreteScheduler(), kw, steps=3)
    got = cp.denoise(x, _RenamedEuler(), 3, warmup_steps=3, model_kwargs=kw)
    assert_kernels_close(got, want, depth=3)
    cp.denoise(x, _RenamedEuler(), 3, warmup_steps=1, patches=2, model_kwargs=kw)


@pytest.mark.parametrize("scheduler", [_MixingDDIM(), diffusers.DDPMScheduler(),
                                       diffusers.EulerAncestralDiscreteScheduler(),
                                       diffusers.DDIMScheduler(thresholding=True,
                                                               sample_max_value=10.0)],
                         ids=["mixing", "ddpm", "ancestral", "thresholding"])
def test_a_step_that_is_not_element_wise_is_refused_by_the_property(dit, scheduler) -> None:
    _, x, kw, cp = dit
    with pytest.raises(tppc.SpecError, match="not element-wise per latent position"):
        cp.denoise(x, scheduler, 3, warmup_steps=1, patches=2, model_kwargs=kw)


def test_any_scheduler_runs_when_every_step_is_warm(dit) -> None:
    """No patch is stepped alone: the property is not needed (DDPM draws its noise as the
    loop does, from the same global generator)."""
    model, x, kw, cp = dit
    torch.manual_seed(1)
    want = _loop(model, x, diffusers.DDPMScheduler(), kw, steps=3)
    torch.manual_seed(1)
    got = cp.denoise(x, diffusers.DDPMScheduler(), 3, warmup_steps=None, model_kwargs=kw)
    assert_kernels_close(got, want, depth=3)


def test_the_property_check_leaves_the_scheduler_and_the_random_state_alone() -> None:
    sched = diffusers.DDPMScheduler()
    start_timesteps(sched, 3)
    x = torch.randn(1, 4, 8, 8)
    before = (torch.random.get_rng_state(), dict(vars(sched)))
    with pytest.raises(tppc.SpecError):
        check_elementwise(sched, x, 2, [(0, 4), (4, 8)])
    assert torch.equal(torch.random.get_rng_state(), before[0])
    assert vars(sched).keys() == before[1].keys()
    assert all(v is before[1][k] for k, v in vars(sched).items())
