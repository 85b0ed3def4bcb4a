"""Every length, any batch size, any plan: the pipelined own GPT equals the eager model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.errors import PlanError, SpecError
from tppc.planner.grid import default_granularity
from tppc.planner.manual import manual_plan

LAYERS = 4  # prologue, 2 blocks, epilogue
PRIMES = [2, 3, 5, 7, 13, 31, 127, 509, 1021, 2039]


@pytest.fixture(scope="module")
def gpt():
    model, args, _ = examples.gpt(seq_len=32, n_layer=2)
    return model, tppc.compile(model, args, cluster="2xcpu", num_stages=2, executor="threads")


def _eager(model, ids):
    with torch.no_grad():
        return model(ids)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.one_of(st.integers(1, 1024), st.sampled_from(PRIMES[:-1])),
       batch=st.integers(1, 3), executor=st.sampled_from(["local", "threads"]))
def test_any_length_and_batch_equals_eager(gpt, length, batch, executor):
    model, cp = gpt
    cp.executor = executor
    ids = torch.randint(0, 256, (batch, length))
    assert_kernels_close(cp(ids), _eager(model, ids))


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), batch=st.integers(1, 3), executor=st.sampled_from(["local", "threads"]))
def test_any_plan_at_any_length_equals_eager(gpt, data, batch, executor):
    model, cp = gpt
    length = data.draw(st.integers(2, 200))
    stages = data.draw(st.integers(1, 3))
    cuts = sorted(data.draw(st.sets(st.integers(1, LAYERS - 1), min_size=stages - 1,
                                    max_size=stages - 1)))
    bounds = sorted(data.draw(st.sets(st.integers(1, length - 1), max_size=12)))
    plan = manual_plan(LAYERS, length, cuts=(0, *cuts, LAYERS), boundaries=(0, *bounds, length))
    other = cp.with_plan(plan, executor=executor)
    ids = torch.randint(0, 256, (batch, length))
    assert_kernels_close(other(ids), _eager(model, ids))


def test_a_prime_length_runs_with_a_partial_last_chunk_not_granularity_one(gpt):
    model, cp = gpt
    ids = torch.randint(0, 256, (1, 1021))
    assert_kernels_close(cp(ids), _eager(model, ids))
    plan = cp.program(1021).plan
    assert plan.granularity == default_granularity(1021) == 16
    assert all(b % 16 == 0 for b in plan.boundaries[:-1]) and plan.boundaries[-1] == 1021


@pytest.mark.parametrize(("tokens", "granularity"), [
    (1, 1), (64, 1), (65, 2), (1000, 16), (4096, 64), (8191, 128), (131072, 128),
    (131073, 256), (1 << 20, 1024)])
def test_default_granularity_keeps_the_grid_small(tokens, granularity):
    assert default_granularity(tokens) == granularity


def test_more_chunks_than_tokens_gives_one_token_chunks():
    model, args, _ = examples.gpt(seq_len=16, n_layer=2)
    cp = tppc.compile(model, args, chunks=4, executor="threads")
    ids = torch.randint(0, 256, (2, 3))
    assert_kernels_close(cp(ids), _eager(model, ids))
    assert cp.program(3).chunks == ((0, 1), (1, 2), (2, 3))
    prompt = torch.randint(0, 256, (1, 3))
    assert cp.generate(prompt, max_new_tokens=2).shape == (1, 5)


def test_the_program_cache_is_bounded():
    model, args, _ = examples.gpt(seq_len=16, n_layer=2)
    cp = tppc.compile(model, args, chunks=2, program_cache=2, executor="local")
    first = cp.program(8)
    cp.program(9)
    cp.program(10)
    assert cp.program(8) is not first  # evicted, re-planned
    assert len(cp.programs) == 2


@pytest.mark.parametrize(("options", "message"), [
    ({"seq_len": 0}, "seq_len=0"), ({"seq_len": -4}, "seq_len=-4")])
def test_tppc_plan_refuses_empty_lengths(options, message):
    model, args, _ = examples.gpt(seq_len=16, n_layer=2)
    with pytest.raises(PlanError, match=message):
        tppc.plan(model, args, cluster="2xh100-sxm", **options)


def test_tppc_plan_refuses_an_empty_grid_as_compile_does():
    """``granularity`` is a :class:`CompileOptions` field: a bad value is a SpecError from
    both entry points, before anything is captured."""
    model, args, _ = examples.gpt(seq_len=16, n_layer=2)
    for entry in (tppc.plan, tppc.compile):
        with pytest.raises(SpecError, match="granularity=0"):
            entry(model, args, cluster="2xh100-sxm", granularity=0)


def test_tppc_plan_takes_a_length_the_granularity_does_not_divide():
    model, args, _ = examples.gpt(seq_len=16, n_layer=2)
    plan = tppc.plan(model, args, cluster="2xh100-sxm", seq_len=1000, granularity=64)
    assert plan.seq_len == 1000 and plan.boundaries[-1] == 1000
    assert all(b % 64 == 0 for b in plan.boundaries[:-1])


def test_the_capture_cache_is_bounded_too():
    """Captures of new batch shapes (here the DiT's width, a static axis) are kept up to
    ``program_cache`` too: a third width evicts the oldest, which is captured again when it
    comes back, and the call is still exact."""
    from tppc.examples.models.dit import DiT, DiTConfig

    torch.manual_seed(0)
    model = DiT(DiTConfig(hidden=32, depth=1, n_head=2)).eval()
    cond = (torch.tensor([3]), torch.tensor([1]))
    cp = tppc.compile(model, (torch.randn(1, 4, 8, 8), *cond), program_cache=2,
                      executor="local")
    fronts = {w: cp.bind((torch.randn(1, 4, 8, w), *cond), {})[0] for w in (8, 12, 16)}
    assert len(set(map(id, fronts.values()))) == 3
    x = torch.randn(1, 4, 8, 8)
    again = cp.bind((x, *cond), {})[0]
    assert again is not fronts[8]  # evicted, captured again
    assert cp.bind((torch.randn(1, 4, 8, 16), *cond), {})[0] is fronts[16]  # kept
    with torch.no_grad():
        torch.testing.assert_close(cp(x, *cond), model(x, *cond), rtol=0, atol=0)
