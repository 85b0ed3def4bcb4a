"""Issue 31: positions that depend on values, refused by name with the fix that works (and
that fix checked against the eager model).

Positions counted from ``attention_mask`` by ``cumsum`` (OPT's padded positions; here a model
of our own) are refused by the chunk pass, naming the cumulative sum and ``position_ids``;
passed as ``position_ids`` they are exact. Rotary tables that depend on the call's length
(dynamic NTK, Phi-3's longrope) are exact: ``test_length_ropes.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close

VOCAB = 64


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, t, -1))


class CountedPositionsLM(nn.Module):
    """A causal LM whose positions skip padding: ``cumsum(attention_mask) - 1``."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(256, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(2))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        x = self.emb(ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _padded() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0
    return ids, mask


def test_positions_counted_by_cumsum_are_refused_naming_position_ids() -> None:
    model = CountedPositionsLM().eval()
    ids, mask = _padded()
    with pytest.raises(tppc.TppcError, match=r"cumulative sum.*fix: pass the positions as "
                                             r"an input.*position_ids"):
        tppc.compile(model, (ids, mask), cluster="2xcpu", num_stages=2, chunks=3)


def test_positions_passed_as_position_ids_are_exact() -> None:
    model = CountedPositionsLM().eval()
    ids, mask = _padded()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cp = tppc.compile(model, (ids, mask), {"position_ids": positions}, cluster="2xcpu",
                      num_stages=2, chunks=3)
    with torch.no_grad():
        assert_kernels_close(cp(ids, mask, position_ids=positions), model(ids, mask))


def test_opt_padded_positions_refused_naming_position_ids_and_that_fix_is_exact() -> None:
    """transformers' own ``OPTForCausalLM``: positions ``cumsum(attention_mask)`` refused by
    name; the fix the error gives (``position_ids``) exact on every row at 2 stages, and in
    ``generate`` on padded prompts (positions counted as HF counts them)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                    ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32,
                                    max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    model = transformers.OPTForCausalLM(config).eval()
    ids, mask = _padded()
    with pytest.raises(tppc.PassError, match=r"(?s)'cumsum'.*attention_mask.*fix: pass the "
                                             r"positions as an input.*position_ids="):
        tppc.compile(model, (ids,), {"attention_mask": mask}, cluster="2xcpu", num_stages=2,
                     chunks=3)
    positions = mask.cumsum(-1) * mask - 1  # the fix, as the error words it
    cp = tppc.compile(model, (ids,), {"attention_mask": mask, "position_ids": positions},
                      cluster="2xcpu", num_stages=2, chunks=3)
    assert len(cp.plan.stages) == 2
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        assert_kernels_close(cp(ids, attention_mask=mask, position_ids=positions).logits, want)
        counted = model(ids, attention_mask=mask, position_ids=torch.arange(16).expand(2, 16))
        assert (counted.logits[0] - want[0]).abs().max() > 1e-3  # the positions matter
    prompt, prompt_mask = ids[:, :10].masked_fill(mask[:, :10] == 0, 1), mask[:, :10]
    stop = {"eos_token_id": None, "pad_token_id": 1}
    assert torch.equal(cp.generate(prompt, attention_mask=prompt_mask, max_new_tokens=6, **stop),
                       model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=6,
                                      do_sample=False, **stop))
