"""Capture and annotation of real transformers / diffusers models from small configs."""

from __future__ import annotations

import pytest

import tppc
from tests.unit._helpers import block_activations, roles_by_target
from tppc import examples
from tppc.ir.records import TOKEN
from tppc.passes.shapes import size_expr

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():
    model, args, kwargs = examples.hf_llama(seq_len=16, layers=3)
    return model, tppc.annotate(model, args, kwargs)


@pytest.fixture(scope="module")
def gpt2():
    model, args, kwargs = examples.hf_gpt2(seq_len=16, layers=3)
    return model, tppc.annotate(model, args, kwargs)


@pytest.fixture(scope="module")
def hf_dit():
    pytest.importorskip("diffusers")
    model, args, kwargs = examples.hf_dit(size=8, layers=3)
    return model, tppc.annotate(model, args, kwargs)


def test_llama_layer_count_matches_config(llama) -> None:
    model, (_, ctx) = llama
    blocks = [layer for layer in ctx.layers if layer.kind == "block"]
    assert len(blocks) == model.config.num_hidden_layers
    assert [b.name for b in blocks] == [f"model.layers.{i}" for i in range(3)]


def test_llama_attention_is_causal_from_its_mask(llama) -> None:
    _, (_, ctx) = llama
    assert [k for layer in ctx.layers for k in layer.attention_kinds] == ["causal"] * 3


def test_llama_block_activations_have_token_axes(llama) -> None:
    _, (gm, ctx) = llama
    acts = block_activations(gm, ctx)
    assert len(acts) > 100
    assert all(n.meta[TOKEN].axis is not None for n in acts)


def test_llama_rope_tables_and_mask_are_positional(llama) -> None:
    _, (gm, _) = llama
    assert roles_by_target(gm, "aten.cos") == {"positional"}
    assert roles_by_target(gm, "aten.sin") == {"positional"}
    sdpa = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    mask = sdpa.args[3] if len(sdpa.args) > 3 else sdpa.kwargs.get("attn_mask")
    if mask is not None:
        assert mask.meta[TOKEN].role == "positional"
        assert mask.meta[TOKEN].other_axes  # query and key axes both depend on the length


def test_llama_gqa_block_params(llama) -> None:
    model, (_, ctx) = llama
    block = next(layer for layer in ctx.layers if layer.kind == "block")
    expected = sum(p.numel() for p in model.model.layers[0].parameters())
    assert block.param_count == expected


def test_llama_eager_attention_is_annotated_as_causal_attention() -> None:
    """Issue 31: the eager region is folded into SDPA (exactness: test_hf_eager_attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval()
    import torch

    _, ctx = tppc.annotate(model, (torch.randint(0, 64, (1, 8)),))
    blocks = [layer for layer in ctx.layers if layer.kind == "block"]
    assert [b.attention_kinds for b in blocks] == [("causal",)] * 2


def test_gpt2_layers_and_causal_attention(gpt2) -> None:
    model, (gm, ctx) = gpt2
    blocks = [layer for layer in ctx.layers if layer.kind == "block"]
    assert len(blocks) == model.config.n_layer
    assert all(b.attention_kinds == ("causal",) for b in blocks)
    assert all(n.meta[TOKEN].axis is not None for n in block_activations(gm, ctx))
    assert ctx.layers[0].kind == "prologue" and ctx.layers[-1].kind == "epilogue"


def test_gpt2_position_ids_are_positional(gpt2) -> None:
    _, (gm, ctx) = gpt2
    aranges = [n for n in gm.graph.nodes if "arange" in str(n.target)
               and ctx.seq_symbol in size_expr(n.meta["val"].shape[0]).free_symbols]
    assert aranges and {n.meta[TOKEN].role for n in aranges} == {"positional"}


def test_diffusers_dit_layers_and_bidirectional_attention(hf_dit) -> None:
    model, (gm, ctx) = hf_dit
    blocks = [layer for layer in ctx.layers if layer.kind == "block"]
    assert len(blocks) == model.config.num_layers
    assert all(b.attention_kinds == ("bidirectional",) for b in blocks)
    assert all(n.meta[TOKEN].axis is not None for n in block_activations(gm, ctx))


def test_diffusers_dit_capture_is_marked_specialised(hf_dit) -> None:
    _, (_, ctx) = hf_dit
    # diffusers computes the patch grid with int(sqrt(tokens)): only square, fixed sizes
    assert ctx.capture_mode == "specialized"
    assert "Guard failed" in (ctx.specialization or "")


def test_diffusers_dit_timestep_embedding_is_const(hf_dit) -> None:
    _, (gm, _) = hf_dit
    emb = [n for n in gm.graph.nodes if n.op == "call_function" and any(
        "emb" in p for p, _ in (n.meta.get("nn_module_stack") or {}).values())
        and "timestep" in str(n.meta.get("nn_module_stack"))]
    assert emb and {n.meta[TOKEN].role for n in emb} == {"const"}


def test_diffusers_dit_unpatchify_is_global(hf_dit) -> None:
    _, (gm, _) = hf_dit
    assert "global" in roles_by_target(gm, "einsum")
