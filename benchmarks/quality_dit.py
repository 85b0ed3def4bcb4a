"""A small DiT trained here on synthetic images, for measuring the stale-K/V approximation.

With random weights adjacent denoising steps are unrelated, so the error of stale patches
says nothing about real use. This module makes images in code (a two-colour gradient, a
filled shape, a digit from a 3×5 bitmap font whose class is the label), trains the project's
DiT (:class:`tppc.examples.models.DiT`, 16×16 RGB pixels, patch 2: 8×8 tokens) with

- ``eps``: the DDPM epsilon objective (``x_t = √ᾱ x0 + √(1−ᾱ) ε``, DDIM's default
  linear betas, predict ε): sampled with ``DDIMScheduler``;
- ``flow``: rectified flow (``x_t = (1−σ) x0 + σ ε``, predict ``v = ε − x0``, timestep
  ``1000 σ``): sampled with ``FlowMatchEulerDiscreteScheduler``,

and keeps the EMA weights as float16 safetensors fixtures in ``benchmarks/data`` (the
config in the file's metadata). PSNR and SSIM (Gaussian window) are here too.

Training (one CPU thread, 800 iterations of 64 images; 4 minutes per model on an idle core
here, 20 on the shared one; the fixtures were made so)::

    PYTHONPATH=. python benchmarks/quality_dit.py train eps   # -> data/quality_dit_eps.safetensors
    PYTHONPATH=. python benchmarks/quality_dit.py train flow  # -> data/quality_dit_flow.safetensors
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from tppc.examples.models import DiT, DiTConfig

__all__ = ["CONFIG", "DATA", "load", "make_images", "psnr", "ssim", "train"]

DATA = Path(__file__).resolve().parent / "data"
CONFIG = DiTConfig(in_channels=3, patch_size=2, hidden=96, depth=4, n_head=4, num_classes=10)
SIDE = 16

# 3×5 bitmap font, rows top to bottom, "1" = ink.
_FONT = ["111101101101111", "010110010010111", "111001111100111", "111001111001111",
         "101101111001001", "111100111001111", "111100111101111", "111001010010010",
         "111101111101111", "111101111001111"]
_GLYPHS = torch.tensor([[float(c) for c in g] for g in _FONT]).view(10, 5, 3)


def make_images(labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Images ``(b, 3, 16, 16)`` in ``[-1, 1]``: gradient background, one filled shape
    (disc, square or triangle), and the digit ``labels[i]`` drawn at 2× in a third colour."""
    b = len(labels)
    ys, xs = torch.meshgrid(torch.arange(SIDE).float(), torch.arange(SIDE).float(),
                            indexing="ij")
    colours = torch.rand(b, 4, 3, generator=gen) * 2 - 1
    angle = torch.rand(b, generator=gen) * 2 * math.pi
    ramp = (xs * angle.cos()[:, None, None] + ys * angle.sin()[:, None, None]) / SIDE
    ramp = (ramp - ramp.amin((1, 2), keepdim=True)) / (
        ramp.amax((1, 2), keepdim=True) - ramp.amin((1, 2), keepdim=True))
    img = colours[:, 0, :, None, None] * (1 - ramp[:, None]) \
        + colours[:, 1, :, None, None] * ramp[:, None]
    cx, cy = (torch.rand(2, b, generator=gen) * 10 + 3)[:, :, None, None]
    r = (torch.rand(b, generator=gen) * 2.5 + 2)[:, None, None]
    kind = torch.randint(0, 3, (b,), generator=gen)[:, None, None]
    dx, dy = xs - cx, ys - cy
    disc = dx**2 + dy**2 < r**2
    square = (dx.abs() < r * 0.8) & (dy.abs() < r * 0.8)
    tri = (dy > -r) & (dy < r * 0.7) & (dx.abs() < (dy + r) * 0.6)
    shape = torch.where(kind == 0, disc, torch.where(kind == 1, square, tri))
    img = torch.where(shape[:, None], colours[:, 2, :, None, None], img)
    glyph = _GLYPHS[labels].repeat_interleave(2, 1).repeat_interleave(2, 2)  # b × 10 × 6
    ox = torch.randint(0, SIDE - 5, (b,), generator=gen)
    oy = torch.randint(0, SIDE - 9, (b,), generator=gen)
    ink = torch.zeros(b, SIDE, SIDE, dtype=torch.bool)
    for i in range(b):
        ink[i, oy[i]:oy[i] + 10, ox[i]:ox[i] + 6] = glyph[i] > 0
    return torch.where(ink[:, None], colours[:, 3, :, None, None], img)


