"""Issue 31: transformers' eager attention recognised by what it computes, against eager HF.

Bloom (ALiBi), Gemma2 (logit soft-capping, alternating sliding window), GPT-OSS (attention
sinks, mixture of experts) accept only ``attn_implementation="eager"``; Llama is the plain
case. Each is folded into attention (SDPA or ``tppc::softmax_attention``), chunked with K/V
buffers, and must equal the eager model under several plans, on a padded batch (rows that see
a key) and token for token in ``generate``.
"""

from __future__ import annotations

import functools

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc.ir.records import TOKEN
from tppc.passes.shapes import module_path
from tppc.planner.manual import manual_plan

transformers = pytest.importorskip("transformers")

_SPLITS = [(0, 20), (0, 3, 11, 20), (0, 7, 8, 13, 20)]
_COMMON = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "attn_implementation": "eager"}


def _llama() -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        intermediate_size=128, num_key_value_heads=2, **_COMMON))


def _bloom() -> torch.nn.Module:
    return transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=128, hidden_size=64, n_layer=2, n_head=4, attn_implementation="eager"))


def _gemma2() -> torch.nn.Module:
    """A soft-cap of 1 (transformers' default is 50) and q/k projections 30 times the random
    initialisation: scores of several units, which the cap changes (a dropped cap shows)."""
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        intermediate_size=128, num_key_value_heads=2, head_dim=16, sliding_window=5,
        attn_logit_softcapping=1.0, **_COMMON))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    return model


def _gpt_oss() -> torch.nn.Module:
    """Sinks set to 1 (initialised near 0): a weight every row gives to the sink."""
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        intermediate_size=64, num_key_value_heads=2, head_dim=16, sliding_window=5,
        num_local_experts=4, num_experts_per_tok=2, **_COMMON))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(1.0)
    return model


_FAMILIES = {"llama": _llama, "bloom": _bloom, "gemma2": _gemma2, "gpt_oss": _gpt_oss}
_KERNEL = {"llama": "scaled_dot_product_attention", "bloom": "scaled_dot_product_attention",
           "gemma2": "softmax_attention", "gpt_oss": "softmax_attention"}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return _FAMILIES[family]().eval()


@functools.cache
def _compiled(family: str) -> tuple[torch.nn.Module, tppc.CompiledPipeline]:
    """The family's model and its pipeline for 20 tokens (2 stages, 4 chunks), made once."""
    model = _model(family)
    ids, _ = _padded(1)
    return model, tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=4)


def _padded(batch: int = 2, seq: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 128, (batch, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :5] = 0
    return ids, mask


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_eager_attention_is_exact_under_several_plans(family: str) -> None:
    model, cp = _compiled(family)
    ids, _ = _padded(1)
    with torch.no_grad():
        want = model(ids).logits
        assert_kernels_close(cp(ids).logits, want)
    n = len(cp.context.layers)
    for cuts, boundaries in zip([(0, n), (0, 1, n), (0, n - 1, n)], _SPLITS):
        plan = manual_plan(n, 20, cuts=cuts, boundaries=boundaries)
        other = cp.with_plan(plan, verify=False)  # the oracle is the eager model
        with torch.no_grad():
            assert_kernels_close(other(ids).logits, want)
    graph = cp._front.annotated.graph
    mixing = [n for n in graph.nodes if n.meta[TOKEN].role == "mixing"]
    assert len(mixing) == 2 and all(_KERNEL[family] in str(n.target) for n in mixing)
    assert not [n for n in graph.nodes if str(n.target).startswith("aten.softmax")
                and "att" in module_path(n)]
    with torch.no_grad():  # another length than the compiled example's
        assert_kernels_close(cp(ids[:, :13]).logits, model(ids[:, :13]).logits)


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_eager_attention_padded_batch_equals_eager_on_rows_that_see_a_key(family: str) -> None:
    model = _model(family)
    ids, mask = _padded()
    cp = tppc.compile(model, (ids,), {"attention_mask": mask}, cluster="2xcpu", num_stages=2,
                      chunks=3)
    with torch.no_grad():
        got = cp(ids, attention_mask=mask).logits
        want = model(ids, attention_mask=mask).logits
    visible = mask.bool()  # a padded query sees no key: 0 (as SDPA), eager averages all values
    assert_kernels_close(got[visible], want[visible])


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_eager_attention_generate_equals_hf_token_for_token(family: str) -> None:
    model, cp = _compiled(family)
    ids, _ = _padded(1, 10)
    want = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(cp.generate(ids, max_new_tokens=10), want)


@pytest.mark.parametrize("family", ["bloom", "gemma2", "gpt_oss"])
def test_eager_attention_exports_exactly_and_generates_the_same_tokens(family: str,
                                                                         tmp_path) -> None:
    """The folded attention through ONNX Runtime: Bloom's ALiBi (K/V regrouped to
    ``(b·h, t, d)`` and back after the buffer read), Gemma 2's soft-cap, GPT-OSS's sinks
    and mixture of experts; at two lengths and in ``generate``."""
    model, cp = _compiled(family)
    tppc.export(cp, tmp_path, lengths=[20, 10])  # the export check runs on the example
    runner = tppc.load(tmp_path, threads_per_stage=1)
    ids, _ = _padded(1)
    for length in (20, 10):
        with torch.no_grad():
            want = model(ids[:, :length]).logits.numpy()
        assert_kernels_close(runner(ids[:, :length].numpy())["logits"], want)
    want = model.generate(ids[:, :10], max_new_tokens=6, do_sample=False)
    assert (runner.generate(ids[:, :10].numpy(), max_new_tokens=6) == want.numpy()).all()


def test_soft_cap_and_sinks_change_the_eager_result() -> None:
    """The two tests above could not fail on a dropped soft-cap or sink otherwise."""
    ids, _ = _padded(1)
    for family in ("gemma2", "gpt_oss"):
        model = _model(family)
        with torch.no_grad():
            want = model(ids).logits
            for layer in model.model.layers:
                if family == "gemma2":
                    layer.self_attn.attn_logit_softcapping = None
                else:
                    layer.self_attn.sinks.fill_(-1e9)  # a sink no row attends to
            assert (model(ids).logits - want).abs().max() > 1e-2, family


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_chunk_step_carries_the_soft_cap_or_the_sinks(family: str) -> None:
    _, cp = _compiled(family)
    ops = [n for n in cp._front.chunk.graph.nodes
           if n.target is torch.ops.tppc.chunk_attention.default]
    index = 10 if family == "gemma2" else 11
    assert len(ops) == 2 and all(len(n.args) == 12 and n.args[index] is not None for n in ops)


def test_diffusers_eager_attention_processor_is_folded_and_exact() -> None:
    """diffusers' ``AttnProcessor`` writes attention out (``baddbmm`` with ``beta=0`` over an
    empty tensor, softmax, ``bmm``): self-attention is folded into bidirectional attention,
    cross-attention to the text keys stays row-wise."""
    pytest.importorskip("diffusers")
    from diffusers.models.attention_processor import AttnProcessor

    from tppc.examples import hf_pixart

    model, args, kwargs = hf_pixart(size=8, layers=2)
    model.set_attn_processor(AttnProcessor())
    cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2)
    with torch.no_grad():
        assert_kernels_close(cp(*args, **kwargs)[0], model(*args, **kwargs)[0])
    mixing = [n for n in cp._front.annotated.graph.nodes if n.meta[TOKEN].role == "mixing"]
    assert len(mixing) == 2 and {(str(n.target), n.meta[TOKEN].attention) for n in mixing} == \
        {("aten.scaled_dot_product_attention.default", "bidirectional")}
