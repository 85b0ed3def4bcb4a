"""Calls as real traffic sends them: concurrent, failing, timing out; the model untouched."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.errors import RuntimeInputError, SpecError, StageTimeout
from tppc.planner.manual import manual_plan

SEQ = 16


@pytest.fixture(scope="module")
def gpt():
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    return model, tppc.compile(model, args, chunks=3, num_stages=2, executor="threads")


def _eager(model, ids):
    with torch.no_grad():
        return model(ids)


def test_concurrent_calls_with_different_inputs_and_lengths_are_each_exact(gpt):
    model, cp = gpt
    inputs = [torch.randint(0, 256, (1 + i % 2, 20 + 7 * i)) for i in range(4)]
    expected = [_eager(model, ids) for ids in inputs]
    for ids in inputs:  # plan and capture first: the race is in running, not in compiling
        cp(ids)
    prompt = torch.randint(0, 256, (1, 12))
    reference = cp.generate(prompt, max_new_tokens=6)
    errors: list[BaseException] = []
    results: dict[int, list] = {i: [] for i in range(5)}
    barrier = threading.Barrier(5)

    def caller(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(5):
                if i == 4:
                    results[i].append(cp.generate(prompt, max_new_tokens=6))
                else:
                    results[i].append(cp(inputs[i]))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i in range(4):
        for out in results[i]:
            assert_kernels_close(out, expected[i])
    assert all(torch.equal(out, reference) for out in results[4])


def test_the_users_model_is_untouched_by_compile_and_call():
    model, args, _ = examples.hf_gpt2(seq_len=SEQ) if _has_hf() else examples.gpt(seq_len=SEQ)
    before = {n: (p.device, p.data_ptr(), p.detach().clone(), type(p))
              for n, p in model.named_parameters()}
    cp = tppc.compile(model, args, chunks=2, executor="threads")
    with torch.no_grad():
        cp(*args)
    for name, p in model.named_parameters():
        device, ptr, value, kind = before[name]
        assert (p.device, p.data_ptr(), type(p)) == (device, ptr, kind)
        assert torch.equal(p, value)
    stage_params = {id(p) for st in cp.stages for p in st.module.parameters()}
    assert not stage_params & {id(p) for p in model.parameters()}  # their own tensor objects


def _has_hf() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(("options", "message"), [
    ({"chunks": 0}, "chunks=0 must be ≥ 1"),
    ({"chunks": (0, 8, 4, 16)}, "strictly increasing"),
    ({"chunks": (1, 16)}, "strictly increasing boundaries from 0"),
    ({"threads_per_stage": 0}, "threads_per_stage=0"),
    ({"threads_per_stage": (1, 0)}, "threads_per_stage=0"),
    ({"queue_depth": 0}, "queue_depth=0"),
    ({"executor": "gpu"}, "executor='gpu'"),
    ({"time_limit": -1}, "time_limit=-1"),
    ({"timeout": 0}, "timeout=0"),
    ({"max_seq": 0}, "max_seq=0"),
    ({"granularity": 0}, "granularity=0"),
    ({"num_stages": 0}, "num_stages=0"),
    ({"program_cache": 0}, "program_cache=0"),
    ({"no_such_option": 1}, "no_such_option"),
])
def test_bad_options_are_refused_before_capture(options, message, monkeypatch):
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    monkeypatch.setattr("tppc.dispatch.compile.capture_front_end",
                        lambda *a, **k: pytest.fail("captured"))
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tppc.compile(model, args, **options)


def test_boundaries_for_another_length_are_refused_with_the_fix():
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    cp = tppc.compile(model, args, chunks=(0, 8, SEQ), executor="local")
    with pytest.raises(RuntimeInputError, match="chunks=<number of chunks>"):
        cp(torch.randint(0, 256, (1, 9)))


def test_a_failed_generate_leaves_the_pipeline_as_usable_as_before(gpt):
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    cp = tppc.compile(model, args, chunks=2, max_seq=64, executor="threads")
    with pytest.raises(RuntimeInputError, match="max_seq=64"):
        cp.generate(args[0], max_new_tokens=10**12)
    with pytest.raises(RuntimeInputError, match="max_seq=64"):
        cp(torch.randint(0, 256, (1, 65)))  # the limit still holds
    with pytest.raises(RuntimeInputError, match="max_new_tokens=0"):
        cp.generate(args[0], max_new_tokens=0)
    assert_kernels_close(cp(*args), _eager(model, args[0]))


def test_a_call_that_fails_in_a_stage_names_it_and_the_next_call_is_exact(gpt, monkeypatch):
    model, cp = gpt
    ids = torch.randint(0, 256, (1, SEQ))
    program = cp.program(SEQ)
    real = program.stages[1].runnable.forward
    monkeypatch.setattr(program.stages[1].runnable, "forward",
                        lambda *a, **k: (_ for _ in ()).throw(ValueError("broken")))
    with pytest.raises(ValueError, match="broken") as info:
        cp(ids)
    assert any("stage 1" in note for note in info.value.__notes__)
    monkeypatch.setattr(program.stages[1].runnable, "forward", real)
    assert_kernels_close(cp(ids), _eager(model, ids))


def test_a_stage_that_does_not_answer_raises_a_timeout_naming_it():
    """The timeout fires while the stage is still stuck (no wall-clock bound: the stage is
    held by an event the test sets only after the call has raised)."""
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    plan = manual_plan(4, SEQ, cuts=(0, 2, 4), boundaries=(0, 8, SEQ))
    cp = tppc.compile(model, args, plan=plan, executor="threads")
    stage = cp.program(SEQ).stages[1].runnable
    real = stage.forward
    release, done = threading.Event(), threading.Event()

    def stuck(*a, **k):
        release.wait(timeout=120)
        done.set()
        return real(*a, **k)

    stage.forward = stuck
    with pytest.raises(StageTimeout, match="stage 1 .* chunk 0 of 2"):
        cp.run(args, timeout=0.3)
    assert not done.is_set()  # it raised while the stage was still stuck
    stage.forward = real
    release.set()
    assert done.wait(timeout=120)  # the stuck worker finishes on its own (its state was dropped)
    assert_kernels_close(cp(*args), _eager(model, args[0]))


class _Encoder(torch.nn.Module):
    """A bidirectional encoder (no mask): its attention needs every token's K/V."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 48) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for qkv in self.layers:
            q, k, v = qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
            x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v) \
                .transpose(1, 2).flatten(2)
        return x


