"""Greedy generation through the stages equals greedy decoding of the eager model."""

from __future__ import annotations

import pytest
import torch

from tests.oracles import greedy_reference
from tppc import examples
from tppc.dispatch.compile import compile_pipeline
from tppc.errors import RuntimeInputError
from tppc.planner.manual import manual_plan

SEQ = 12


@pytest.fixture(scope="module")
def gpt():
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    plan = manual_plan(4, SEQ, cuts=(0, 2, 4), boundaries=(0, 5, SEQ))
    return model, args[0], compile_pipeline(model, args, plan=plan, executor="threads")


def test_generate_equals_eager_greedy_decoding(gpt):
    model, ids, cp = gpt
    torch.testing.assert_close(cp.generate(ids, max_new_tokens=9), greedy_reference(model, ids, 9))


def test_generate_stops_after_the_end_of_sequence_token(gpt):
    model, ids, cp = gpt
    expected = greedy_reference(model, ids, 6)
    eos = int(expected[0, SEQ + 2])
    out = cp.generate(ids, max_new_tokens=6, eos_token_id=eos)
    first = SEQ + next(i for i in range(6) if int(expected[0, SEQ + i]) == eos)
    torch.testing.assert_close(out, expected[:, : first + 1])


def test_generate_grows_the_kv_buffers_beyond_the_compiled_length(gpt):
    model, ids, cp = gpt
    out = cp.generate(ids, max_new_tokens=3 * SEQ)
    torch.testing.assert_close(out, greedy_reference(model, ids, 3 * SEQ))
    assert cp.kv_cache()[0][0].shape[2] == 4 * SEQ - 1  # the last token's K/V is not needed


def test_generate_refuses_zero_new_tokens(gpt):
    _, ids, cp = gpt
    with pytest.raises(RuntimeInputError, match="max_new_tokens=0"):
        cp.generate(ids, max_new_tokens=0)
