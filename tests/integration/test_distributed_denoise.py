"""``denoise`` on the distributed backend (2 gloo ranks via ``tppc.launch``), against the
threads backend's PipeFusion loop and the eager serial loop, for the project's own DiT."""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, serial_denoise, two_stage_plan
from tppc import examples
from tppc.distributed.checkpoint import save_checkpoint
from tppc.errors import StageFailed

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def dit(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    model, args, _ = examples.dit()
    path = tmp_path_factory.mktemp("ckpt") / "dit.safetensors"
    save_checkpoint(model, path)
    x = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(5))
    return model, args, x, path


def _job(path: object, x: torch.Tensor, y: torch.Tensor, steps: int, warmup: int,
         patches: int | None = 2) -> torch.Tensor:
    more = [] if patches is None else ["--patches", str(patches)]
    result = tppc.launch("tppc.examples:dit", 2, checkpoint=path,
                         inputs={"args.0": x, "kwargs.y": y}, timeout=300,
                         extra_args=["--denoise", str(steps), "--warmup-steps", str(warmup),
                                     "--timestep-arg", "t", *more])
    assert [len(r["layers"]) > 0 for r in result.reports] == [True, True]
    return result.outputs["latents"]


def _serial(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int
            ) -> torch.Tensor:
    return serial_denoise(model, x, diffusers.DDIMScheduler(), steps, timestep_arg="t",
                          model_kwargs={"y": y})


def test_warmup_on_every_step_equals_the_serial_loop(dit: tuple) -> None:
    model, args, x, path = dit
    got = _job(path, x, args[2], steps=3, warmup=3)
    assert_kernels_close(got, _serial(model, x, args[2], 3), depth=3)


def test_pipelined_patches_equal_the_threads_backend(dit: tuple) -> None:
    model, args, x, path = dit
    plan = two_stage_plan(tppc.compile(model, args, executor="local"))
    cp = tppc.compile(model, args, executor="threads", plan=plan, threads_per_stage=1)
    expected = cp.denoise(x, diffusers.DDIMScheduler(), 4, warmup_steps=1, patches=2,
                          model_kwargs={"y": args[2]}, timestep_arg="t")
    got = _job(path, x, args[2], steps=4, warmup=1)
    assert_kernels_close(got, expected, depth=4)
    serial = _serial(model, x, args[2], 4)
    assert float((got - serial).abs().max()) > 1e-4, "patches should attend to stale K/V"


def test_planned_patches_are_shared_by_rank_0(dit: tuple) -> None:
    model, args, x, path = dit  # patches=None: rank 0 plans the diffusion workload
    got = _job(path, x, args[2], steps=3, warmup=1, patches=None)
    ref = _serial(model, x, args[2], 3)
    assert float(((got - ref) ** 2).mean()) < 0.1 * float((ref**2).mean())


def test_a_bad_warmup_is_refused_on_every_rank(dit: tuple) -> None:
    """Refused by the rank entry's checks before any model is loaded, on every rank."""
    _, args, x, path = dit
    with pytest.raises(StageFailed, match="rank 1 .*--warmup-steps 0 must be an integer >= 1"
                       ) as info:
        _job(path, x, args[2], steps=2, warmup=0)
    assert info.value.returncodes == (1, 1)


def test_a_flow_schedule_with_sigmas_mu_and_a_timestep_transform(tmp_path) -> None:
    """Flux's loop through the job: custom sigmas, dynamic shifting's mu and the model's
    timestep t / 1000, given as flags (``--sigmas``, ``--mu``, ``--timestep-scale``,
    ``--scheduler-config``), equal to diffusers' serial loop at full warm-up. Flux's text
    segment rides with the first chunk across the stage boundary (its rows are read off the
    sending stage's graph; the job aborted in gloo on a size mismatch before)."""
    model, (lat,), fkw = examples.hf_flux()
    path = tmp_path / "flux.safetensors"
    save_checkpoint(model, path)
    sigmas, mu = [1.0, 2 / 3, 1 / 3], 0.8
    text = {k: v for k, v in fkw.items() if k != "timestep"}
    inputs = {"args.0": lat, **{f"kwargs.{k}": v for k, v in text.items()
                                if isinstance(v, torch.Tensor)}}
    result = tppc.launch(
        "tppc.examples:hf_flux", 2, checkpoint=path, timeout=300, inputs=inputs,
        extra_args=["--denoise", "3", "--warmup-steps", "3",
                    "--scheduler", "diffusers:FlowMatchEulerDiscreteScheduler",
                    "--scheduler-config", '{"use_dynamic_shifting": true}',
                    "--sigmas", ",".join(map(str, sigmas)), "--mu", str(mu),
                    "--timestep-scale", "0.001"])
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    x = serial_denoise(model, lat, scheduler, None, model_kwargs=text,
                       timestep_transform=lambda t: t * 0.001, sigmas=sigmas, mu=mu)
    assert_kernels_close(result.outputs["latents"], x, depth=3)


def test_stale_patches_of_a_joint_attention_dit_are_refused_on_every_rank(tmp_path) -> None:
    model = examples.hf_flux()[0]
    path = tmp_path / "flux.safetensors"
    save_checkpoint(model, path)
    with pytest.raises(StageFailed, match="stale patches of a joint-attention DiT") as info:
        tppc.launch("tppc.examples:hf_flux", 2, checkpoint=path, timeout=300,
                    extra_args=["--denoise", "3", "--warmup-steps", "1", "--patches", "2",
                                "--scheduler", "diffusers:FlowMatchEulerDiscreteScheduler"])
    assert info.value.returncodes == (1, 1)
