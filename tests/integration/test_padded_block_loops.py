"""A recurrence stepped over the blocks of a sequence padded to whole blocks, in Python.

transformers' ``Qwen3NextForCausalLM`` (Gated DeltaNet's chunked delta rule: the sequence
padded to blocks of 64, ``for i in range(num_chunks)`` over the blocks, outputs written in
place ``core_attn_out[:, :, i] = …``, the state update reading the block's own corrected
values) and a model of our own in that form with a vector state and a static row loop inside
each block. The capture exports the model with the length ``k × blocks`` (the padding
empty), re-rolls the loop over the blocks (docs/capture.md#re-rolled-loops) and drops the
empty pad before propagating symbolic shapes (its fake kernel pinned the length). Checked
against eager at 2 stages in chunks of one block, at other whole numbers of blocks, in
``generate`` and through ``tppc.export``/``tppc.load``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close, greedy_reference
from tppc.planner.manual import manual_plan

D, E, K, VOCAB = 16, 4, 4, 64


class PaddedBlockDelta(nn.Module):
    """Per block of ``K`` rows: values corrected by the state (``v − tanh(k ⊙ s)``), a
    lower-triangular mix built row by row in place (plus ``eye``), ``y = q ⊙ s + mix·v'``,
    then ``s ← 0.9·s + Σ v'`` (the block's own corrected values): a vector state."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(D, 3 * E), nn.Linear(E, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        pad = (K - n % K) % K
        q, k, v = (F.pad(t, (0, 0, 0, pad)).reshape(b, -1, K, E)
                   for t in self.proj(x).split(E, dim=-1))
        mix = torch.sigmoid(q @ k.transpose(-1, -2)).tril(-1)
        for j in range(1, K):  # static: rows of a block, written in place
            mix[..., j, :j] = mix[..., j, :j] + 0.5 * mix[..., j - 1, :j]
        mix = mix + torch.eye(K)
        state = torch.zeros(b, E)
        out = torch.zeros_like(v)
        for i in range(q.shape[1]):
            v_new = v[:, i] - torch.tanh(k[:, i] * state[:, None])
            out[:, i] = q[:, i] * state[:, None] + mix[:, i] @ v_new
            state = 0.9 * state + v_new.sum(1)
        return x + self.out(out.reshape(b, -1, E)[:, :n])


class PaddedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList(PaddedBlockDelta() for _ in range(2))

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            if attention_mask is not None:  # padding rows zeroed (a state-space mixer's way)
                x = x * attention_mask[:, :, None]
            x = block(x)
        return self.head(x)


