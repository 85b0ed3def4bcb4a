"""Qwen2-MoE (top-k experts plus a gated shared expert) pipelines exactly (issue 9)."""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close

pytest.importorskip("transformers")


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm"])
def test_qwen2_moe_equals_eager(experts: str) -> None:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                         moe_intermediate_size=48, shared_expert_intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
                         experts_implementation=experts)
    model = Qwen2MoeForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 24))
    cp = tppc.compile(model, (ids,), chunks=3)
    assert len(cp.plan.chunk_sizes) == 3
    longer = torch.randint(0, 128, (1, 40))
    for x in (ids, longer):
        assert_kernels_close(cp(x).logits, model(x).logits)
