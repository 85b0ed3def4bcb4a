"""Tiny transformers block-scan models shared by the block-scan test modules."""

from __future__ import annotations

from typing import Any

import torch


def falcon_h1(transformers: Any, block: int) -> torch.nn.Module:
    """FalconH1ForCausalLM (Mamba2's mixer beside causal attention), blocks of ``block``
    rows, vocabulary 64, seeded."""
    config = transformers.FalconH1Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, mamba_d_ssm=16,
        mamba_n_heads=2, mamba_d_head=8, mamba_d_state=2, mamba_n_groups=1, mamba_d_conv=2,
        mamba_chunk_size=block, mamba_expand=1, use_cache=False)
    torch.manual_seed(0)
    return transformers.FalconH1ForCausalLM(config).eval()
