"""The pipelined own GPT equals the eager model for any plan, with both executors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.dispatch.compile import compile_pipeline
from tppc.planner.manual import manual_plan

SEQ = 16
LAYERS = 6  # prologue, 4 blocks, epilogue


@pytest.fixture(scope="module")
def gpt():
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=4)
    plan = manual_plan(LAYERS, SEQ, cuts=(0, LAYERS), boundaries=(0, SEQ))
    cp = compile_pipeline(model, args, plan=plan, executor="local")
    with torch.no_grad():
        expected = model(args[0])
    return args[0], expected, cp


@st.composite
def plans(draw, layers: int = LAYERS, seq: int = SEQ):
    stages = draw(st.integers(1, 4))
    cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=stages - 1,
                               max_size=stages - 1)))
    bounds = sorted(draw(st.sets(st.integers(1, seq - 1), max_size=seq - 1)))
    return manual_plan(layers, seq, cuts=(0, *cuts, layers), boundaries=(0, *bounds, seq))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans(), executor=st.sampled_from(["local", "threads"]))
def test_pipelined_output_equals_eager_for_any_plan(gpt, plan, executor):
    ids, expected, base = gpt
    cp = base.with_plan(plan, executor=executor)
    assert_kernels_close(cp(ids), expected)


def test_threads_executor_runs_with_one_intra_op_thread_per_stage(gpt):
    ids, expected, base = gpt
    plan = manual_plan(LAYERS, SEQ, cuts=(0, 3, LAYERS), boundaries=(0, 4, 8, 12, SEQ))
    cp = base.with_plan(plan, executor="threads", threads_per_stage=1, queue_depth=1)
    before = torch.get_num_threads()
    assert_kernels_close(cp(ids), expected)
    assert torch.get_num_threads() == before  # set per worker thread, not for the caller


def test_a_failing_stage_raises_in_the_caller(gpt, monkeypatch):
    ids, _, base = gpt
    plan = manual_plan(LAYERS, SEQ, cuts=(0, 3, LAYERS), boundaries=(0, 8, SEQ))
    cp = base.with_plan(plan, executor="threads")
    stage = cp.program(SEQ).stages[1].runnable  # what runs (the stage graph + out slots)

    def broken(*args, **kwargs):
        raise ValueError("stage 1 broke")

    monkeypatch.setattr(stage, "forward", broken)
    with pytest.raises(ValueError, match="stage 1 broke"):
        cp(ids)


def test_threads_executor_runs_under_the_callers_inference_mode() -> None:
    import tppc
    from tppc import examples

    model, args, _ = examples.gpt(seq_len=32, n_layer=2)
    cp = tppc.compile(model, args, executor="threads", chunks=2)
    with torch.inference_mode():
        inside = cp(*args)
    assert inside.is_inference()
    outside = cp(*args)  # buffers and outputs made in inference mode must not leak out
    torch.testing.assert_close(outside, inside)
    assert not outside.requires_grad or outside.grad_fn is not None


def test_the_last_stage_touches_fresh_outputs_only_until_its_first_chunk(monkeypatch):
    from tppc.backends import torch_threads

    monkeypatch.setattr(torch_threads, "_TOUCH_ELEMENTS", 4)
    out = torch.full((3, 8), float("nan"))
    looks = []

    def ready() -> bool:  # the first chunk arrives at the third look
        looks.append(1)
        return len(looks) > 2

    torch_threads._touch_while_idle((None, out, torch.full((2,), 7.0)[::2]), ready)
    flat = out.view(-1)
    assert (flat[:8] == 0).all() and flat[8:].isnan().all()  # two slices, then it stopped
