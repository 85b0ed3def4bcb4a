"""Every executor's ``timeout`` is a deadline: StageTimeout within timeout + one chunk's time.

A stage is made slow by a sleeping module (its ``forward`` / ``step`` patched); the bounds
are generous (a loaded machine may be slow) but far below the slow call's own length, so
each test fails when the deadline is not kept.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.errors import StageTimeout
from tppc.planner.manual import manual_plan

SEQ = 32


def _slow(module: Any, seconds: float, attr: str = "forward") -> None:
    """Make ``module.attr`` sleep ``seconds`` before doing its work."""
    real = getattr(module, attr)

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return real(*args, **kwargs)

    setattr(module, attr, slow)


def _compiled(executor: str, chunks: int):
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    bounds = tuple(round(i * SEQ / chunks) for i in range(chunks + 1))
    plan = manual_plan(4, SEQ, cuts=(0, 2, 4), boundaries=bounds)
    return model, args, tppc.compile(model, args, plan=plan, executor=executor)


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    with pytest.raises(StageTimeout):
        fn()
    return time.perf_counter() - t0


def test_the_local_executor_stops_at_the_chunk_that_crosses_its_timeout():
    """16 chunks of 0.2 s on the last stage (3.2 s in all): a 0.3 s timeout ends the call
    after at most one more chunk."""
    _model, args, cp = _compiled("local", 16)
    _slow(cp.program(SEQ).stages[1].runnable, 0.2)
    assert _timed(lambda: cp.run(args, timeout=0.3)) < 1.5


def test_the_threads_executor_raises_at_its_timeout_while_a_stage_is_slow():
    """One chunk of 2 s on the last stage: the caller leaves at 0.3 s, not at 2 s."""
    _model, args, cp = _compiled("threads", 2)
    _slow(cp.program(SEQ).stages[1].runnable, 2.0)
    assert _timed(lambda: cp.run(args, timeout=0.3)) < 1.5


@pytest.mark.parametrize("executor", ["local", "threads"])
def test_a_call_longer_than_a_tiny_timeout_never_returns(executor):
    """timeout=0.001 and chunks that take 50 ms each: the threads executor used to return
    normally after 0.15 s (it looked at the clock only after 50 ms without a chunk)."""
    _model, args, cp = _compiled(executor, 4)
    _slow(cp.program(SEQ).stages[0].runnable, 0.05)
    _timed(lambda: cp.run(args, timeout=0.001))


@pytest.mark.parametrize("executor", ["local", "threads"])
def test_a_timed_out_call_leaves_the_pipeline_exact(executor):
    model, args, cp = _compiled(executor, 4)
    stage = cp.program(SEQ).stages[1].runnable
    real = stage.forward
    _slow(stage, 0.2)
    _timed(lambda: cp.run(args, timeout=0.1))
    stage.forward = real
    with torch.no_grad():
        expected = model(*args)
    assert_kernels_close(cp.run(args, timeout=60), expected)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 2-stage GPT exported to ONNX (4 chunks), and the eager model."""
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    with torch.no_grad():
        cp = tppc.compile(model, args, cluster="2xcpu", num_stages=2, chunks=4)
    path = tmp_path_factory.mktemp("deadline")
    tppc.export(cp, path)
    return path, args


@pytest.mark.parametrize("slow_stage", [0, 1])
def test_the_onnxruntime_pipeline_raises_at_its_timeout(exported, slow_stage):
    path, args = exported
    runner = tppc.load(path, backend="onnxruntime")
    _slow(runner.stages[slow_stage], 2.0, "step")
    ids = args[0].numpy()
    assert _timed(lambda: runner.run((ids,), timeout=0.3)) < 1.5


def test_the_onnxruntime_pipeline_never_returns_after_a_tiny_timeout(exported):
    path, args = exported
    runner = tppc.load(path, backend="onnxruntime")
    _slow(runner.stages[0], 0.05, "step")
    _timed(lambda: runner.run((args[0].numpy(),), timeout=0.001))


def test_a_one_stage_onnxruntime_pipeline_keeps_its_timeout(tmp_path):
    """One stage runs in the calling thread (``run_serial``), which ignored the timeout."""
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    with torch.no_grad():
        cp = tppc.compile(model, args, cluster="2xcpu", num_stages=1, chunks=16)
    tppc.export(cp, tmp_path)
    runner = tppc.load(tmp_path, backend="onnxruntime")
    assert len(runner.stages) == 1
    _slow(runner.stages[0], 0.2, "step")
    assert _timed(lambda: runner.run((args[0].numpy(),), timeout=0.3)) < 1.5
    out = tppc.load(tmp_path, backend="onnxruntime").run((args[0].numpy(),), timeout=60)
    with torch.no_grad():
        assert_kernels_close(np.asarray(out), model(*args).numpy())


def test_a_distributed_rank_stops_after_the_chunk_that_crosses_its_timeout(monkeypatch):
    """A one-rank job needs no process group: its rank checks the deadline after each
    compute, as every rank of a larger job does (a slow stage stops itself)."""
    from tppc.backends.torch_distributed import DistributedExecutor

    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    plan = manual_plan(4, SEQ, cuts=(0, 4), boundaries=tuple(range(0, SEQ + 1, 2)))
    cp = tppc.compile(model, args, plan=plan, executor="local")
    monkeypatch.setitem(cp._executors, "distributed", DistributedExecutor(0, 1))
    _slow(cp.program(SEQ).stages[0].runnable, 0.2)
    t0 = time.perf_counter()
    with pytest.raises(StageTimeout, match=r"stage 0 \(rank 0\) ended chunk \d+ after it"):
        cp.run(args, executor="distributed", timeout=0.3)
    assert time.perf_counter() - t0 < 1.5  # 16 chunks of 0.2 s otherwise
