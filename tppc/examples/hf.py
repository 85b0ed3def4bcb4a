"""Factories of small models for demos, tests and ``tppc graph MODULE:FACTORY``.

Each factory returns ``(model, example_args, example_kwargs)`` with random weights (seeded);
nothing is downloaded. ``hf_*`` factories need the ``hf`` extra (transformers, diffusers).
"""

from __future__ import annotations

from typing import Any

import torch

from tppc.examples.models import GPT, DiT, DiTConfig, GPTConfig

__all__ = ["dit", "gpt", "hf_cogvideox", "hf_dit", "hf_flux", "hf_gemma3", "hf_gpt2",
           "hf_hunyuan_dit", "hf_llama", "hf_mamba2", "hf_mistral", "hf_mixtral", "hf_pixart", "hf_qwen3",
           "hf_sd3"]

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


def hf_mamba2(seq_len: int = 16, layers: int = 2, block: int = 4) -> Example:
    """transformers Mamba2ForCausalLM from a tiny config: blocks of ``block`` tokens (SSD
    ``chunk_size``), captured as ``block`` × blocks (a block scan)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    cfg = Mamba2Config(vocab_size=64, hidden_size=8, state_size=2, num_heads=2, head_dim=8,
                       n_groups=1, expand=2, num_hidden_layers=layers, chunk_size=block,
                       conv_kernel=2, use_cache=False)
    model = Mamba2ForCausalLM(cfg).eval()
    return model, (torch.randint(0, 64, (1, seq_len)),), {}


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


def hf_pixart(size: int = 8, layers: int = 2, text_len: int = 6) -> Example:
    """diffusers PixArtTransformer2DModel (cross-attention to T5 text states), tiny config."""
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    model = PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
        num_layers=layers, sample_size=size, patch_size=2, cross_attention_dim=16,
        caption_channels=12, norm_type="ada_norm_single", use_additional_conditions=False,
    ).eval()
    kwargs = {"encoder_hidden_states": torch.randn(1, text_len, 12),
              "timestep": torch.tensor([10]), "return_dict": False}
    return model, (torch.randn(1, 4, size, size),), kwargs


def hf_flux(tokens: int = 16, layers: int = 1, single_layers: int = 2,
            text_len: int = 6) -> Example:
    """diffusers FluxTransformer2DModel (joint attention; double- then single-stream blocks)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=layers, num_single_layers=single_layers,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=12,
        pooled_projection_dim=10, axes_dims_rope=(2, 2, 4),
    ).eval()
    side = int(tokens**0.5)
    rows = torch.arange(tokens) // side
    img_ids = torch.stack([torch.zeros(tokens), rows, torch.arange(tokens) % side], -1).float()
    kwargs = {"encoder_hidden_states": torch.randn(1, text_len, 12),
              "pooled_projections": torch.randn(1, 10), "timestep": torch.tensor([0.5]),
              "img_ids": img_ids, "txt_ids": torch.zeros(text_len, 3), "return_dict": False}
    return model, (torch.randn(1, tokens, 4),), kwargs


