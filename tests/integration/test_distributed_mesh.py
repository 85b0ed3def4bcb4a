"""Stages on a mesh of workers on the distributed backend, one rank per worker (gloo on CPU):
``cp.denoise`` through a job (the CLI's ``--denoise`` with ``--cfg-parallel`` / ``--ulysses``,
via ``tppc.launch``) and the diffusers drop-in as ranks (``dropin_rank.py``), against the
eager loop (every step warm) and the same loop in one process (stale patches).

Seconds on the 2-core VM (other jobs beside): about 40-110 per 2-rank job, 60-210 per 4-rank
job; the plain mesh call (``cp(...)``) is what every warm step runs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tppc
import tppc.diffusers
from tests.integration.mesh_models import guided_dit
from tests.oracles import assert_kernels_close, serial_denoise
from tppc.distributed.checkpoint import save_checkpoint
from tppc.program.cores import cores_per_device

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tests.integration.mesh_models:guided_dit"


@pytest.fixture(scope="module")
def guided(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """The guided DiT, its checkpoint, latents and labels (a batch of two)."""
    model, args, _ = guided_dit()
    path = tmp_path_factory.mktemp("mesh") / "dit.safetensors"
    save_checkpoint(model, path)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(5))
    return model, args, path, x, torch.tensor([3, 0])


def _denoise_job(guided: tuple, ranks: int, steps: int, warmup: int, **degrees: int
                 ) -> tppc.LaunchResult:
    _, _, path, x, y = guided
    return tppc.launch(FACTORY, ranks, checkpoint=path, inputs={"args.0": x, "kwargs.y": y},
                       timeout=800, comm_timeout=120.0, **degrees,
                       extra_args=["--denoise", str(steps), "--warmup-steps", str(warmup),
                                   "--patches", "2", "--timestep-arg", "t"])


def test_ulysses2_denoising_through_a_job_equals_the_eager_loop_every_step_warm(guided
                                                                               ) -> None:
    model, _, _, x, y = guided
    got = _denoise_job(guided, 2, steps=2, warmup=2, ulysses=2).outputs["latents"]
    want = serial_denoise(model, x, diffusers.DDIMScheduler(), 2, timestep_arg="t",
                          model_kwargs={"y": y})
    assert_kernels_close(got, want, depth=2)


def test_ring2_attention_through_a_job_equals_the_eager_loop_every_step_warm(guided
                                                                            ) -> None:
    """Ring-2 as ranks: one patch a step, so each rank keeps its own K/V block and the
    blocks pass around the ring (gloo's isend/irecv), every step warm: the eager loop's
    latents; both ranks report the degrees the job was given and run their CPU device's
    share of the cores (``tppc.launch`` gives no ``--threads``)."""
    model, _, path, x, y = guided
    job = tppc.launch(FACTORY, 2, checkpoint=path, inputs={"args.0": x, "kwargs.y": y},
                      timeout=800, comm_timeout=120.0, ring=2,
                      extra_args=["--denoise", "2", "--warmup-steps", "2", "--patches", "1",
                                  "--timestep-arg", "t"])
    assert all(r["degrees"]["ring"] == 2 for r in job.reports) and len(job.reports) == 2
    assert [r["threads"] for r in job.reports] == [cores_per_device(2)] * 2
    want = serial_denoise(model, x, diffusers.DDIMScheduler(), 2, timestep_arg="t",
                          model_kwargs={"y": y})
    assert_kernels_close(job.outputs["latents"], want, depth=2)


@pytest.mark.parametrize("degrees", [{"ulysses": 2, "ring": 2}, {"cfg_parallel": 2, "ulysses": 2}],
                         ids=["ulysses2xring2", "cfg2xulysses2"])
def test_a_product_of_two_degrees_as_4_ranks_equals_the_eager_loop_every_step_warm(
        guided, degrees: dict[str, int]) -> None:
    """Two degrees of one stage as a 4-rank job (one patch a step, so the Ring part keeps
    its own K/V block): every rank reports the product it was given, and every step warm
    gives the eager loop's latents."""
    model, _, path, x, y = guided
    job = tppc.launch(FACTORY, 4, checkpoint=path, inputs={"args.0": x, "kwargs.y": y},
                      timeout=800, comm_timeout=120.0, **degrees,
                      extra_args=["--denoise", "2", "--warmup-steps", "2", "--patches", "1",
                                  "--timestep-arg", "t"])
    assert len(job.reports) == 4
    assert all(r["degrees"][k] == v for r in job.reports for k, v in degrees.items())
    want = serial_denoise(model, x, diffusers.DDIMScheduler(), 2, timestep_arg="t",
                          model_kwargs={"y": y})
    assert_kernels_close(job.outputs["latents"], want, depth=2)


def test_a_4_rank_job_without_degrees_is_planned_whole_and_its_stale_patches_equal_one_process(
        guided) -> None:
    """No degree given: the planner chooses the mix for the 4 ranks, a worker on each (not
    4 stages by default); stale patches on its stages and groups (each CFG worker keeps the
    stale K/V of its half of the batch, the leader steps each patch and sends it back to
    stage 0's workers) equal the one-process loop of PipeFusion-2 x CFG-2 (threads): stale
    K/V depend on the patches, not on the mix."""
    model, args, _, x, y = guided
    job = _denoise_job(guided, 4, steps=3, warmup=1)
    degrees = [r["degrees"] for r in job.reports]
    assert all(d == degrees[0] for d in degrees)
    d = degrees[0]
    assert d["num_stages"] * d["cfg_parallel"] * d["ulysses"] * d["ring"] \
        * d["tensor_parallel"] == 4 and d["num_stages"] < 4, d
    got = job.outputs["latents"]
    cp = tppc.compile(model, args, cluster="4xcpu", num_stages=2, cfg_parallel=2,
                      executor="threads", threads_per_stage=1, verify=False)
    one = cp.denoise(x, diffusers.DDIMScheduler(), 3, warmup_steps=1, patches=2,
                     timestep_arg="t", model_kwargs={"y": y})
    assert_kernels_close(got, one, depth=3)
    eager = serial_denoise(model, x, diffusers.DDIMScheduler(), 3, timestep_arg="t",
                           model_kwargs={"y": y})
    assert float((got - eager).abs().max()) > 1e-3, "patches should attend to stale K/V"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_drop_in_as_ranks_equals_the_drop_in_in_one_process(tmp_path: Path) -> None:
    """An unchanged guided PixArt pipeline call with its transformer on a CFG group of 2
    ranks, the first call warm and the later ones stale (2 patches): bit for bit the
    one-process drop-in's images."""
    from tests.integration.test_diffusers_dropin import _call, pixart_pipe

    options = {"warmup_steps": 1, "patches": 2, "cfg_parallel": 2, "num_stages": 1,
               "verify": False}
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()),
           "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "tests/integration/dropin_rank.py"), str(tmp_path),
         json.dumps(options)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=800)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    pipe, call = pixart_pipe()
    pipe.set_progress_bar_config(disable=True)
    eager = _call(pipe, call, steps=2)
    tppc.diffusers.compile_pipeline(pipe, executor="threads", threads_per_stage=1, **options)
    got = torch.load(tmp_path / "got.pt")
    assert torch.equal(got, _call(pipe, call, steps=2))
    assert not torch.equal(got, eager), "the later calls should attend to stale K/V"
