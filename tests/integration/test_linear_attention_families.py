"""Sana (linear attention, a depthwise 3×3 convolution) and CogView3Plus (a position table
with a zero text segment first): diffusers' code, tiny configs, random weights.

A plain call equals eager; for Sana, ``cp.denoise`` at full warm-up equals the serial loop
and with stale patches it runs (stale sums, stale halo: checked against an independent reference on our own
model in ``tests/unit/test_buffered_mixing.py``).
"""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, serial_denoise

diffusers = pytest.importorskip("diffusers")


def _sana():
    model = diffusers.SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
        cross_attention_dim=16, caption_channels=16, mlp_ratio=2.0, sample_size=8,
        patch_size=1)
    return model, {"encoder_hidden_states": torch.randn(1, 6, 16)}


def _cogview3plus():
    model = diffusers.CogView3PlusTransformer2DModel(
        patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        out_channels=4, text_embed_dim=16, time_embed_dim=16, condition_dim=8,
        pos_embed_max_size=16, sample_size=8)
    return model, {"encoder_hidden_states": torch.randn(1, 6, 16),
                   "original_size": torch.tensor([[64, 64]]),
                   "target_size": torch.tensor([[64, 64]]), "crop_coords": torch.tensor([[0, 0]])}


def test_cogview3plus_is_exact():
    torch.manual_seed(0)
    model, cond = _cogview3plus()
    latent, kwargs = torch.randn(1, 4, 8, 8), {**cond, "timestep": torch.tensor([10])}
    cp = tppc.compile(model.eval(), (latent,), kwargs, num_stages=2, cluster="2xcpu")
    with torch.no_grad():
        assert_kernels_close(cp(latent, **kwargs).sample, model(latent, **kwargs).sample)


def test_sana_is_exact_and_denoises():
    torch.manual_seed(0)
    model, cond = _sana()
    model.eval()
    latent, steps = torch.randn(1, 4, 8, 8), 2
    kwargs = {**cond, "timestep": torch.tensor([10]), "return_dict": False}
    cp = tppc.compile(model, (latent,), kwargs, num_stages=2, cluster="2xcpu")
    with torch.no_grad():
        assert_kernels_close(cp(latent, **kwargs)[0], model(latent, **kwargs)[0])
    ref = serial_denoise(model, latent, diffusers.DDIMScheduler(), steps,
                         model_kwargs={**cond, "return_dict": False})
    exact = cp.denoise(latent, diffusers.DDIMScheduler(), steps, warmup_steps=steps, patches=2,
                       model_kwargs=cond)
    assert_kernels_close(exact, ref, depth=steps)
    stale = cp.denoise(latent, diffusers.DDIMScheduler(), steps, warmup_steps=1, patches=2,
                       model_kwargs=cond)
    assert stale.shape == ref.shape and torch.isfinite(stale).all()
