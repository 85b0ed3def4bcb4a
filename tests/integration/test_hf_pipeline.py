"""HF Llama and GPT-2 through the pipeline: exact outputs, K/V cache, greedy generation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.dispatch.compile import compile_pipeline
from tppc.planner.manual import manual_plan

pytest.importorskip("transformers")

SEQ = 16
LAYERS = 5  # prologue, 3 blocks, epilogue


def _compile(factory):
    model, args, _ = factory(seq_len=SEQ, layers=3)
    plan = manual_plan(LAYERS, SEQ, cuts=(0, 2, LAYERS), boundaries=(0, 5, 6, SEQ))
    cp = compile_pipeline(model, args, plan=plan, executor="threads")
    with torch.no_grad():
        expected = model(args[0]).logits
    return model, args[0], expected, cp


@pytest.fixture(scope="module", params=["hf_llama", "hf_gpt2"])
def hf(request):
    return _compile(getattr(examples, request.param))


@st.composite
def plans(draw):
    stages = draw(st.integers(1, 4))
    cuts = sorted(draw(st.sets(st.integers(1, LAYERS - 1), min_size=stages - 1,
                               max_size=stages - 1)))
    bounds = sorted(draw(st.sets(st.integers(1, SEQ - 1), max_size=SEQ - 1)))
    return manual_plan(LAYERS, SEQ, cuts=(0, *cuts, LAYERS), boundaries=(0, *bounds, SEQ))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans(), executor=st.sampled_from(["local", "threads"]))
def test_pipelined_logits_equal_eager_for_any_plan(hf, plan, executor):
    _, ids, expected, base = hf
    out = base.with_plan(plan, executor=executor)(ids)
    assert_kernels_close(out.logits, expected)


def test_the_output_is_the_models_output_type(hf):
    model, ids, _, cp = hf
    with torch.no_grad():
        assert type(cp(ids)) is type(model(ids))


def test_kv_cache_after_prefill_equals_hf_past_key_values(hf):
    model, ids, _, cp = hf
    with torch.no_grad():
        cp(ids)
        out = model(ids, use_cache=True)
    cache = out["cache"] if "cache" in out else out.past_key_values
    ours = cp.kv_cache()
    assert len(ours) == len(cache.layers)
    for (k, v), layer in zip(ours, cache.layers):
        assert_kernels_close(k, layer.keys)
        assert_kernels_close(v, layer.values)


def test_kv_buffers_hold_kv_heads_not_repeated_heads(hf):
    model, _, _, cp = hf
    heads = model.config.num_attention_heads
    kv_heads = getattr(model.config, "num_key_value_heads", heads)
    assert {k.shape[1] for k, _ in cp.kv_cache()} == {kv_heads}


@pytest.mark.parametrize("new", [1, 12])
def test_generate_equals_hf_greedy_generate(hf, new):
    model, ids, _, cp = hf
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=new, do_sample=False)
    torch.testing.assert_close(cp.generate(ids, max_new_tokens=new), expected)


def test_generate_without_eos_produces_every_token(hf):
    _, ids, _, cp = hf
    out = cp.generate(ids, max_new_tokens=30, eos_token_id=None)
    assert out.shape == (1, SEQ + 30)


@pytest.mark.parametrize("factory", ["hf_llama", "hf_gpt2"])
def test_the_loss_runs_once_on_the_full_sequence(factory):
    model, args, _ = getattr(examples, factory)(seq_len=SEQ, layers=2)
    ids = args[0]
    plan = manual_plan(4, SEQ, cuts=(0, 2, 4), boundaries=(0, 5, SEQ))
    cp = compile_pipeline(model, (ids,), {"labels": ids}, plan=plan, executor="threads")
    with torch.no_grad():
        out, expected = cp(ids, labels=ids), model(ids, labels=ids)
    assert_kernels_close(out.loss, expected.loss)
    assert_kernels_close(out.logits, expected.logits)


def test_grouped_query_attention_reads_the_kv_heads_without_repeating_them():
    model, args, _ = examples.hf_llama(seq_len=SEQ, layers=2)
    cp = compile_pipeline(model, args, plan=manual_plan(4, SEQ, cuts=(0, 4),
                                                        boundaries=(0, SEQ)))
    module = cp.stages[0].module
    sdpa = [n for n in module.graph.nodes if n.target == torch.ops.tppc.chunk_attention.default]
    assert len(sdpa) == 2 and all(n.args[6] is True for n in sdpa)  # enable_gqa
    assert not [n for n in module.graph.nodes if n.target == torch.ops.aten.expand.default
                and n.args[0].target == torch.ops.aten.unsqueeze.default]