class SortedExperts(nn.Module):
    """Rows sorted by their expert, scaled by it, put back in order and viewed as
    ``(b, n, D)`` (a mixture-of-experts dispatch): row-wise as a region."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.gate, self.scale = nn.Linear(D, experts), nn.Parameter(torch.randn(experts, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        rows = x.reshape(-1, D)
        expert = self.gate(rows).argmax(-1)
        order = torch.sort(expert, stable=True).indices
        done = rows[order] * self.scale[expert[order]]
        return x + torch.empty_like(done).index_copy(0, order, done).view(b, n, D)


class PaddedMoELM(PaddedLM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(PaddedBlockDelta(), SortedExperts())
                                    for _ in range(2))


def test_own_padded_loop_beside_sorted_experts_is_exact_in_chunks() -> None:
    """The experts' ``view(b, n, D)`` takes a size the re-rolled capture computes (``4·n``,
    placed before it in no module): the experts are still one row-wise region (refused
    before: "sort mixes values along the token axis")."""
    torch.manual_seed(0)
    model = PaddedMoELM().eval()
    cp = tppc.compile(model, (torch.randint(0, VOCAB, (1, 2 * K)),), cluster="2xcpu")
    staged = _two_stages(cp, 4, (0, 1, 2, 4))
    ids = torch.randint(0, VOCAB, (1, 4 * K))
    with torch.no_grad():
        assert_kernels_close(staged(ids), model(ids))


def _two_stages(cp: tppc.CompiledPipeline, blocks: int, bounds: tuple[int, ...]
                ) -> tppc.CompiledPipeline:
    n = len(cp.context.layers)
    return cp.with_plan(manual_plan(n, blocks, cuts=(0, n // 2, n), boundaries=bounds))


def test_own_padded_loop_over_blocks_is_exact_in_chunks_generate_and_export(tmp_path) -> None:
    torch.manual_seed(0)
    model = PaddedLM().eval()
    cp = tppc.compile(model, (torch.randint(0, VOCAB, (1, 2 * K)),), cluster="2xcpu")
    assert cp.context.block_size == K and "test_padded_block_loops.py" in cp.context.rerolled
    staged = _two_stages(cp, 4, (0, 1, 2, 4))
    ids = torch.randint(0, VOCAB, (1, 4 * K))
    with torch.no_grad():
        assert_kernels_close(staged(ids), model(ids))
        longer = torch.randint(0, VOCAB, (1, 6 * K))
        assert_kernels_close(cp(longer), model(longer))
        with pytest.raises(tppc.RuntimeInputError, match=f"multiple of {K}"):
            cp(longer[:, :K + 1])
        # a 2-D mask too (a left-padded batch): captured again, both inputs one length
        mask = torch.ones(2, 4 * K, dtype=torch.long)
        mask[0, :3] = 0
        batch = torch.randint(0, VOCAB, (2, 4 * K))
        assert_kernels_close(cp(batch, attention_mask=mask), model(batch, attention_mask=mask))
    prompt = ids[:, :K + 2]
    want = greedy_reference(model, prompt, 4)
    assert torch.equal(cp.generate(prompt, max_new_tokens=4), want)
    tppc.export(staged, tmp_path)  # the in-place rows as select_scatter, eye as a constant
    runner = tppc.load(tmp_path, threads_per_stage=1)
    with torch.no_grad():
        assert_kernels_close(torch.from_numpy(runner(ids.numpy())), model(ids))
    assert (runner.generate(prompt.numpy(), max_new_tokens=4) == want.numpy()).all()


def _qwen3_next(transformers) -> nn.Module:
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_value_heads=2,
        linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=2, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention"], use_cache=False)).eval()


def test_qwen3_next_gated_deltanet_is_exact_at_two_stages_generate_and_export(
        tmp_path) -> None:
    """Gated DeltaNet beside gated attention and experts (blocks of 64 tokens): was refused
    naming its pad node. A batch of 2 was refused too, wrongly: the fake forward's
    ``_grouped_mm`` meta kernel wants bfloat16, the CPU kernel takes float32."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _qwen3_next(transformers)
    block = 64
    cp = tppc.compile(model, (torch.randint(0, VOCAB, (1, 2 * block)),), {"use_cache": False},
                      cluster="2xcpu")
    assert cp.context.block_size == block and "modeling_qwen3_next.py" in cp.context.rerolled
    staged = _two_stages(cp, 4, (0, 1, 3, 4))
    ids = torch.randint(0, VOCAB, (1, 4 * block))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        assert_kernels_close(staged(ids, use_cache=False).logits, want)
        longer = torch.randint(0, VOCAB, (2, 5 * block))  # a batch of 2: captured again
        assert_kernels_close(cp(longer, use_cache=False).logits,
                             model(longer, use_cache=False).logits)
    prompt = ids[:, :3]
    reference = greedy_reference(lambda x: model(x, use_cache=False).logits, prompt, 4)
    assert torch.equal(cp.generate(prompt, max_new_tokens=4), reference)
    tppc.export(staged, tmp_path)
    runner = tppc.load(tmp_path, threads_per_stage=1)
    got = torch.from_numpy(runner(ids.numpy(), use_cache=False)["logits"])
    assert_kernels_close(got, want)
    assert (runner.generate(prompt.numpy(), max_new_tokens=4) == reference.numpy()).all()
