"""Every executor follows the program's action lists, not an order of its own.

Each test gives a program lists in a valid order other than the flow shop and records what
the executor did (its trace, or a spy on the stage call): it must be the lists' order, and
the outputs stay the eager model's. The order used for prefill: stage 0 computes every chunk
before it sends any, and stage 1 takes every chunk off the wire before it computes one, so
stage 1 cannot start before stage 0 is done (impossible under the flow shop).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.artifact.core.load import verify
from tppc.artifact.core.loaded import Assembler
from tppc.artifact.torch_runners.distributed import DistributedArtifact
from tppc.backends import onnxruntime as ort_backend
from tppc.backends import torch_distributed
from tppc.backends.torch_distributed import DistributedExecutor
from tppc.program.schedule import check_actions, flow_shop, lower

SEQ = 32
CHUNKS = ((0, 8), (8, 16), (16, 24), (24, 32))


def held(chunks: tuple[tuple[int, int], ...]) -> tuple[tuple[Any, ...], ...]:
    """Stage 0 computes all, then sends all; stage 1 receives all, then computes all."""
    s0, s1 = lower(flow_shop(chunks, 2))
    return (tuple(a for a in s0 if a.kind == "compute") + tuple(a for a in s0 if a.kind == "send"),
            tuple(a for a in s1 if a.kind == "recv") + tuple(a for a in s1 if a.kind == "compute"))


HELD = held(CHUNKS)
STARTS = [a for a, _ in CHUNKS]


@pytest.fixture(scope="module")
def gpt():
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
    cp = tppc.compile(model, args, chunks=4, num_stages=2, executor="local")
    assert cp.program(SEQ).chunks == CHUNKS
    with torch.no_grad():
        expected = model(args[0])
    return model, args, cp, expected


def _with_actions(cp, actions) -> None:
    """Give the cached program of ``SEQ`` tokens other action lists."""
    program = cp.program(SEQ)
    cp.programs.hold(cp.captures.example, dataclasses.replace(program, actions=actions))


def test_the_flow_shop_and_the_held_lists_compute_the_same_jobs(gpt) -> None:
    _, _, cp, _ = gpt
    assert cp.program(SEQ).actions == flow_shop(CHUNKS, 2)
    dry = check_actions(HELD)
    assert [(s, a.start) for s, a in dry.computes()] == [(0, a) for a in STARTS] + \
        [(1, a) for a in STARTS]


@pytest.mark.parametrize("executor", ["local", "threads"])
def test_torch_executors_follow_the_lists(gpt, executor) -> None:
    _, args, base, expected = gpt
    cp = base.with_plan(base.plan, executor=executor)
    _with_actions(cp, HELD)
    trace: list = []
    assert_kernels_close(cp.run(args, trace=trace), expected)
    for s in (0, 1):
        assert [c for st, c, *_ in trace if st == s] == [0, 1, 2, 3]
    stage0_done = max(end for st, _, _, end in trace if st == 0)
    assert min(t0 for st, _, t0, _ in trace if st == 1) >= stage0_done
    if executor == "local":
        assert [(s, c) for s, c, *_ in trace] == [(0, c) for c in range(4)] + \
            [(1, c) for c in range(4)]


class _Loopback:
    """Both ranks of the distributed executor in this thread, rank 0 first, joined by a
    list instead of torch.distributed; logs what each rank did, in order."""

    name = "loopback"

    def __init__(self) -> None:
        self.log: list[tuple[int, str, int]] = []  # (rank, kind, chunk start or size)

    def check(self, program: Any) -> None:
        return None

    def run(self, program, call, state, sink=None, timeout=None, trace=None):
        wire: list[Any] = []
        out = []
        for rank in (0, 1):
            ex = DistributedExecutor(rank, 2)
            ex._send = lambda _p, _st, _dst, values, r=rank: (
                self.log.append((r, "send", -1)), wire.append(values), ([], values))[-1]
            ex._recv = lambda _p, _src, size, _d, r=rank: (
                self.log.append((r, "recv", size)), wire.pop(0))[-1]
            ex._wait = lambda *_: None
            out = ex.run(program, call, state, sink if rank else None, trace=trace)
        return out


def test_the_distributed_executor_follows_the_lists(gpt, monkeypatch) -> None:
    _, args, base, expected = gpt
    cp = base.with_plan(base.plan)
    loop = _Loopback()
    real = torch_distributed.run_stage

    def spy(stage, call, state, start, end, received):
        loop.log.append((stage.index, "compute", start))
        return real(stage, call, state, start, end, received)

    monkeypatch.setattr(torch_distributed, "run_stage", spy)
    cp._executors["loopback"] = loop
    _with_actions(cp, HELD)
    assert_kernels_close(cp.run(args, executor="loopback"), expected)
    lowered = check_actions(HELD).actions
    for rank in (0, 1):
        want = [(a.kind, a.start if a.kind == "compute" else
                 (a.end - a.start if a.kind == "recv" else -1)) for a in lowered[rank]]
        assert [(k, v) for r, k, v in loop.log if r == rank] == want


@pytest.fixture(scope="module")
def artifact(gpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt")
    tppc.export(gpt[2], path, lengths=[SEQ])
    return path


def _spy_steps(runner, monkeypatch) -> list[tuple[int, int]]:
    """Record ``(stage, chunk start)`` of every ORT stage step, in order."""
    log: list[tuple[int, int]] = []
    for stage in runner.stages:
        real = stage.step

        def step(call, start, end, boundary, real=real, index=stage.index):
            log.append((index, start))
            return real(call, start, end, boundary)

        monkeypatch.setattr(stage, "step", step)
    return log


def test_the_onnx_runtime_pipeline_follows_the_lists(gpt, artifact, monkeypatch) -> None:
    _, args, _, expected = gpt
    runner = tppc.load(artifact)
    assert runner.actions_for(CHUNKS) == flow_shop(CHUNKS, 2)  # derived from plan.json
    ids = args[0].numpy()
    before = runner(ids)
    runner.actions[CHUNKS] = HELD
    log = _spy_steps(runner, monkeypatch)
    after = runner(ids)
    np.testing.assert_array_equal(after, before)
    assert_kernels_close(after, expected.numpy())
    for s in (0, 1):
        assert [a for st, a in log if st == s] == STARTS
    trace = runner.last_trace
    assert min(t0 for st, _, t0, _ in trace if st == 1) >= max(e for st, _, _, e in trace
                                                               if st == 0)


def test_the_onnx_runtime_serial_loop_follows_the_lists(gpt, artifact, monkeypatch) -> None:
    _, args, _, expected = gpt
    runner = tppc.load(artifact)
    flat, length = runner.bind((args[0].numpy(),), {})
    call = ort_backend.OrtCall(flat=flat, chunks=CHUNKS, seq_len=length, pos_len=length)
    for stage in runner.stages:
        stage.allocate(call, length)
    log = _spy_steps(runner, monkeypatch)
    sink = Assembler(runner.signature["outputs"], length)
    ort_backend.run_serial(runner.stages, call, sink, HELD)
    assert log == [(s, a.start) for s, a in check_actions(HELD).computes()]
    assert log == [(0, a) for a in STARTS] + [(1, a) for a in STARTS]
    assert_kernels_close(sink.leaves[0], expected.numpy())


def test_the_distributed_artifact_runner_follows_the_lists(gpt, artifact, monkeypatch) -> None:
    _, args, _, expected = gpt
    doc = verify(artifact)
    wire: list[Any] = []
    log: list[tuple[int, str, int]] = []
    outs = []
    for rank in (0, 1):
        runner = DistributedArtifact(doc, artifact, threads=1, rank=rank, world=2,
                                     results="rank0", comm_timeout=5.0, queue_depth=2)
        runner.actions[CHUNKS] = HELD
        real = runner.stage.step
        runner.stage.step = lambda call, a, b, got, r=rank, real=real: (
            log.append((r, "compute", a)), real(call, a, b, got))[-1]
        runner._send = lambda values, r=rank: (
            log.append((r, "send", -1)), wire.append(values), ([], values))[-1]
        runner._recv = lambda size, _d, r=rank: (log.append((r, "recv", size)), wire.pop(0))[-1]
        runner._wait = lambda *_: None
        runner._share = lambda bind, extra=None: bind()  # rank 0's inputs: these
        runner._gather = lambda leaves: leaves
        outs.append(runner.run((args[0].numpy(),)))
    assert_kernels_close(outs[1], expected.numpy())
    lowered = check_actions(HELD).actions
    for rank in (0, 1):
        want = [(a.kind, a.start if a.kind == "compute" else
                 (a.end - a.start if a.kind == "recv" else -1)) for a in lowered[rank]]
        assert [(k, v) for r, k, v in log if r == rank] == want


def test_a_failing_threads_stage_names_its_action_on_the_grid(gpt, monkeypatch) -> None:
    _, args, base, _ = gpt
    cp = base.with_plan(base.plan, executor="threads")
    stage = cp.program(SEQ).stages[1].runnable
    real = stage.forward
    calls = []

    def broken(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("broken")
        return real(*a, **k)

    monkeypatch.setattr(stage, "forward", broken)
    with pytest.raises(ValueError, match="broken") as info:
        cp(*args)
    (note,) = [n for n in info.value.__notes__ if n.startswith("[tppc]")]
    assert note.splitlines()[0].startswith("[tppc] in stage 1 (cpu), step 0, chunk 1 [8, 16), "
                                           "action 3 (C0.1, a compute)")
    grid = note.splitlines()[1:]
    assert "[C0.1]" in grid[2] and "[" not in grid[1]


def test_a_failing_distributed_rank_names_its_action_on_the_grid(gpt, monkeypatch) -> None:
    _, args, base, _ = gpt
    cp = base.with_plan(base.plan)
    cp._executors["loopback"] = _Loopback()
    monkeypatch.setenv("TPPC_FAULT", "raise@1:2")
    with pytest.raises(tppc.StageFailed) as info:
        cp.run(args, executor="loopback")
    first, *rest = str(info.value).splitlines()
    assert first.startswith("stage 1 (rank 1) raised in stage 1, step 0, chunk 2 [16, 24), "
                            "action 5 (C0.2, a compute): RuntimeError: TPPC_FAULT")
    assert "[R0.2<0]" not in "\n".join(rest) and "[C0.2]" in rest[-1]
