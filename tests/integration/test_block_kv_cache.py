"""``kv_cache()`` and ``max_seq`` on a block-scan capture (issue 31).

A block capture's unit is a block of ``k`` tokens (:mod:`tppc.frontend.block_capture`) while
its K/V buffers hold one row per token (``k`` rows per unit). ``kv_cache()`` returns every
token's K/V after a call and after ``generate`` (all but the last token's, as for any LM), and
``max_seq`` bounds tokens, not blocks. A model of our own: causal attention, then a decayed
recurrence by blocks (:class:`tests.integration.test_block_scan._DecayedSlots`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.integration.test_block_scan import D, K, _DecayedSlots, _eager_greedy
from tests.oracles import assert_kernels_close


class _AttentionThenScan(nn.Module):
    """Token ids → embedding → causal attention (2 heads) → a block scan → logits."""

    def __init__(self, vocab: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.embed = heads, nn.Embedding(vocab, D)
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.scan, self.head = _DecayedSlots(), nn.Linear(D, vocab)

    def kv(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(q, k, v)``, each ``(batch, heads, tokens, D / heads)``."""
        b, t = ids.shape
        return tuple(z.view(b, t, self.heads, -1).transpose(1, 2)
                     for z in self.qkv(self.embed(ids)).chunk(3, -1))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        a = F.scaled_dot_product_attention(*self.kv(input_ids), is_causal=True)
        x = self.embed(input_ids) + self.out(a.transpose(1, 2).reshape(b, t, -1))
        return self.head(self.scan(x))


@pytest.fixture(scope="module")
def attention_scan() -> tuple[nn.Module, tppc.CompiledPipeline]:
    torch.manual_seed(0)
    model = _AttentionThenScan().eval()
    cp = tppc.compile(model, (torch.randint(0, 32, (2, 4 * K)),), num_stages=2,
                      max_seq=8 * K, verify=False)  # the tests compare with eager themselves
    return model, cp


def _assert_kv_equals_eager(model: nn.Module, cp: tppc.CompiledPipeline,
                            ids: torch.Tensor) -> None:
    with torch.no_grad():
        _, k, v = model.kv(ids)
    (got_k, got_v), = cp.kv_cache()
    assert got_k.shape == k.shape == (2, 2, ids.shape[1], D // 2)
    assert_kernels_close(got_k, k)
    assert_kernels_close(got_v, v)


def test_kv_cache_of_a_block_capture_holds_every_token(attention_scan) -> None:
    model, cp = attention_scan
    assert cp.context.block_size == K and len(cp.plan.stages) == 2
    ids = torch.randint(0, 32, (2, 6 * K))
    with torch.no_grad():
        assert_kernels_close(cp(ids), model(ids))
    _assert_kv_equals_eager(model, cp, ids)  # was: 6 rows (one per block) of 24
    # generate: a prompt of a block and a tail, 3 new tokens within the next block
    got = cp.generate(ids[:, :K + 1], max_new_tokens=3)
    assert torch.equal(got, _eager_greedy(model, ids[:, :K + 1], 3))
    _assert_kv_equals_eager(model, cp, got[:, :-1])  # was: 1 row of 7


def test_max_seq_of_a_block_capture_counts_tokens(attention_scan) -> None:
    model, cp = attention_scan  # max_seq = 32 tokens = 8 blocks
    with torch.no_grad():
        assert_kernels_close(cp(ids := torch.randint(0, 32, (2, 8 * K))), model(ids))
    with pytest.raises(tppc.RuntimeInputError, match=r"40 tokens, max_seq=32. fix: compile "
                                                     r"with max_seq=40"):
        cp(torch.randint(0, 32, (2, 10 * K)))  # was accepted: 10 blocks <= 32
    with pytest.raises(tppc.RuntimeInputError, match=r"33 tokens, held as 9 blocks of 4 = 36 "
                                                     r"tokens, max_seq=32. fix: lower "
                                                     r"max_new_tokens to 27"):
        cp.generate(torch.randint(0, 32, (2, 5)), max_new_tokens=28)
