"""Mamba2-mixer hybrids from transformers beside attention and mixture-of-experts layers.

Bamba and Zamba2 (Mamba2 mixers beside attention; Zamba2's shared attention block) crashed
at their first call: their logits (``k`` rows per block) were written in place into an output
of one row per block. GraniteMoeHybrid's MoE after a Mamba2 mixer was refused: the row-wise
region check skipped its input, still ``global`` until the block scan is annotated.
NemotronH (Mamba2, attention and MLP layers by pattern) is checked beside them.
"""

from __future__ import annotations

import functools

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close

transformers = pytest.importorskip("transformers")

_COMMON = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 64, "use_cache": False,
           "attn_implementation": "sdpa", "pad_token_id": 0}
_MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8,
          "mamba_expand": 2, "mamba_chunk_size": 8, "mamba_d_conv": 4}


def _bamba() -> torch.nn.Module:
    return transformers.BambaForCausalLM(transformers.BambaConfig(
        **_COMMON, **_MAMBA, attn_layer_indices=[1]))


def _granite() -> torch.nn.Module:
    return transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
        **_COMMON, **_MAMBA, layer_types=["mamba", "attention"], num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=32))


def _zamba2() -> torch.nn.Module:
    return transformers.Zamba2ForCausalLM(transformers.Zamba2Config(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=64, use_cache=False,
        attn_implementation="sdpa", mamba_d_state=8, mamba_headdim=16, n_mamba_heads=4,
        chunk_size=8, layers_block_type=["mamba", "hybrid"], mamba_expand=2, pad_token_id=0))


def _nemotron_h() -> torch.nn.Module:
    return transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, use_cache=False,
        attn_implementation="sdpa", mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
        ssm_state_size=8, chunk_size=8, hybrid_override_pattern="M*-", head_dim=8,
        pad_token_id=0))


_FAMILIES = {"bamba": _bamba, "granite_moe_hybrid": _granite, "zamba2": _zamba2,
             "nemotron_h": _nemotron_h}


@functools.cache
def _compiled(family: str) -> tuple[torch.nn.Module, tppc.CompiledPipeline]:
    torch.manual_seed(0)
    model = _FAMILIES[family]().eval()
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    return model, tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=2)


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_mamba2_hybrid_is_exact_at_two_stages_in_chunks_of_one_block(family: str) -> None:
    model, cp = _compiled(family)
    assert cp.context.block_size == 8 and len(cp.plan.stages) == 2
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for length in (16, 32):  # the example's 2 blocks, and 4 (re-planned)
            ids = torch.randint(3, 128, (1, length), generator=gen)
            assert_kernels_close(cp(ids).logits, model(ids).logits, depth=4)
