"""PipeFusion denoising on this CPU: speed (2 stages on 2 cores vs the serial loop on 1 core)
and quality (MSE / PSNR of final latents against the serial loop).

Usage:
    python benchmarks/denoise_pipefusion.py speed [SIDE]  # own DiT, 20 steps, median of 3
    python benchmarks/denoise_pipefusion.py quality [MODELS]  # warm-up x patches
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
)

import tppc
from tppc import examples
from tppc.examples.models import DiT, DiTConfig
from tppc.planner.manual import manual_plan

__all__: list[str] = []


def _pipeline(model, args, kwargs, **options):
    one = tppc.compile(model, args, kwargs, executor="local")
    n, length = len(one.context.layers), one.plan.seq_len
    plan = manual_plan(n, length, cuts=(0, n // 2, n), boundaries=(0, length))
    return tppc.compile(model, args, kwargs, plan=plan, **options)


def _serial(model, x, sched, steps, arg, kw, transform):
    sched.set_timesteps(steps)
    with torch.no_grad():
        for t in sched.timesteps:
            out = model(x, **{arg: t.expand(len(x))}, **kw)
            out = out[0] if isinstance(out, tuple) else out
            out = transform(out) if transform else out
            x = sched.step(out, t, x).prev_sample
    return x


def speed(side: int = 64, reps: int = 3, steps: int = 20) -> None:
    """Serial loop on 1 thread against 2 stages x 1 thread with M = 2 and M = 4 patches.

    The default latent is 64x64 (1024 tokens: a 512x512 image through an 8x VAE, DiT-XL/2's
    token count at 512^2). At 32x32 (256 tokens) a patch of M = 4 is 64 rows, where this
    CPU's single-thread GEMM is 5-12 % slower per row than at 256 rows, and a step takes
    ~0.1 s; see BENCHMARKS.md.
    """
    torch.manual_seed(0)
    model = DiT(DiTConfig(hidden=384, depth=8, n_head=6)).eval()
    x = torch.randn(1, 4, side, side)
    args = (x, torch.tensor([10]), torch.tensor([3]))
    cp = _pipeline(model, args, {}, executor="threads", threads_per_stage=1)
    kw = {"y": args[2]}
    torch.set_num_threads(1)
    for patches in (2, 4):  # compiles and caches the patch programs before timing
        cp.denoise(x, DDIMScheduler(), 2, warmup_steps=1, patches=patches, model_kwargs=kw,
                   timestep_arg="t")
    rows = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _serial(model, x, DDIMScheduler(), steps, "t", kw, None)
        row = [time.perf_counter() - t0]
        for patches in (2, 4):
            t0 = time.perf_counter()
            cp.denoise(x, DDIMScheduler(), steps, warmup_steps=1, patches=patches,
                       model_kwargs=kw, timestep_arg="t")
            row.append(time.perf_counter() - t0)
        rows.append(row)
    s, p2, p4 = (statistics.median(r[k] for r in rows) for k in range(3))
    print(f"own DiT (hidden 384, depth 8, {side}x{side} latent = {side * side // 4} tokens), "
          f"{steps} DDIM steps, median of {reps}")
    print(f"serial loop, 1 thread: {s:.2f} s")
    for patches, p in ((2, p2), (4, p4)):
        print(f"tppc 2 stages x 1 thread, {patches} patches, 1 warm-up: {p:.2f} s | "
              f"speed-up {s / p:.2f}x")


CASES = {
    "dit": (examples.dit, "t", lambda a, k: {"y": a[2]}, DDIMScheduler, None),
    "hf_dit": (examples.hf_dit, "timestep", None, DDIMScheduler, None),
    "hf_pixart": (examples.hf_pixart, "timestep", None, DPMSolverMultistepScheduler,
                  lambda o: o[:, :4]),
    "hf_hunyuan_dit": (examples.hf_hunyuan_dit, "timestep", None, EulerDiscreteScheduler,
                       lambda o: o[:, :4]),
    "hf_flux": (examples.hf_flux, "timestep", None, FlowMatchEulerDiscreteScheduler, None),
    "hf_cogvideox": (lambda: examples.hf_cogvideox(frames=1), "timestep", None, DDIMScheduler,
                     None),  # one frame: stale bands of several frames are refused
}


def quality(models: str = ",".join(CASES), steps: int = 8) -> None:
    print("| model | scheduler | patches | warm-up | MSE | PSNR (dB) |\n|---|---|---|---|---|---|")
    for name in models.split(","):
        factory, arg, kw, sched, transform = CASES[name]
        model, args, kwargs = factory()
        kw = kw(args, kwargs) if kw else {k: v for k, v in kwargs.items() if k != "timestep"}
        cp = _pipeline(model, args, kwargs, executor="local")
        ref = _serial(model, args[0], sched(), steps, arg, kw, transform)
        peak = float(ref.abs().max())
        for patches in (2, 4):
            for warm in (1, 2, 4):
                out = cp.denoise(args[0], sched(), steps, warmup_steps=warm, patches=patches,
                                 model_kwargs=kw, timestep_arg=arg, output_transform=transform)
                mse = float(((out - ref) ** 2).mean())
                psnr = 10 * math.log10(peak**2 / mse) if mse > 0 else math.inf
                print(f"| {name} | {sched.__name__} | {patches} | {warm} | {mse:.2e} | "
                      f"{psnr:.1f} |")


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "speed"
    if mode == "speed":
        speed(*(int(a) for a in sys.argv[2:3]))
    else:
        quality(*sys.argv[2:3])
