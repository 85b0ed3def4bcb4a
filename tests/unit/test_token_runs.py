"""Constant axes merged into the token axis and split off it again (``TokenInfo.runs``).

A gated norm over ``(b·L·h, d)`` rows reshaped back to ``(b, L, h·d)`` (Qwen3-Next's and
Qwen3.5's Gated DeltaNet output, batch > 1) keeps one row group per (batch, token): exact at 2
stages in chunks. The same flattening done after moving the heads before the tokens,
``(b·h·L, d)``, reshaped to ``(b, L, h·d)``, mixes tokens into rows: refused by name.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close
from tppc.planner.manual import manual_plan

D, H, VOCAB = 16, 4, 64


class _Block(nn.Module):
    def __init__(self, heads_first: bool) -> None:
        super().__init__()
        self.proj, self.norm, self.heads_first = nn.Linear(D, D), nn.LayerNorm(D // H), heads_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.proj(x).reshape(b, n, H, D // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True)  # (b, h, L, d)
        y = y.reshape(-1, D // H) if self.heads_first else y.transpose(1, 2).reshape(-1, D // H)
        return x + self.norm(y).reshape(b, n, -1)


class _LM(nn.Module):
    def __init__(self, heads_first: bool = False) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList(_Block(heads_first) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_batch_and_heads_flattened_with_the_tokens_are_exact_in_chunks() -> None:
    torch.manual_seed(0)
    model = _LM().eval()
    cp = tppc.compile(model, (torch.randint(0, VOCAB, (2, 8)),), cluster="2xcpu")
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, 8, cuts=(0, n // 2, n), boundaries=(0, 1, 3, 8)))
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert_kernels_close(staged(ids), model(ids))
        longer = torch.randint(0, VOCAB, (2, 13))
        assert_kernels_close(cp(longer), model(longer))


def test_heads_before_the_tokens_flattened_and_reshaped_to_tokens_is_refused() -> None:
    torch.manual_seed(0)
    with pytest.raises(tppc.AnnotationError, match=r"reshape.*reorders the tokens"):
        tppc.compile(_LM(heads_first=True).eval(), (torch.randint(0, VOCAB, (2, 8)),),
                     cluster="2xcpu")
