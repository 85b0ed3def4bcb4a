"""A small diffusion transformer (DiT): patchify, adaLN-Zero blocks, unpatchify.

Latents ``(b, c, h, w)`` are cut into ``p × p`` patches; the patch grid, row-major, is the
token axis. Positions use 2-D sine/cosine tables computed from ``arange`` (so any height
works), the timestep and class label condition every block through adaLN modulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["DiT", "DiTConfig"]


@dataclass(kw_only=True, frozen=True)
class DiTConfig:
    """Shape of a :class:`DiT`."""

    in_channels: int = 4
    """Latent channels."""
    patch_size: int = 2
    """Side of a square patch."""
    hidden: int = 64
    """Hidden size."""
    depth: int = 4
    """Number of DiT blocks."""
    n_head: int = 4
    """Attention heads per block."""
    num_classes: int = 10
    """Number of class labels."""


def _sincos(pos: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=pos.device) / half)
    ang = pos.float()[:, None] * freq[None, :]
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class DiTBlock(nn.Module):
    """adaLN-Zero block: modulated attention and MLP with gated residuals."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.n_head = cfg.n_head
        self.norm1 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.norm2 = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(approximate="tanh"), nn.Linear(4 * h, h))
        self.ada = nn.Linear(h, 6 * h)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        sh1, sc1, g1, sh2, sc2, g2 = self.ada(F.silu(c)).unsqueeze(1).chunk(6, dim=-1)
        y = self.norm1(x) * (1 + sc1) + sh1
        q, k, v = self.qkv(y).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + g1 * self.proj(a)
        return x + g2 * self.mlp(self.norm2(x) * (1 + sc2) + sh2)


class DiT(nn.Module):
    """``(latents (b,c,h,w), timestep (b,), class_labels (b,))`` -> noise prediction."""

    def __init__(self, cfg: DiTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or DiTConfig()
        self.patch_size = cfg.patch_size
        h = cfg.hidden
        self.patch = nn.Conv2d(cfg.in_channels, h, cfg.patch_size, stride=cfg.patch_size)
        self.t_mlp = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, h))
        self.y_emb = nn.Embedding(cfg.num_classes, h)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.depth))
        self.norm_f = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.ada_f = nn.Linear(h, 2 * h)
        self.out = nn.Linear(h, cfg.patch_size**2 * cfg.in_channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, ch, height, width = x.shape
        p = self.patch_size
        hp, wp = height // p, width // p
        tok = self.patch(x).flatten(2).transpose(1, 2)
        rows = torch.arange(hp, device=x.device).repeat_interleave(wp)
        cols = torch.arange(wp, device=x.device).repeat(hp)
        half = tok.shape[-1] // 2
        tok = tok + torch.cat([_sincos(rows, half), _sincos(cols, half)], dim=-1)[None]
        c = self.t_mlp(_sincos(t, tok.shape[-1])) + self.y_emb(y)
        for block in self.blocks:
            tok = block(tok, c)
        shift, scale = self.ada_f(F.silu(c)).unsqueeze(1).chunk(2, dim=-1)
        tok = self.out(self.norm_f(tok) * (1 + scale) + shift)
        tok = tok.view(b, hp, wp, p, p, ch).permute(0, 5, 1, 3, 2, 4)
        return tok.reshape(b, ch, height, width)