def _alphas_cumprod() -> torch.Tensor:
    """DDIMScheduler's default ``alphas_cumprod`` (linear betas 1e-4 .. 0.02, 1000 steps)."""
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    return torch.cumprod(1 - betas, 0).float()


def _loss(model: DiT, objective: str, x0: torch.Tensor, y: torch.Tensor,
          gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(x0.shape, generator=gen)
    if objective == "eps":
        t = torch.randint(0, 1000, (len(x0),), generator=gen)
        acp = _alphas_cumprod()[t][:, None, None, None]
        xt = acp.sqrt() * x0 + (1 - acp).sqrt() * noise
        return F.mse_loss(model(xt, t.float(), y), noise)
    sigma = torch.rand(len(x0), generator=gen)
    s = sigma[:, None, None, None]
    xt = (1 - s) * x0 + s * noise
    return F.mse_loss(model(xt, sigma * 1000, y), noise - x0)


def train(objective: str, iters: int = 800, batch: int = 64, seed: int = 0) -> Path:
    """Train one model on one thread and write its EMA weights (float16) to ``DATA``."""
    if objective not in ("eps", "flow"):
        raise SystemExit(f"objective {objective!r}: use eps or flow")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = DiT(CONFIG)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 100) * 0.5 * (1 + math.cos(math.pi * i / iters)))
    t0, running = time.perf_counter(), 0.0
    for i in range(iters):
        y = torch.randint(0, 10, (batch,), generator=gen)
        loss = _loss(model, objective, make_images(y, gen), y, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        decay = min(0.998, (1 + i) / (10 + i))
        with torch.no_grad():
            for k, v in model.state_dict().items():
                ema[k].mul_(decay).add_(v.detach(), alpha=1 - decay)
        running = 0.98 * running + 0.02 * float(loss) if i else float(loss)
        if i % 100 == 0 or i == iters - 1:
            print(f"{objective} iter {i} loss {running:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    from safetensors.torch import save_file

    DATA.mkdir(exist_ok=True)
    path = DATA / f"quality_dit_{objective}.safetensors"
    meta = {"config": json.dumps(dataclasses.asdict(CONFIG)), "objective": objective,
            "iters": str(iters), "batch": str(batch), "seed": str(seed),
            "final_loss": f"{running:.4f}",
            "command": f"python benchmarks/quality_dit.py train {objective}"}
    save_file({k: v.half().contiguous() for k, v in ema.items()}, str(path), metadata=meta)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) in "
          f"{time.perf_counter() - t0:.0f} s")
    return path


def load(objective: str) -> DiT:
    """The trained model of ``objective`` (``eps`` or ``flow``), float32, eval mode."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = DATA / f"quality_dit_{objective}.safetensors"
    with safe_open(str(path), "pt") as f:
        cfg = DiTConfig(**json.loads(f.metadata()["config"]))
    model = DiT(cfg)
    model.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()})
    return model.eval()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of images in ``[-1, 1]`` (data range 2), over the whole batch."""
    mse = float(((a.clamp(-1, 1) - b.clamp(-1, 1)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(4.0 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor, window: int = 11, sigma: float = 1.5) -> float:
    """Mean SSIM (Wang et al. 2004: Gaussian window 11, σ 1.5, K1 0.01, K2 0.03) of images
    in ``[-1, 1]`` mapped to ``[0, 1]``, per channel, valid positions only."""
    a, b = ((z.clamp(-1, 1).double() + 1) / 2 for z in (a, b))
    g = torch.exp(-((torch.arange(window).double() - window // 2) ** 2) / (2 * sigma**2))
    g = g / g.sum()
    ch = a.shape[1]
    kernel = (g[:, None] * g[None, :]).expand(ch, 1, window, window)

    def blur(z: torch.Tensor) -> torch.Tensor:
        return F.conv2d(z, kernel, groups=ch)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = 0.01**2, 0.03**2
    num = (2 * mu_a * mu_b + c1) * (2 * cov + c2)
    s = num / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return float(s.mean())


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "train":
        raise SystemExit("usage: python benchmarks/quality_dit.py train eps|flow [ITERS]")
    train(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 800)
