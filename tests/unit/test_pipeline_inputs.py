"""Bad inputs are refused before any stage runs; other lengths are re-planned or refused."""

from __future__ import annotations

import pytest
import torch

from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.backends import torch_local
from tppc.dispatch.compile import compile_pipeline
from tppc.errors import RuntimeInputError
from tppc.planner.manual import manual_plan

SEQ = 16


@pytest.fixture(scope="module")
def gpt():
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    plan = manual_plan(4, SEQ, cuts=(0, 2, 4), boundaries=(0, 8, SEQ))
    return model, compile_pipeline(model, args, plan=plan, executor="threads")


@pytest.fixture
def no_stage_runs(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a stage ran")

    monkeypatch.setattr(torch_local, "run_stage", fail)
    monkeypatch.setattr(torch_local, "prepare_stage", fail)
    monkeypatch.setattr("tppc.backends.torch_threads.run_stage", fail)


@pytest.mark.parametrize(("ids", "message"), [
    (torch.zeros(1, SEQ), "float32 of rank 2, compiled for torch.int64"),
    (torch.zeros(SEQ, dtype=torch.long), "rank 1"),
    (torch.zeros(1, SEQ, 1, dtype=torch.long), "rank 3"),
    (torch.zeros(1, 2 * SEQ, dtype=torch.long), "the given plan is for 16"),
])
def test_bad_inputs_are_refused_before_any_stage_runs(gpt, no_stage_runs, ids, message):
    _, cp = gpt
    with pytest.raises(RuntimeInputError, match=message):
        cp(ids)


def test_another_length_is_refused_when_the_plan_was_given(gpt, no_stage_runs):
    _, cp = gpt
    with pytest.raises(RuntimeInputError, match="the given plan is for 16"):
        cp(torch.zeros(1, 8, dtype=torch.long))


def test_a_missing_input_is_refused(gpt, no_stage_runs):
    _, cp = gpt
    with pytest.raises(RuntimeInputError, match="input_ids"):
        cp()


def test_another_length_is_replanned_and_cached_when_tppc_planned():
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    cp = compile_pipeline(model, args, cluster="2xh100-sxm", devices=["cpu", "cpu"],
                          executor="local", max_seq=64)
    short = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        assert_kernels_close(cp(short), model(short))
        first = cp.program(8)
        cp(short)
    assert cp.program(8) is first
    assert cp.plan.seq_len == SEQ and first.plan.seq_len == 8


def test_kv_cache_before_a_prefill_says_what_to_do(gpt):
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    cp = compile_pipeline(model, args, plan=manual_plan(4, SEQ, cuts=(0, 4),
                                                        boundaries=(0, SEQ)))
    with pytest.raises(RuntimeInputError, match="run a prefill"):
        cp.kv_cache()