def test_bidirectional_attention_runs_exactly_as_one_chunk_and_refuses_chunks():
    model = _Encoder().eval()
    ids = torch.randint(0, 64, (1, SEQ))
    cp = tppc.compile(model, (ids,), executor="threads")
    assert cp.program(SEQ).chunks == ((0, SEQ),)
    assert_kernels_close(cp(ids), _eager(model, ids))
    with pytest.raises(SpecError, match="bidirectional attention"):
        tppc.compile(model, (ids,), chunks=2)


def test_the_last_chunk_is_not_dropped_when_every_worker_has_exited(monkeypatch):
    """The caller's poll times out just as the last worker exits: the chunk still comes out."""
    import queue

    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    plan = manual_plan(4, SEQ, cuts=(0, 2, 4), boundaries=(0, 8, SEQ))
    cp = tppc.compile(model, args, plan=plan, executor="threads")
    caller = threading.current_thread()
    real_get = queue.Queue.get
    raced = []

    def racing_get(self, block=True, timeout=None):
        if threading.current_thread() is caller and timeout is not None and not raced:
            while any(t.name.startswith("tppc-stage-") for t in threading.enumerate()):
                time.sleep(0.01)  # every worker has put its chunks and exited
            raced.append(True)
            raise queue.Empty
        return real_get(self, block, timeout)

    monkeypatch.setattr(queue.Queue, "get", racing_get)
    out = cp(*args)
    assert raced
    assert_kernels_close(out, _eager(model, args[0]))


def test_a_call_binds_its_inputs_once(gpt, monkeypatch):
    import tppc.frontend.front_end as front_end

    _, cp = gpt
    ids = torch.randint(0, 256, (1, SEQ))
    cp(ids)  # captured and planned: what remains per call
    calls = []
    real = front_end.bind_inputs
    monkeypatch.setattr(front_end, "bind_inputs", lambda *a: calls.append(1) or real(*a))
    cp(ids)
    assert len(calls) == 1


def test_two_pipelines_of_one_capture_keep_their_own_call_states(gpt):
    _, cp = gpt
    ids = torch.randint(0, 256, (2, SEQ))  # batch 2: a capture cp.with_plan shares
    with torch.no_grad():
        cp(ids)
        other = cp.with_plan(cp.plan, verify=False)
        front = cp.bind((ids,), {})[0]
        assert other.bind((ids,), {})[0] is front
        assert other.states.pool(front) is not cp.states.pool(front)
        cp(ids)
        expected = [(k.clone(), v.clone()) for k, v in cp.kv_cache()]
        other(torch.randint(0, 256, (2, SEQ)))  # would reuse cp's state if they shared it
        assert all(torch.equal(k, k2) and torch.equal(v, v2)
                   for (k, v), (k2, v2) in zip(expected, cp.kv_cache(), strict=True))
