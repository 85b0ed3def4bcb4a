"""A left-padded batch with ``attention_mask`` through a block-scan capture (``k`` × blocks).

Mamba2 zeroes the padding rows before its projections and after its convolution
(``apply_mask_to_padding_states``, the mask sliced ``attention_mask[:, -L:]`` by
``create_recurrent_attention_mask``), so padding adds nothing to the carried states; Falcon-H1
adds causal attention with the padding mask beside that mixer. The slice from ``-L`` keeps
every row (a token value, chunked with the mask's own rows), and the padding mask of the
attention is probed at the block symbol's values (``k`` tokens per unit). A model of our own
with both constructs (a prefix sum by blocks of the masked rows, then causal attention with
the padding mask) at 2 stages in chunks of blocks and in greedy ``generate``; transformers'
Mamba2 and Falcon-H1 against their own ``generate`` token for token.

Tolerance: float32 reassociation only (:func:`assert_kernels_close`); the padding rows' logits
are compared too (the attention of a query with no visible key is 0 in eager and per chunk).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.integration.block_models import falcon_h1
from tests.oracles import assert_kernels_close
from tppc.planner.manual import manual_plan

K, D, VOCAB = 4, 6, 32


def _prefix_blocks(h: torch.Tensor) -> torch.Tensor:
    """A prefix sum over the tokens, by blocks of ``K``: within a block by cumsum, across
    blocks by the cumsum of the block totals (a state carried from block to block)."""
    b, n, d = h.shape
    blocks = F.pad(h, (0, 0, 0, (K - n % K) % K)).reshape(b, -1, K, d)
    totals = blocks.sum(2)
    carried = totals.cumsum(1) - totals
    return (blocks.cumsum(2) + carried[:, :, None]).reshape(b, -1, d)[:, :n]


class _PaddedHybrid(nn.Module):
    """Token ids and a padding mask; per layer, the masked rows into a block scan (Mamba2's
    ``hidden_states * attention_mask[:, -L:, None]``), then causal attention that hides
    padding keys (Falcon-H1's pairing)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.mix = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.qkv = nn.ModuleList(nn.Linear(D, 3 * D) for _ in range(2))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        n = x.shape[1]
        valid = attention_mask[:, -n:]
        pos = torch.arange(n, device=x.device)
        visible = (pos[:, None] >= pos)[None, None] & valid.bool()[:, None, None, :]
        for mix, qkv in zip(self.mix, self.qkv, strict=True):
            x = x + 0.1 * _prefix_blocks(mix(x * valid[:, :, None].to(x.dtype)))
            q, k, v = qkv(x)[:, None].chunk(3, -1)
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=visible)[:, 0]
        return self.head(x)


def _padded(batch: torch.Tensor, pads: tuple[int, ...], pad_id: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` left-padded: row ``r``'s first ``pads[r]`` tokens become ``pad_id``, mask 0."""
    ids, mask = batch.clone(), torch.ones_like(batch)
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = pad_id, 0
    return ids, mask


def _greedy(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy decoding by re-running the whole sequence eagerly, the mask grown by ones."""
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids, mask)[:, -1].argmax(-1, keepdim=True)], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return ids


@pytest.fixture(scope="module")
def hybrid() -> tuple[nn.Module, tppc.CompiledPipeline]:
    torch.manual_seed(0)
    model = _PaddedHybrid().eval()
    ids, mask = _padded(torch.randint(1, VOCAB, (2, 4 * K)), (0, 5))
    return model, tppc.compile(model, (ids, mask), num_stages=2)


def test_a_left_padded_batch_is_exact_in_chunks_of_blocks(hybrid) -> None:
    model, cp = hybrid
    assert cp.context.block_size == K
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, 6, cuts=(0, n // 2, n), boundaries=(0, 1, 2, 4, 6)))
    ids, mask = _padded(torch.randint(1, VOCAB, (2, 6 * K)), (0, 2 * K + 1))
    with torch.no_grad():
        want = model(ids, mask)
        assert (model(ids, torch.ones_like(mask)) - want)[1, -1].abs().max() > 1e-3  # it matters
        assert_kernels_close(staged(ids, mask), want)


def test_a_left_padded_batch_generates_as_eager(hybrid) -> None:
    # prompts of less than a block and of a block and a tail; padding inside the first block
    # and across a block boundary
    model, cp = hybrid
    for prompt, pads in ((3, (0, 2)), (K + 3, (0, K + 1))):
        ids, mask = _padded(torch.randint(1, VOCAB, (2, prompt)), pads)
        got = cp.generate(ids, attention_mask=mask, max_new_tokens=7)
        assert torch.equal(got, _greedy(model, ids, mask, 7))


def _hf_padded_equals_generate(model: nn.Module, vocab: int) -> None:
    """At 2 stages in chunks of blocks a left-padded batch's logits equal eager, and greedy
    ``generate`` with its ``attention_mask`` equals transformers' token for token."""
    ids, mask = _padded(torch.randint(1, vocab, (2, 4 * K)), (0, 5))
    cp = tppc.compile(model, (ids,), {"attention_mask": mask, "use_cache": False}, num_stages=2)
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, 6, cuts=(0, n // 2, n), boundaries=(0, 1, 3, 6)))
    ids, mask = _padded(torch.randint(1, vocab, (2, 6 * K)), (0, K + 1))
    with torch.no_grad():
        assert_kernels_close(staged(ids, attention_mask=mask, use_cache=False).logits,
                             model(ids, attention_mask=mask, use_cache=False).logits)
    ids, mask = _padded(torch.randint(1, vocab, (2, K + 3)), (0, 5))
    want = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert torch.equal(cp.generate(ids, attention_mask=mask, max_new_tokens=9), want)


def test_mamba2_left_padded_batch_equals_transformers_generate() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Mamba2Config(vocab_size=64, hidden_size=8, state_size=2, num_heads=2,
                                       head_dim=8, n_groups=1, expand=2, num_hidden_layers=2,
                                       chunk_size=K, conv_kernel=2, use_cache=False)
    torch.manual_seed(0)
    _hf_padded_equals_generate(transformers.Mamba2ForCausalLM(config).eval(), 64)


def test_falcon_h1_left_padded_batch_equals_transformers_generate() -> None:
    transformers = pytest.importorskip("transformers")
    _hf_padded_equals_generate(falcon_h1(transformers, K), 64)
