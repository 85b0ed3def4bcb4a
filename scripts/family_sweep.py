"""Every transformers causal-LM family of a list, tiny and random: exact, refused or crashed.

A coverage sweep, not a benchmark: each family is built from a small config (the generic
sizes below, or its own builder where the generic config does not build), compiled at 2 stages
in 3 chunks from a 24-token example (or its block length), and compared with eager at the
example's length and a longer one. A family is EXACT (max abs diff < 1e-4 at both), WRONG
(a silent difference: a bug), REFUSED (a TppcError: the message is printed) or CRASH (any
other exception: a bug). With --generate it also compares ``cp.generate`` on a left-padded
batch of 2 with transformers' greedy ``model.generate``.

    PYTHONPATH=. .venv/bin/python scripts/family_sweep.py GemmaForCausalLM OlmoForCausalLM
    PYTHONPATH=. .venv/bin/python scripts/family_sweep.py --all      # every family below
"""

from __future__ import annotations

import argparse
import time
import traceback
import warnings
from collections.abc import Callable

import torch
import transformers as T

import tppc
from tppc.errors import TppcError

_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, vocab_size=128, head_dim=8, max_position_embeddings=256,
              n_embd=32, n_layer=2, n_head=4, d_model=32, n_positions=256, num_layers=2,
              moe_intermediate_size=32, num_experts=4, n_routed_experts=4, num_local_experts=4,
              num_experts_per_tok=2, shared_expert_intermediate_size=32, n_shared_experts=1,
              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
              qk_nope_head_dim=4, v_head_dim=8, ffn_hidden_size=64, n_inner=64, rotary_dim=4,
              use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
              mamba_expand=2, mamba_chunk_size=8, mamba_d_conv=4)
_BASE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=64, use_cache=False, pad_token_id=0)


def _generic(name: str, attn: str) -> torch.nn.Module:
    cls = getattr(T, name)
    base = cls.config_class()
    kw = {k: v for k, v in _SMALL.items() if hasattr(base, k)}
    return cls(cls.config_class(**kw, attn_implementation=attn))


