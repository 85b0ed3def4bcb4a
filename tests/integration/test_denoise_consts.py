"""``denoise``: cross-attention text K/V computed once per call, classifier-free guidance as
a batch of two (issue 13), against the eager serial loop and counted projections."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tppc
from tests.oracles import assert_kernels_close, serial_denoise, two_stage_plan
from tppc import examples

diffusers = pytest.importorskip("diffusers")


def _two_stages(model, args, kwargs, executor="threads"):
    one = tppc.compile(model, args, kwargs, executor="local", verify=False)  # validated below
    plan = two_stage_plan(one)
    return one.with_plan(plan, executor=executor, verify=True)


class _CountReads(TorchDispatchMode):
    """Counts the ops that read ``weight``'s storage (a projection by that weight)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.ptr, self.calls = weight.data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*args, *(kwargs or {}).values()]
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm,
                                   torch.ops.aten.linear, torch.ops.aten.bmm) and any(
                isinstance(a, torch.Tensor) and a.data_ptr() == self.ptr for a in flat):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _pixart_serial(model, x, steps, kw, transform):
    return serial_denoise(model, x, diffusers.DPMSolverMultistepScheduler(), steps,
                          model_kwargs=kw, output_transform=transform)


def _half(o):
    return o[:, :4]


def test_text_kv_projection_runs_once_per_call_and_results_are_exact() -> None:
    model, args, kwargs = examples.hf_pixart()
    cp = _two_stages(model, args, kwargs, executor="local")
    kw = {k: v for k, v in kwargs.items() if k != "timestep"}
    x = args[0]
    cp.denoise(x, diffusers.DPMSolverMultistepScheduler(), 3, warmup_steps=1, patches=2,
               model_kwargs=kw, output_transform=_half)  # the first call of a shape also
    # checks its patches once (tppc.pipefusion.check): not counted below
    for block in model.transformer_blocks:  # one stage each holds one block
        counter = _CountReads(block.attn2.to_k.weight)
        with counter:
            cp.denoise(x, diffusers.DPMSolverMultistepScheduler(), 3, warmup_steps=1,
                       patches=2, model_kwargs=kw, output_transform=_half)
        assert counter.calls == 1, f"text K projection ran {counter.calls}× (1 warm-up + 4 patches)"
    with _CountReads(model.transformer_blocks[0].attn2.to_k.weight) as eager:
        _pixart_serial(model, x, 1, kw, _half)
    assert eager.calls == 1  # the counter sees the eager projection too
    exact = cp.denoise(x, diffusers.DPMSolverMultistepScheduler(), 3, warmup_steps=3,
                       patches=2, model_kwargs=kw, output_transform=_half)
    assert_kernels_close(exact, _pixart_serial(model, x, 3, kw, _half), depth=3)


def test_new_prompt_in_the_next_call_gets_new_text_kv() -> None:
    model, args, kwargs = examples.hf_pixart()
    cp = _two_stages(model, args, kwargs)
    kw = {k: v for k, v in kwargs.items() if k != "timestep"}
    other = {**kw, "encoder_hidden_states": torch.randn_like(kw["encoder_hidden_states"])}
    sched = diffusers.DPMSolverMultistepScheduler
    cp.denoise(args[0], sched(), 2, warmup_steps=2, patches=2, model_kwargs=kw,
               output_transform=_half)
    out = cp.denoise(args[0], sched(), 2, warmup_steps=2, patches=2, model_kwargs=other,
                     output_transform=_half)
    assert_kernels_close(out, _pixart_serial(model, args[0], 2, other, _half), depth=2)


def _guided(scale):
    def transform(o):
        u, c = _half(o).chunk(2)
        g = u + scale * (c - u)
        return torch.cat([g, g])
    return transform


@pytest.mark.parametrize("name", ["dit", "hf_pixart"])
def test_classifier_free_guidance_as_a_batch_of_two(name) -> None:
    if name == "dit":
        model, args, kwargs = examples.dit()
        x = args[0].repeat(2, 1, 1, 1)
        kw, arg, sched = {"y": torch.tensor([0, 3])}, "t", diffusers.DDIMScheduler

        def guide(o):
            u, c = o.chunk(2)
            return torch.cat([u + 4.0 * (c - u)] * 2)
    else:
        model, args, kwargs = examples.hf_pixart()
        x = args[0].repeat(2, 1, 1, 1)
        text = kwargs["encoder_hidden_states"]
        kw = {"encoder_hidden_states": torch.cat([torch.zeros_like(text), text]),
              "return_dict": False}
        arg, sched, guide = "timestep", diffusers.DPMSolverMultistepScheduler, _guided(4.0)
    cp = _two_stages(model, args, kwargs)
    out = cp.denoise(x, sched(), 3, warmup_steps=3, patches=2, model_kwargs=kw,
                     timestep_arg=arg, output_transform=guide)
    ref = serial_denoise(model, x, sched(), 3, timestep_arg=arg, model_kwargs=kw,
                         output_transform=guide)
    assert_kernels_close(out, ref, depth=3)
    assert not torch.allclose(out[0], _unguided(cp, x, sched, kw, arg, name)[0], atol=1e-3)


def _unguided(cp, x, sched, kw, arg, name):
    transform = None if name == "dit" else _half
    return cp.denoise(x, sched(), 3, warmup_steps=3, patches=2, model_kwargs=kw,
                      timestep_arg=arg, output_transform=transform)
