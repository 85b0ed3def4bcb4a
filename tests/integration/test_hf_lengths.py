"""HF Llama and GPT-2 at any length and batch size, both executors, and batched generate."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["hf_llama", "hf_gpt2"])
def hf(request):
    model, args, _ = getattr(examples, request.param)(seq_len=24, layers=2)
    return model, tppc.compile(model, args, cluster="2xcpu", chunks=3, num_stages=2,
                                      executor="threads")


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.one_of(st.integers(2, 900), st.sampled_from([3, 7, 127, 509, 1021])),
       batch=st.integers(1, 3), executor=st.sampled_from(["local", "threads"]))
def test_logits_equal_eager_at_any_length_and_batch(hf, length, batch, executor):
    model, cp = hf
    cp.executor = executor
    ids = torch.randint(0, 128, (batch, length))
    with torch.no_grad():
        expected = model(ids).logits
    assert_kernels_close(cp(ids).logits, expected)


def test_batched_generate_equals_hf_greedy(hf):
    model, cp = hf
    prompt = torch.randint(0, 128, (3, 9))
    expected = model.generate(prompt, max_new_tokens=7, do_sample=False, min_new_tokens=7,
                              pad_token_id=0)
    assert torch.equal(cp.generate(prompt, max_new_tokens=7, eos_token_id=None), expected)


def test_llama_at_several_thousand_tokens_with_a_prime_length():
    model, args, _ = examples.hf_llama(seq_len=24, layers=2)
    cp = tppc.compile(model, args, cluster="2xcpu", num_stages=2, executor="threads")
    ids = torch.randint(0, 128, (2, 4093))
    with torch.no_grad():
        expected = model(ids).logits
    assert_kernels_close(cp(ids).logits, expected)
    plan = cp.program(4093).plan
    assert len(plan.chunks) > 1 and plan.granularity == 64
