"""A recurrent block of our own: a gated log-space scan (minGRU's parallel form: ``cumsum``
and ``logcumsumexp`` over the tokens) after a causal depthwise short convolution, then an MLP.
The test suite's recurrent model and ``benchmarks/recurrent_prefill.py`` both build it."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ScanBlock"]


class ScanBlock(nn.Module):
    """Hidden ``d``, scan channels ``e``, MLP width ``ff``, convolution kernel ``k``."""

    def __init__(self, d: int, e: int, ff: int, k: int = 4) -> None:
        super().__init__()
        self.norm, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.inp, self.out = nn.Linear(d, 3 * e), nn.Linear(e, d)
        self.conv = nn.Conv1d(e, e, k, padding=k - 1, groups=e)
        self.up, self.down = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        u, gate, z = self.inp(self.norm(x)).chunk(3, -1)
        u = F.silu(self.conv(u.transpose(1, 2))[..., :n].transpose(1, 2))
        log_a = -F.softplus(gate)                                  # decay a_t in (0, 1)
        log_b = -F.softplus(-gate) + torch.log(F.softplus(u) + 1e-3)
        a_star = torch.cumsum(log_a, dim=1)
        h = torch.exp(a_star + torch.logcumsumexp(log_b - a_star, dim=1))
        x = x + self.out(h * F.silu(z))
        return x + self.down(F.gelu(self.up(self.norm2(x))))
