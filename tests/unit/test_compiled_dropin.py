"""The compiled pipeline as a drop-in for its model (issue 30): the model's attributes are the
pipeline's, and the pipeline's own per-call keywords never reach a ``forward(**kwargs)``.
The model: a tiny transformers GPTNeoX (its ``forward`` takes ``**kwargs``); the oracle: the
eager model."""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def neox():
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64)).eval()
    ids = torch.randint(0, 32, (1, 12))
    return model, ids, tppc.compile(model, (ids,), num_stages=2)


@pytest.fixture
def no_capture(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was captured again")

    monkeypatch.setattr("tppc.pipeline.captures.capture_front_end", fail)


def test_timeout_and_trace_are_the_pipelines_own_not_the_models_kwargs(neox, no_capture):
    model, ids, cp = neox
    trace: list = []
    with torch.no_grad():
        assert_kernels_close(cp(ids, timeout=60, trace=trace).logits, model(ids).logits)
    assert trace and all(len(job) == 4 for job in trace)  # (stage, chunk, start, end)
    with pytest.raises(tppc.StageTimeout, match="timeout=1e-09"):
        cp(ids, timeout=1e-9)
    with pytest.raises(tppc.SpecError, match="timeout=-1 must be a positive"):
        cp(ids, timeout=-1)


def test_a_keyword_only_the_models_kwargs_takes_is_named_when_it_cannot_be_captured(neox):
    _, ids, cp = neox
    with pytest.raises(tppc.RuntimeInputError,
                       match=r"keyword 'colour' is not a parameter of GPTNeoXForCausalLM\.forward "
                             r"\(its \*\*kwargs takes it\).*fix: drop colour="):
        cp(ids, colour=3)


def test_the_models_attributes_are_read_through_the_pipeline(neox):
    model, _, cp = neox
    assert cp.config is model.config and cp.config.hidden_size == 16
    assert cp.dtype == torch.float32 and cp.device == torch.device("cpu")
    assert cp.generation_config is model.generation_config
    assert cp.model is model and cp.plan is not model  # the pipeline's own come first
    with pytest.raises(AttributeError, match="nor its model GPTNeoXForCausalLM has an "
                                             "attribute 'no_such_thing'"):
        _ = cp.no_such_thing
    with pytest.raises(AttributeError):
        _ = cp._private  # private names are never forwarded
