"""A position table with a constant text segment first (CogView3Plus' construct), in our form.

Joint attention over ``cat([text, image])`` plus ``cat([zeros(text), sincos(image rows)])``:
the table's prefix follows it through the ops after the ``cat``, so each patch gets its own
rows of it. Checked against eager (plain call, ``denoise`` at full warm-up); with stale
patches the first patched call's own check (the patch program one step after a full
warm-up against the one-chunk program) must pass.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close, serial_denoise

diffusers = pytest.importorskip("diffusers")
D, CH, H, W, TEXT = 16, 4, 8, 2, 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, tok):
        b = tok.shape[0]
        q, k, v = (z.view(b, -1, 2, D // 2).transpose(1, 2)
                   for z in self.qkv(tok).chunk(3, dim=-1))
        return tok + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class JointPositions(nn.Module):
    """``(latents (b, CH, h, W), t (b,), text (b, TEXT, D))`` → noise prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.t_emb, self.head = nn.Linear(CH, D), nn.Linear(1, D), nn.Linear(D, CH)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x, t, text):
        b, _, h, w = x.shape
        img = self.embed(x.flatten(2).transpose(1, 2)) + self.t_emb(t[:, None].float())[:, None]
        rows = torch.arange(h * w, device=x.device).float()[:, None]
        freq = torch.exp(-math.log(100.0) * torch.arange(D // 2, device=x.device) / (D // 2))
        image_pos = torch.cat([(rows * freq).sin(), (rows * freq).cos()], dim=-1)
        pos = torch.cat([image_pos.new_zeros(text.shape[1], D), image_pos], dim=0)
        tok = torch.cat([text, img], dim=1) + pos.unsqueeze(0)
        for block in self.blocks:
            tok = block(tok)
        return self.head(tok[:, text.shape[1]:]).transpose(1, 2).reshape(b, CH, h, w)


def test_a_prefixed_position_table_is_exact_and_patches_check_out():
    torch.manual_seed(0)
    model = JointPositions().eval()
    x, t, text = torch.randn(1, CH, H, W), torch.tensor([500]), torch.randn(1, TEXT, D)
    cp = tppc.compile(model, (x, t, text), num_stages=2, cluster="2xcpu")
    with torch.no_grad():
        assert_kernels_close(cp(x, t, text), model(x, t, text))
    cond = {"text": text}
    ref = serial_denoise(model, x, diffusers.DDIMScheduler(), 2, timestep_arg="t",
                         model_kwargs=cond)
    exact = cp.denoise(x, diffusers.DDIMScheduler(), 2, warmup_steps=2, patches=2,
                       model_kwargs=cond, timestep_arg="t")
    assert_kernels_close(exact, ref, depth=2)
    stale = cp.denoise(x, diffusers.DDIMScheduler(), 2, warmup_steps=1, patches=2,
                       model_kwargs=cond, timestep_arg="t")
    assert torch.isfinite(stale).all()
