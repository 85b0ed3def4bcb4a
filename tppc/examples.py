"""Factories of small models for demos, tests and ``tppc graph MODULE:FACTORY``.

Each factory returns ``(model, example_args, example_kwargs)`` with random weights (seeded);
nothing is downloaded. ``hf_*`` factories need the ``hf`` extra (transformers, diffusers).
"""

from __future__ import annotations

from typing import Any

import torch

from tppc.models import GPT, DiT, DiTConfig, GPTConfig

__all__ = ["dit", "gpt", "hf_dit", "hf_gpt2", "hf_llama"]

Example = tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]


def gpt(seq_len: int = 64, n_layer: int = 4) -> Example:
    """Own causal GPT: 4 blocks, hidden 64, vocab 256."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer)).eval()
    return model, (torch.randint(0, 256, (1, seq_len)),), {}


def dit(size: int = 16, depth: int = 4) -> Example:
    """Own DiT: 4 adaLN-Zero blocks, patch 2, latents 4×size×size."""
    torch.manual_seed(0)
    model = DiT(DiTConfig(depth=depth)).eval()
    x = torch.randn(1, 4, size, size)
    return model, (x, torch.tensor([10]), torch.tensor([3])), {}


def hf_llama(seq_len: int = 32, layers: int = 2) -> Example:
    """transformers LlamaForCausalLM from a tiny config (GQA: 4 heads, 2 K/V heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    return model, (torch.randint(0, 128, (1, seq_len)),), {}


def hf_gpt2(seq_len: int = 32, layers: int = 2) -> Example:
    """transformers GPT2LMHeadModel from a tiny config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=layers, n_head=4, n_positions=1024,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    return model, (torch.randint(0, 128, (1, seq_len)),), {}


def hf_dit(size: int = 8, layers: int = 2) -> Example:
    """diffusers DiTTransformer2DModel from a tiny config (class-conditional, adaLN-Zero)."""
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    model = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        num_layers=layers, sample_size=size, patch_size=2, num_embeds_ada_norm=10,
        norm_type="ada_norm_zero",
    ).eval()
    x = torch.randn(1, 4, size, size)
    kwargs = {"timestep": torch.tensor([10]), "class_labels": torch.tensor([3]),
              "return_dict": False}
    return model, (x,), kwargs
