"""The video DiT families of diffusers with tiny random configs: exact against eager, or why not.

Each family is built with 2 layers and 2 heads on latents of 2 frames of 8×8 (Latte and
HunyuanVideo ``(b, c, f, h, w)``, CogVideoX ``(b, f, c, h, w)``, LTX packed ``(b, f·h·w, c)``),
compiled with ``tppc.compile(..., num_stages=2)`` and called once; prints per family ``OK``
with the capture mode, the patch grid, max |compiled − eager|, the chunks of each
validation run and, for a family that takes ``encoder_attention_mask``, max |compiled −
eager| with a padded prompt (the example's mask is all ones), or ``REFUSED`` with the
error's first line (the table in docs/diffusion.md).
With ``--denoise``: ``cp.denoise`` (2 patches, 3 steps) against diffusers' serial loop, at
full warm-up (max |diff|) and with stale patches after one warm-up step (relative MSE).

Run:  .venv/bin/python benchmarks/video_families.py [--denoise] [family ...]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

import tppc

__all__ = ["FAMILIES", "main"]

Example = tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]


def _text(n: int = 6, dim: int = 12) -> torch.Tensor:
    return torch.randn(1, n, dim)


def cogvideox(rope: bool = False, tables: bool = False) -> Example:
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        num_layers=2, sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
        text_embed_dim=12, time_embed_dim=8, max_text_seq_length=6,
        temporal_compression_ratio=4, use_rotary_positional_embeddings=rope).eval()
    kwargs: dict[str, Any] = {"encoder_hidden_states": _text(), "timestep": torch.tensor([10]),
                              "return_dict": False}
    if tables:  # what CogVideoXPipeline passes with rotary embeddings
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        kwargs["image_rotary_emb"] = get_3d_rotary_pos_embed(
            embed_dim=16, crops_coords=((0, 0), (4, 4)), grid_size=(4, 4), temporal_size=2)
    return model, (torch.randn(1, 2, 4, 8, 8),), kwargs


def allegro() -> Example:
    from diffusers import AllegroTransformer3DModel

    torch.manual_seed(0)
    model = AllegroTransformer3DModel(
        patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        in_channels=4, out_channels=4, num_layers=2, cross_attention_dim=16, sample_height=8,
        sample_width=8, sample_frames=2, caption_channels=12).eval()
    return model, (torch.randn(1, 4, 2, 8, 8),), {
        "encoder_hidden_states": _text(), "timestep": torch.tensor([10]), "return_dict": False}


def latte() -> Example:
    from diffusers import LatteTransformer3DModel

    torch.manual_seed(0)
    model = LatteTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        num_layers=2, sample_size=8, patch_size=2, cross_attention_dim=16, caption_channels=12,
        video_length=2, norm_type="ada_norm_single").eval()
    return model, (torch.randn(1, 4, 2, 8, 8),), {
        "encoder_hidden_states": _text(), "timestep": torch.tensor([10]), "return_dict": False}


def wan() -> Example:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=12, freq_dim=16, ffn_dim=32, num_layers=2,
        rope_max_seq_len=32).eval()
    return model, (torch.randn(1, 4, 2, 8, 8),), {  # float timesteps, as WanPipeline's
        "encoder_hidden_states": _text(), "timestep": torch.tensor([10.0]), "return_dict": False}


def ltx() -> Example:
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    model = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, num_layers=2, caption_channels=12).eval()
    frames, height, width = 2, 4, 4
    return model, (torch.randn(1, frames * height * width, 8),), {
        "encoder_hidden_states": _text(), "timestep": torch.tensor([10]),
        "encoder_attention_mask": torch.ones(1, 6), "num_frames": frames, "height": height,
        "width": width, "return_dict": False}


def ltx_coords() -> Example:
    """LTX with per-token coordinates ``video_coords`` ``(b, 3, f·h·w)``, as
    ``LTXConditionPipeline`` passes them, instead of the Python ints of the grid."""
    model, args, kwargs = ltx()
    grid = [torch.arange(kwargs.pop(k)) for k in ("num_frames", "height", "width")]
    coords = torch.stack(torch.meshgrid(*grid, indexing="ij")).float().flatten(1)[None]
    return model, args, {**kwargs, "timestep": torch.tensor([10.0]), "video_coords": coords}


def hunyuan_video() -> Example:
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4)).eval()
    return model, (torch.randn(1, 4, 2, 8, 8),), {
        "timestep": torch.tensor([10]), "encoder_hidden_states": _text(dim=16),
        "encoder_attention_mask": torch.ones(1, 6), "pooled_projections": torch.randn(1, 8),
        "guidance": torch.tensor([3.0]), "return_dict": False}


def mochi() -> Example:
    from diffusers import MochiTransformer3DModel

    torch.manual_seed(0)
    model = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        pooled_projection_dim=16, in_channels=4, text_embed_dim=16, time_embed_dim=16).eval()
    return model, (torch.randn(1, 4, 2, 8, 8),), {
        "encoder_hidden_states": _text(dim=16), "timestep": torch.tensor([10]),
        "encoder_attention_mask": torch.ones(1, 6), "return_dict": False}


FAMILIES: dict[str, Callable[[], Example]] = {
    "cogvideox": cogvideox,
    "cogvideox_rope": lambda: cogvideox(rope=True),
    "cogvideox_rope_tables": lambda: cogvideox(rope=True, tables=True),
    "allegro": allegro, "latte": latte, "wan": wan, "ltx": ltx, "ltx_coords": ltx_coords,
    "hunyuan_video": hunyuan_video, "mochi": mochi,
}


def _try(name: str) -> str:
    try:
        model, args, kwargs = FAMILIES[name]()
        with torch.no_grad():
            want = model(*args, **kwargs)[0]
    except Exception as exc:
        return f"{name}: EAGER FAILS (our tiny config) {type(exc).__name__}: {exc}"
    try:
        cp = tppc.compile(model, args, kwargs, num_stages=2)
        got = cp(*args, **kwargs)[0]
    except Exception as exc:
        return f"{name}: REFUSED {type(exc).__name__}: {str(exc).splitlines()[0]}"
    ctx = cp.context
    return (f"{name}: OK {ctx.capture_mode} grid {ctx.patch_grid} max|diff| "
            f"{float((got - want).abs().max()):.2e} chunks "
            f"{[len(r.chunks) for r in cp.validation.runs]}{_padded(model, cp, args, kwargs)}")


def _padded(model: torch.nn.Module, cp: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> str:
    """Max |compiled − eager| with the last third of the prompt padded (a prompt mask with
    zeros; the example's is all ones), for families that take ``encoder_attention_mask``."""
    mask = kwargs.get("encoder_attention_mask")
    if mask is None:
        return ""
    padded = mask.clone()
    padded[:, -(mask.shape[1] // 3):] = 0
    kw = {**kwargs, "encoder_attention_mask": padded}
    with torch.no_grad():
        want, got = model(*args, **kw)[0], cp(*args, **kw)[0]
    return f"; padded prompt max|diff| {float((got - want).abs().max()):.2e}"


FLOW_MATCHING = ("wan", "ltx_coords")
"""Families whose pipelines use a flow-matching scheduler (float timesteps); DDIM otherwise."""


def _try_denoise(name: str, steps: int = 3, patches: int = 2) -> str:
    """``cp.denoise`` against diffusers' serial loop: max |diff| at full warm-up (every step
    whole) and the relative MSE of stale patches after one warm-up step."""
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler if name in FLOW_MATCHING else DDIMScheduler
    model, args, kwargs = FAMILIES[name]()
    rest = {k: v for k, v in kwargs.items() if k != "timestep"}
    try:
        cp = tppc.compile(model, args, kwargs, num_stages=2)
    except Exception as exc:
        return f"{name}: REFUSED {type(exc).__name__}: {str(exc).splitlines()[0]}"
    scheduler, x = sched(), args[0]
    scheduler.set_timesteps(steps)
    scale = getattr(scheduler, "scale_model_input", lambda x, t: x)  # flow matching: none
    with torch.no_grad():
        for t in scheduler.timesteps:
            out = model(scale(x, t), timestep=t.expand(1), **rest)[0]
            x = scheduler.step(out, t, x).prev_sample
    runs = [cp.denoise(args[0], sched(), steps, warmup_steps=w, patches=patches,
                       model_kwargs=rest) for w in (steps, 1)]
    stale = float(((runs[1] - x) ** 2).mean() / (x**2).mean())
    return (f"{name}: denoise {sched.__name__} {steps} steps {patches} patches: full warm-up "
            f"max|diff| {float((runs[0] - x).abs().max()):.2e}, 1 warm-up step rel. MSE "
            f"{stale:.1e}")


def main() -> None:
    """``[--denoise] [family ...]``: compile and call each family (or denoise with it)."""
    names = [a for a in sys.argv[1:] if a != "--denoise"] or list(FAMILIES)
    check = _try_denoise if "--denoise" in sys.argv else _try
    for name in names:
        print(check(name)[:400], flush=True)


if __name__ == "__main__":
    main()