def hf_sd3(size: int = 8, layers: int = 2, text_len: int = 6) -> Example:
    """diffusers SD3Transformer2DModel (joint attention, text tokens after the image)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=size, patch_size=2, in_channels=4, out_channels=4, num_layers=layers,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=12,
        caption_projection_dim=16, pooled_projection_dim=10, pos_embed_max_size=16,
    ).eval()
    kwargs = {"encoder_hidden_states": torch.randn(1, text_len, 12),
              "pooled_projections": torch.randn(1, 10), "timestep": torch.tensor([10.0]),
              "return_dict": False}
    return model, (torch.randn(1, 4, size, size),), kwargs


def hf_hunyuan_dit(size: int = 8, layers: int = 4) -> Example:
    """diffusers HunyuanDiT2DModel (cross-attention to two text encoders, long skips)."""
    from diffusers import HunyuanDiT2DModel
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    torch.manual_seed(0)
    model = HunyuanDiT2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2,
        sample_size=size, hidden_size=16, num_layers=layers, cross_attention_dim=12,
        cross_attention_dim_t5=16, pooled_projection_dim=8, text_len=6, text_len_t5=5,
        use_style_cond_and_image_meta_size=False,
    ).eval()
    grid = size // 2
    rope = get_2d_rotary_pos_embed(8, ((0, 0), (grid, grid)), (grid, grid))
    kwargs = {"timestep": torch.tensor([10.0]), "encoder_hidden_states": torch.randn(1, 6, 12),
              "text_embedding_mask": torch.ones(1, 6),
              "encoder_hidden_states_t5": torch.randn(1, 5, 16),
              "text_embedding_mask_t5": torch.ones(1, 5), "image_rotary_emb": rope,
              "return_dict": False}
    return model, (torch.randn(1, 4, size, size),), kwargs


def hf_cogvideox(size: int = 8, frames: int = 2, layers: int = 2) -> Example:
    """diffusers CogVideoXTransformer3DModel (video latents (b, f, c, h, w), text prefix)."""
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        num_layers=layers, sample_width=size, sample_height=size,
        sample_frames=(frames - 1) * 4 + 1, patch_size=2, text_embed_dim=12, time_embed_dim=8,
        max_text_seq_length=6, temporal_compression_ratio=4,
    ).eval()
    kwargs = {"encoder_hidden_states": torch.randn(1, 6, 12), "timestep": torch.tensor([10]),
              "return_dict": False}
    return model, (torch.randn(1, frames, 4, size, size),), kwargs


def hf_hunyuan_video(size: int = 8, frames: int = 2) -> Example:
    """diffusers HunyuanVideoTransformer3DModel (latents (b, c, f, h, w), text after the
    frames, a token refiner, a prompt mask), a tiny random config."""
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4)).eval()
    kwargs = {"timestep": torch.tensor([10]), "encoder_hidden_states": torch.randn(1, 6, 16),
              "encoder_attention_mask": torch.ones(1, 6), "pooled_projections": torch.randn(1, 8),
              "guidance": torch.tensor([3.0]), "return_dict": False}
    return model, (torch.randn(1, 4, frames, size, size),), kwargs


def hf_mistral(seq_len: int = 32, layers: int = 2, window: int = 8) -> Example:
    """transformers MistralForCausalLM, tiny config with a sliding window of ``window``."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024, sliding_window=window)
    model = MistralForCausalLM(cfg).eval()
    return model, (torch.randint(0, 128, (1, seq_len)),), {}


def hf_gemma3(seq_len: int = 32, layers: int = 3, window: int = 8) -> Example:
    """transformers Gemma3ForCausalLM (text), tiny config: sliding-window layers of
    ``window`` keys, every third layer global."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                           sliding_window=window, sliding_window_pattern=3,
                           attn_implementation="sdpa")
    model = Gemma3ForCausalLM(cfg).eval()
    return model, (torch.randint(0, 128, (1, seq_len)),), {}


def hf_qwen3(seq_len: int = 32, layers: int = 2) -> Example:
    """transformers Qwen3ForCausalLM from a tiny config (q/k norms)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=1024)
    model = Qwen3ForCausalLM(cfg).eval()
    return model, (torch.randint(0, 128, (1, seq_len)),), {}


def hf_mixtral(seq_len: int = 32, layers: int = 2, experts: str = "grouped_mm",
               num_experts: int = 4) -> Example:
    """transformers MixtralForCausalLM, tiny config (``num_experts`` experts, top-2), with
    transformers' expert implementation ``experts`` (``eager``, ``batched_mm``,
    ``grouped_mm``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024, num_local_experts=num_experts,
                        num_experts_per_tok=2, experts_implementation=experts)
    model = MixtralForCausalLM(cfg).eval()
    return model, (torch.randint(0, 128, (1, seq_len)),), {}
