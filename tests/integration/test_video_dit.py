"""A video DiT of our own: spatial attention within each frame, temporal attention across the
frames of each patch, and joint attention over every frame, on latents ``(b, frames, c, h,
w)`` whose patch rows (of one frame) are the sequence symbol.

The three blocks put the frames in three places: the batch axis (spatial, ``(b·f, hw, d)``),
the attention's own axis with the tokens on the batch axis (temporal, ``(b·hw, f, d)``: row-wise
along the tokens), and the token axis (joint, ``(b, f·hw, d)``: a band of rows in every frame
is one block per frame there).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import diffusers
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close, serial_denoise


def _sincos(pos: torch.Tensor, dim: int) -> torch.Tensor:
    freq = torch.exp(-math.log(10000.0) * torch.arange(dim // 2) / (dim // 2))
    angle = pos.float()[:, None] * freq[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.norm = heads, nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.norm(x)).split(d, dim=2))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        return x + self.proj(a)


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.spatial, self.temporal = _Attention(hidden, 2), _Attention(hidden, 2)
        self.joint = _Attention(hidden, 2)

    def forward(self, tok: torch.Tensor, frames: int) -> torch.Tensor:
        bf, hw, d = tok.shape
        b = bf // frames
        tok = self.spatial(tok)  # (b·f, hw, d): within each frame
        across = tok.view(b, frames, hw, d).transpose(1, 2).reshape(b * hw, frames, d)
        across = self.temporal(across + _sincos(torch.arange(frames), d)[None])  # across frames
        tok = across.view(b, hw, frames, d).transpose(1, 2).reshape(b, frames * hw, d)
        return self.joint(tok).reshape(bf, hw, d)  # (b, f·hw, d): every frame


class VideoDiT(nn.Module):
    """``(latents (b, f, c, h, w), timestep (b,))`` -> noise prediction of the same shape."""

    def __init__(self, channels: int = 4, patch: int = 2, hidden: int = 16,
                 conv3d: bool = False) -> None:
        super().__init__()
        self.config = SimpleNamespace(in_channels=channels, patch_size=patch)
        self.embed = nn.Conv3d(channels, hidden, (1, patch, patch), stride=(1, patch, patch)) \
            if conv3d else nn.Conv2d(channels, hidden, patch, stride=patch)
        self.time = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(_Block(hidden) for _ in range(2))
        self.out = nn.Linear(hidden, patch * patch * channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        b, f, c, height, width = x.shape
        p = self.config.patch_size
        rows, cols = height // p, width // p
        if isinstance(self.embed, nn.Conv3d):  # (b, d, f, rows, cols) -> frame-major tokens
            tok = self.embed(x.transpose(1, 2)).flatten(2).transpose(1, 2)
            tok = tok.reshape(b * f, rows * cols, tok.shape[-1])
        else:
            tok = self.embed(x.reshape(b * f, c, height, width)).flatten(2).transpose(1, 2)
        d = tok.shape[-1]
        grid = torch.cat([_sincos(torch.arange(rows).repeat_interleave(cols), d // 2),
                          _sincos(torch.arange(cols).repeat(rows), d // 2)], dim=-1)
        tok = tok + grid[None] + self.time(_sincos(t, d))[:, None].repeat_interleave(f, 0)
        for block in self.blocks:
            tok = block(tok, f)
        out = self.out(tok).view(b, f, rows, cols, p, p, c).permute(0, 1, 6, 2, 4, 3, 5)
        return out.reshape(b, f, c, height, width)


def test_own_video_dit_is_exact_and_denoises_in_bands_of_rows_in_every_frame() -> None:
    torch.manual_seed(0)
    model = VideoDiT(conv3d=True).eval()  # its patch embedding flattens frames, rows, columns
    x, t = torch.randn(1, 3, 4, 8, 8), torch.tensor([10.0])
    cp = tppc.compile(model, (x, t), num_stages=2)
    assert cp.context.patch_grid == (3, 4, 4)
    assert any(len(run.chunks) == 3 for run in cp.validation.runs)
    with torch.no_grad():
        assert_kernels_close(cp(x, t), model(x, t))
    steps = 3
    ref = serial_denoise(model, x, diffusers.DDIMScheduler(), steps, timestep_arg="t",
                         timestep_transform=torch.Tensor.float)
    out = cp.denoise(x, diffusers.DDIMScheduler(), steps, warmup_steps=steps, patches=2,
                     timestep_arg="t")
    assert_kernels_close(out, ref, depth=steps)
    stale = cp.denoise(x, diffusers.DDIMScheduler(), steps, warmup_steps=1, patches=2,
                       timestep_arg="t")  # checked against one chunk after a full warm-up
    assert stale.isfinite().all() and not torch.allclose(stale, ref)


def test_own_video_dit_captured_along_frames_denoises_in_bands_of_frames() -> None:
    """``seq_dims`` on the frame axis: the symbol counts frames, a patch is a band of whole
    frames (contiguous frame-major tokens; spatial attention is then row-wise), and the
    timestep embedding repeated per frame is a positional value that changes every step."""
    torch.manual_seed(0)
    model = VideoDiT().eval()
    x, t = torch.randn(1, 4, 4, 4, 4), torch.tensor([10.0])
    cp = tppc.compile(model, (x, t), num_stages=2, seq_dims={"x": 1})
    assert cp.context.capture_mode == "dynamic" and cp.context.example_seq == 4
    steps = 2
    ref = serial_denoise(model, x, diffusers.DDIMScheduler(), steps, timestep_arg="t",
                         timestep_transform=torch.Tensor.float)
    out = cp.denoise(x, diffusers.DDIMScheduler(), steps, warmup_steps=steps, patches=2,
                     timestep_arg="t")
    assert_kernels_close(out, ref, depth=steps)
    stale = cp.denoise(x, diffusers.DDIMScheduler(), steps, warmup_steps=1, patches=2,
                       timestep_arg="t")
    assert stale.isfinite().all() and not torch.allclose(stale, ref)
