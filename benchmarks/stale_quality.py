"""Quality of PipeFusion's stale K/V on trained DiTs: PSNR and SSIM against the serial loop.

The models are the project's DiT trained here on synthetic 16×16 images
(:mod:`quality_dit`; fixtures in ``benchmarks/data``): an epsilon model sampled with
``DDIMScheduler`` and a rectified-flow model sampled with ``FlowMatchEulerDiscreteScheduler``.
For each, 8 class-conditioned samples (labels 0..7, fixed noise) are denoised with
``cp.denoise`` (2 stages, ``executor="local"``, bit for bit the threads executor's result) at
each warm-up count and patch count, and compared with the serial loop of the eager model
(``scheduler.step(model(x, t, y), t, x)``). A random-weight DiT of the same shape is the
control: its adjacent steps are unrelated, so its PSNR says nothing about real use.

Usage:
    python benchmarks/stale_quality.py [STEPS ...]      # default: 20
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality_dit

import tppc
from tppc.examples.models import DiT

__all__ = ["measure", "serial_loop"]

SCHEDULERS = {"eps": DDIMScheduler, "flow": FlowMatchEulerDiscreteScheduler}
WARMUPS, PATCHES = (1, 2, 4), (2, 4, 8)


def serial_loop(model: torch.nn.Module, scheduler, x: torch.Tensor, y: torch.Tensor,
                steps: int) -> torch.Tensor:
    """The reference: diffusers' loop on the eager model."""
    scheduler.set_timesteps(steps)
    with torch.inference_mode():
        for t in scheduler.timesteps:
            out = model(x, t.float().expand(len(x)), y)
            x = scheduler.step(out, t, x).prev_sample
    return x


def compiled(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, **options):
    """``model`` compiled for two stages (float timestep input: both schedulers' fit)."""
    return tppc.compile(model, (x, torch.tensor([500.0] * len(x)), y), cluster="2xcpu",
                        num_stages=2, executor="local", **options)


def measure(model: torch.nn.Module, objective: str, steps: int = 20,
            warmups: tuple[int, ...] = WARMUPS, patches: tuple[int, ...] = PATCHES,
            batch: int = 8, seed: int = 0, cp=None) -> list[tuple[int, int, float, float]]:
    """``(warm-up, patches, PSNR dB, SSIM)`` of stale-patch outputs against the serial loop
    (``cp``: ``model`` compiled for this batch, default: compiled here)."""
    x = torch.randn(batch, 3, quality_dit.SIDE, quality_dit.SIDE,
                    generator=torch.Generator().manual_seed(seed))
    y = torch.arange(batch) % 10
    ref = serial_loop(model, SCHEDULERS[objective](), x, y, steps)
    cp = cp or compiled(model, x, y)
    rows = []
    for warm in warmups:
        for m in patches:
            out = cp.denoise(x, SCHEDULERS[objective](), steps, warmup_steps=warm, patches=m,
                             model_kwargs={"y": y}, timestep_arg="t")
            rows.append((warm, m, quality_dit.psnr(out, ref), quality_dit.ssim(out, ref)))
    return rows


def main(step_counts: list[int]) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = [(f"trained ({o})", o, quality_dit.load(o)) for o in ("eps", "flow")]
    models.append(("random weights", "eps", DiT(quality_dit.CONFIG).eval()))
    print("| model | scheduler | steps | warm-up | patches | PSNR (dB) | SSIM |")
    print("|---|---|---|---|---|---|---|")
    for steps in step_counts:
        for title, objective, model in models:
            name = SCHEDULERS[objective].__name__
            for warm, m, p, s in measure(model, objective, steps):
                print(f"| {title} | {name} | {steps} | {warm} | {m} | {p:.1f} | {s:.4f} |",
                      flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [20])
