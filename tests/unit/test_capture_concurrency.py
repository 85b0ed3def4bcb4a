"""Threads that call, generate and compile at once, with shapes never captured: exact results.

torch.export is not re-entrant: tppc runs one capture at a time in the process, concurrent
first calls of one new batch shape share one capture, and no capture leaves state in the
user's model. Without that (main before issue 19), every job of the stress test below fails
and the user's models end up holding FakeTensor weights.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.errors import RuntimeInputError
from tppc.examples.models.gpt import GPT, GPTConfig
from tppc.frontend.front_end import on_meta_if

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from stress_concurrency import intact_models, make_target, stress


def _together(count: int, work) -> list[BaseException]:
    """Run ``work(i)`` in ``count`` threads released at once; the exceptions raised."""
    barrier, errors = threading.Barrier(count), []

    def run(i: int) -> None:
        barrier.wait()
        try:
            work(i)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_threads_calling_generating_and_compiling_new_shapes_get_eager_results() -> None:
    target = make_target(batches=(2, 3, 4), lengths=(5, 9, 14))
    report = stress(target, threads=8, jobs_per_thread=2, seed=1)
    assert report.failures == []
    assert sum(report.done.values()) == 16
    assert intact_models(target) == [None, None, None]


def test_concurrent_first_calls_of_one_new_batch_shape_capture_once(monkeypatch) -> None:
    model, args, _ = examples.gpt(seq_len=8, n_layer=2)
    cp = tppc.compile(model, args, chunks=2, executor="threads")
    captures = []
    real = tppc.pipeline.captures.capture_front_end

    def counted(*a, **k):
        captures.append(a[1][0].shape)
        return real(*a, **k)

    monkeypatch.setattr("tppc.pipeline.captures.capture_front_end", counted)
    ids = torch.randint(0, 256, (3, 10))
    with torch.no_grad():
        expected = model(ids)
    results = [None] * 6

    def call(i: int) -> None:
        results[i] = cp(ids)

    assert _together(6, call) == []
    assert len(captures) == 1
    for out in results:
        assert_kernels_close(out, expected)


def test_captures_never_overlap_across_pipelines_and_compiles(monkeypatch) -> None:
    model, args, _ = examples.gpt(seq_len=8, n_layer=2)
    cp = tppc.compile(model, args, chunks=2)
    other, other_args, _ = examples.gpt(seq_len=6, n_layer=2)
    active, most = [0], [0]
    lock = threading.Lock()
    real = torch.export.export

    def exclusive(*a, **k):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            return real(*a, **k)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(torch.export, "export", exclusive)

    def work(i: int) -> None:
        if i < 2:
            tppc.compile(other, other_args, chunks=2)
        else:
            cp(torch.randint(0, 256, (i, 7)))

    assert _together(5, work) == []
    assert most[0] == 1


def test_a_failed_capture_reaches_every_waiting_caller_and_is_not_cached(monkeypatch) -> None:
    model, args, _ = examples.gpt(seq_len=8, n_layer=2)
    cp = tppc.compile(model, args, chunks=2)
    real, calls, waiting = tppc.pipeline.captures.capture_front_end, [], threading.Semaphore(0)

    class CountedFuture(Future):
        def result(self, timeout=None):
            waiting.release()
            return super().result(timeout)

    def failing(*a, **k):
        calls.append(1)
        for _ in range(3):  # the other callers queue up behind this capture
            assert waiting.acquire(timeout=30)
        raise tppc.errors.CaptureError("injected")

    monkeypatch.setattr("tppc.pipeline.captures.Future", CountedFuture)
    monkeypatch.setattr("tppc.pipeline.captures.capture_front_end", failing)
    ids = torch.randint(0, 256, (2, 8))
    errors = _together(4, lambda i: cp(ids))
    assert len(errors) == 4 and all(isinstance(e, RuntimeInputError) for e in errors)
    assert all("injected" in str(e) for e in errors)
    assert len(calls) == 1
    monkeypatch.setattr("tppc.pipeline.captures.capture_front_end", real)
    with torch.no_grad():
        assert_kernels_close(cp(ids), model(ids))


class _PausingGPT(GPT):
    """tppc's GPT whose trace (FakeTensor inputs) waits in ``forward`` until told to go on."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(n_layer=2))
        self.tracing, self.resume = threading.Event(), threading.Event()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(input_ids, FakeTensor):
            self.tracing.set()
            assert self.resume.wait(60), "the test never resumed the capture"
        return super().forward(input_ids)


def test_a_model_being_captured_keeps_its_own_tensors_for_other_threads() -> None:
    # torch.export swaps the traced module's weights for FakeTensors until it returns; a
    # FakeTensor's device reads "meta" while its export runs a kernel, so a compile in another
    # thread moved its inputs to meta and emitted arange(device="meta"): NaN (issue 19)
    torch.manual_seed(0)
    model = _PausingGPT().eval()
    tensors = [*model.parameters(), *model.buffers()]
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        expected = model(ids)
    compiled: list[Any] = []
    worker = threading.Thread(target=lambda: compiled.append(tppc.compile(model, (ids,),
                                                                          chunks=2)))
    worker.start()
    try:
        assert model.tracing.wait(60), "the capture never started"
        now = [*model.parameters(), *model.buffers()]
        assert [type(t) for t in now] == [type(t) for t in tensors]  # no FakeTensor
        assert all(a is b for a, b in zip(now, tensors, strict=True))
        assert on_meta_if(model, ids) is ids
        with torch.no_grad():
            torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
    finally:
        model.resume.set()
        worker.join(120)
    with torch.no_grad():
        assert_kernels_close(compiled[0](ids), expected)



def test_planning_shortens_a_shadow_of_the_block_list_never_the_users(monkeypatch) -> None:
    """``tppc.plan`` captures two of the identical blocks (``few_blocks``); it used to shorten
    the user's own list meanwhile, so an eager call from another thread ran two blocks."""
    import tppc.frontend.front_end as front_end

    model, args, _ = examples.gpt(seq_len=8, n_layer=4)
    seen = []
    real = front_end._front_end

    def watched(*a, **k):
        seen.append((len(model.blocks), len(a[0].blocks)))  # the user's, the captured one's
        return real(*a, **k)

    monkeypatch.setattr(front_end, "_front_end", watched)
    plan = tppc.plan(model, args, cluster="2xcpu")
    assert seen and seen[0] == (4, 2), seen  # captured two blocks, the user's list kept four
    names = [n for st in plan.stages for n in st.layer_names]
    assert len(model.blocks) == 4 and sum(n.startswith("blocks.") for n in names) == 4, names