_OWN: dict[str, Callable[[], torch.nn.Module]] = {
    "DeepseekV2ForCausalLM": lambda: T.DeepseekV2ForCausalLM(T.DeepseekV2Config(
        **{**_BASE, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        attn_implementation="sdpa")),
    "MiniCPM3ForCausalLM": lambda: T.MiniCPM3ForCausalLM(T.MiniCPM3Config(
        **{**_BASE, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, attn_implementation="sdpa")),
    "DeepseekV3ForCausalLM": lambda: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **{**_BASE, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
        topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, attn_implementation="sdpa")),
    "BambaForCausalLM": lambda: T.BambaForCausalLM(T.BambaConfig(
        **_BASE, **_MAMBA, attn_layer_indices=[1], attn_implementation="sdpa")),
    "GraniteMoeHybridForCausalLM": lambda: T.GraniteMoeHybridForCausalLM(
        T.GraniteMoeHybridConfig(**_BASE, **_MAMBA, layer_types=["mamba", "attention"],
                                 num_local_experts=4, num_experts_per_tok=2,
                                 shared_intermediate_size=32, attn_implementation="sdpa")),
    "NemotronHForCausalLM": lambda: T.NemotronHForCausalLM(T.NemotronHConfig(
        **{**_BASE, "num_hidden_layers": 3}, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
        ssm_state_size=8, chunk_size=8, hybrid_override_pattern="M*-", head_dim=8,
        attn_implementation="sdpa")),
    "Lfm2MoeForCausalLM": lambda: T.Lfm2MoeForCausalLM(T.Lfm2MoeConfig(
        **_BASE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_dense_layers=1, layer_types=["conv", "full_attention"], attn_implementation="sdpa")),
    "GPTNeoForCausalLM": lambda: T.GPTNeoForCausalLM(T.GPTNeoConfig(
        vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=256,
        attention_types=[[["global", "local"], 1]], window_size=8, use_cache=False,
        attn_implementation="eager")),
    "DbrxForCausalLM": lambda: T.DbrxForCausalLM(T.DbrxConfig(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=128,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
        use_cache=False, pad_token_id=0, attn_implementation="sdpa")),
    "RwkvForCausalLM": lambda: _called_once(_generic("RwkvForCausalLM", "eager")),
}
"""Families whose generic tiny config does not build (or builds an inconsistent model), or
that must run once before compiling (RWKV rescales its weights in place on its first call
in eval mode; tppc refuses a forward that writes a parameter)."""


def _called_once(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        model.eval()(torch.tensor([[3, 4]]))
    return model


_EAGER_ONLY = ("MptForCausalLM", "XGLMForCausalLM", "RwkvForCausalLM", "VaultGemmaForCausalLM")
_BLOCKS = {"BambaForCausalLM": 16, "GraniteMoeHybridForCausalLM": 16, "NemotronHForCausalLM": 16,
           "Qwen3_5ForCausalLM": 128, "Qwen3_5MoeForCausalLM": 128, "KimiLinearForCausalLM": 128,
           "Qwen3NextForCausalLM": 128}
"""Example lengths of families that pad to blocks (two blocks)."""

ALL = ["GemmaForCausalLM", "ApertusForCausalLM", "ArceeForCausalLM", "BitNetForCausalLM",
       "CodeGenForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "DeepseekV2ForCausalLM",
       "DeepseekV3ForCausalLM", "DiffLlamaForCausalLM", "DbrxForCausalLM", "DogeForCausalLM", "Dots1ForCausalLM",
       "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM", "Exaone4ForCausalLM",
       "FlexOlmoForCausalLM", "GPTBigCodeForCausalLM", "GPTJForCausalLM", "GPTNeoForCausalLM",
       "GlmForCausalLM", "Glm4ForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM",
       "GraniteMoeSharedForCausalLM", "HeliumForCausalLM", "HunYuanDenseV1ForCausalLM",
       "HunYuanMoEV1ForCausalLM", "JetMoeForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM",
       "MiniCPM3ForCausalLM", "MinistralForCausalLM", "MptForCausalLM", "NemotronForCausalLM",
       "Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoeForCausalLM", "PersimmonForCausalLM",
       "PhiForCausalLM", "PhimoeForCausalLM", "SeedOssForCausalLM", "SmolLM3ForCausalLM",
       "StableLmForCausalLM", "XGLMForCausalLM", "BioGptForCausalLM", "CwmForCausalLM",
       "VaultGemmaForCausalLM", "Starcoder2ForCausalLM", "BambaForCausalLM",
       "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "Qwen3_5ForCausalLM",
       "KimiLinearForCausalLM", "RecurrentGemmaForCausalLM", "RwkvForCausalLM",
       "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM"]


def build(name: str) -> torch.nn.Module:
    """The family's tiny random model (eval mode)."""
    torch.manual_seed(0)
    if name in _OWN:
        return _OWN[name]().eval()
    return _generic(name, "eager" if name in _EAGER_ONLY else "sdpa").eval()


def check(name: str, generate: bool) -> str:
    """One line: the family, its verdict and the numbers (or the refusal)."""
    t0 = time.perf_counter()
    try:
        model = build(name)
    except Exception as exc:  # the config, not tppc
        return f"{name}: BUILD-FAIL {type(exc).__name__}: {str(exc)[:150]}"
    length = _BLOCKS.get(name, 24)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (1, length), generator=gen)
    try:
        cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=3)
        diffs = []
        with torch.inference_mode():
            for n in (length, 2 * length if name in _BLOCKS else length + 8):
                x = torch.randint(3, 120, (1, n), generator=gen)
                diffs.append((cp(x).logits - model(x).logits).abs().max().item())
        verdict = "EXACT" if max(diffs) < 1e-4 else "WRONG"
        line = f"{name}: {verdict} max abs diff {max(diffs):.1e}"
        if generate:
            line += " " + _generate(model, cp)
    except TppcError as exc:
        line = f"{name}: REFUSED {type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    except Exception as exc:  # a bug in tppc: say where
        where = " / ".join(traceback.format_exc().splitlines()[-3:])
        line = f"{name}: CRASH {type(exc).__name__}: {str(exc)[:200]} | {where[:400]}"
    return f"{line} ({time.perf_counter() - t0:.0f} s)"


def _generate(model: torch.nn.Module, cp: tppc.CompiledPipeline) -> str:
    ids = torch.randint(3, 120, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0
    got = cp.generate(ids, attention_mask=mask, max_new_tokens=6)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                          pad_token_id=0)
    return "generate SAME" if torch.equal(got, want) else "generate DIFF"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="transformers class names")
    parser.add_argument("--all", action="store_true", help="every family of the list")
    parser.add_argument("--generate", action="store_true", help="also a padded generate")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for name in ALL if args.all else args.families:
        print(check(name, args.generate), flush=True)


if __name__ == "__main__":
    main()
