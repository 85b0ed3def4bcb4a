"""Float attention biases: which masks are biases, and what the row evaluation refuses.

Oracles: the eager model, and masks whose kind is known by construction (a 0/-inf causal
mask is no bias; a table read from a parameter is one even while it is all zeros).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close
from tppc.ir.records import TOKEN


class _Attn(nn.Module):
    def __init__(self, kind: str, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.kind, self.heads = kind, heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.table = nn.Parameter(torch.zeros(8, heads))  # a bias per distance, zero-init

    def bias(self, t: int, device: torch.device) -> torch.Tensor:
        i = torch.arange(t, device=device)
        later = i[None, :] > i[:, None]
        if self.kind == "plain":  # 0 / -inf: a causal pattern, no bias
            return torch.zeros(t, t, device=device).masked_fill(later, float("-inf"))
        if self.kind == "table":
            dist = (i[:, None] - i[None, :]).clamp(0, 7)
            return self.table[dist].permute(2, 0, 1).masked_fill(later, float("-inf"))
        if self.kind == "window":  # ALiBi within a sliding window of 4 keys
            dist = (i[:, None] - i[None, :]).float()
            return (-0.5 * dist).masked_fill(later | (dist >= 4), float("-inf"))
        rel = (i[None, :] - i[:, None]).float()  # "cumsum": mixes the query rows
        return rel.cumsum(0).masked_fill(later, float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias(t, x.device))
        return x + self.proj(y.transpose(1, 2).reshape(b, t, d))


class _Toy(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)
        self.blocks = nn.ModuleList(_Attn(kind) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _mask_of(model: nn.Module, ids: torch.Tensor):
    gm, _ = tppc.annotate(model, (ids,))
    infos = [n.meta[TOKEN] for n in gm.graph.nodes
             if TOKEN in n.meta and n.meta[TOKEN].role == "mixing"]
    assert len(infos) == 2 and {i.attention for i in infos} == {"causal"}
    return infos[0].mask


def test_a_zero_and_minus_inf_mask_is_causal_and_a_parameter_table_is_a_bias() -> None:
    ids = torch.randint(0, 32, (1, 12))
    assert _mask_of(_Toy("plain").eval(), ids) is None  # rebuilt by the op: no bias
    mask = _mask_of(_Toy("table").eval(), ids)  # all zeros now, but read from a parameter
    assert mask is not None and mask.bias and mask.window is None


def test_a_compiled_bias_table_follows_its_parameter_when_it_changes() -> None:
    """The table is zero at compile time; the program still reads it, so training it later
    (in place: the stages alias the model's parameters) changes the pipeline's outputs."""
    model = _Toy("table").eval()
    ids = torch.randint(0, 32, (1, 12))
    cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=3)
    with torch.no_grad():
        for block in model.blocks:
            block.table.normal_(std=2.0)
        want = model(ids)
        assert_kernels_close(cp(ids), want)


def test_a_bias_computed_across_query_rows_is_refused_by_name() -> None:
    model = _Toy("cumsum").eval()
    ids = torch.randint(0, 32, (1, 12))
    with pytest.raises(tppc.PassError) as info:
        tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=3)
    text = str(info.value)
    assert "float attention bias" in text and "cumsum" in text and "query axis" in text
    assert "blocks.0" in text


def test_the_memory_rule_counts_the_rows_of_a_float_bias() -> None:
    """A chunk of ``c`` queries reads ``c × L`` bias values per head (2 heads, fp32): the
    predicted stage memory grows by that over a 0/-inf mask, within 64 bytes per chunk
    token (the rule takes the largest layer's transient bytes: with the mask dropped, that
    need not be the attention's layer)."""
    ids = torch.randint(0, 32, (1, 256))
    plans = {kind: tppc.plan(_Toy(kind).eval(), (ids,), cluster="2xcpu", num_stages=2,
                             chunks=4) for kind in ("plain", "table")}
    assert plans["table"].boundaries == plans["plain"].boundaries == (0, 64, 128, 192, 256)
    for plain, table in zip(plans["plain"].stages, plans["table"].stages, strict=True):
        assert abs(table.memory_bytes - plain.memory_bytes - 64 * 256 * 2 * 4) <= 64 * 64


def test_alibi_in_a_sliding_window_keeps_the_window_and_is_exact() -> None:
    model = _Toy("window").eval()
    ids = torch.randint(0, 32, (1, 12))
    mask = _mask_of(model, ids)
    assert mask is not None and mask.bias and mask.window == 4
    cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=3)
    with torch.no_grad():
        assert_kernels_close(cp(ids), model(ids))
