"""The denoise loops follow the patch program's action lists (local, threads, and each rank of
the distributed loop), here a valid order other than the flow shop: a wavefront in which
patch 0 of the second pipelined step runs before patch 2 of the first."""

from __future__ import annotations

import dataclasses
import queue
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import tppc
from tests.oracles import two_stage_plan
from tppc import examples
from tppc.distributed import denoise as distributed_denoise
from tppc.pipefusion import jobs as denoise_jobs
from tppc.program.schedule import Action, check_actions

diffusers = pytest.importorskip("diffusers")

ORDER = ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (1, 2))
"""(pipelined step, patch) on every stage: 3 patches, 2 pipelined steps."""


def wavefront(chunks: tuple[tuple[int, int], ...], stages: int) -> tuple[tuple[Action, ...], ...]:
    return (tuple(Action(t, m, *chunks[m]) for t, m in ORDER),) * stages


@pytest.fixture(scope="module")
def dit():
    model, args, _ = examples.dit()
    plan = two_stage_plan(tppc.compile(model, args, executor="local"))
    return args, tppc.compile(model, args, executor="threads", plan=plan)


def _denoise(cp, args, executor):
    return cp.denoise(args[0], diffusers.DDIMScheduler(), 3, warmup_steps=1, patches=3,
                      model_kwargs={"y": args[2]}, timestep_arg="t", executor=executor)


def test_local_and_threads_denoise_follow_the_lists(dit, monkeypatch) -> None:
    args, cp = dit
    default = _denoise(cp, args, "local")
    (key, (full, first, rest)), = cp._denoise_programs.items()
    cp._denoise_programs[key] = (full, dataclasses.replace(
        first, actions=wavefront(first.chunks, len(first.stages))), rest)
    starts = [a for a, _ in first.chunks]
    log: list[tuple[int, Any, int]] = []
    real = denoise_jobs.run_stage

    def spy(stage, call, state, start, end, received):
        log.append((stage.index, call, start))
        return real(stage, call, state, start, end, received)

    monkeypatch.setattr(denoise_jobs, "run_stage", spy)
    runs = {}
    for executor in ("local", "threads"):
        log.clear()
        runs[executor] = _denoise(cp, args, executor)
        calls = list(dict.fromkeys(call for _, call, _ in log))  # step 0's call comes first
        for s in (0, 1):
            assert [(calls.index(c), starts.index(a)) for st, c, a in log if st == s] \
                == list(ORDER)
    torch.testing.assert_close(runs["local"], runs["threads"], rtol=0, atol=0)
    assert not torch.equal(runs["local"], default)  # the order changed what went stale


def test_each_distributed_rank_follows_its_lowered_list(monkeypatch) -> None:
    """Both ranks of the distributed denoise loop in threads, joined by queues instead of
    torch.distributed; the stage call is a stub that returns its job."""
    chunks = ((0, 2), (2, 4), (4, 6))
    dry = check_actions(wavefront(chunks, 2), (0,))
    wire = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    log: dict[int, list[tuple[str, Any]]] = {0: [], 1: []}
    latents = {r: torch.zeros(3, 2) for r in (0, 1)}

    class Done:
        def __init__(self, fill=None) -> None:
            self.fill = fill

        def wait(self, *_: Any) -> None:
            if self.fill is not None:
                self.fill()

        def is_completed(self) -> bool:
            return True

    def isend(tensor, dst):
        log[1].append(("send", dst))
        wire[(1, dst)].put(tensor.clone())
        return Done()

    def irecv(buf, src):
        log[0].append(("recv", src))
        return Done(lambda: buf.copy_(wire[(src, 0)].get(timeout=30)))

    class Ex:  # the executor's face the process-group transport reads
        queue_depth = 2

        def __init__(self, rank: int) -> None:
            self.rank, self._peer = rank, None

        def expired(self, deadline):
            return False

        def who(self, r: int) -> str:
            return f"rank {r}"

        def recv_chunk(self, program, size, deadline, peer):
            log[self.rank].append(("recv", peer))
            return wire[(peer, self.rank)].get(timeout=30)

        def send_chunk(self, program, values, peer):
            log[self.rank].append(("send", peer))
            wire[(self.rank, peer)].put(values)
            return [], values

        def wait(self, works, peer, deadline):
            for w in works:
                w.wait()

        def failure(self, exc, where, detail=""):
            return RuntimeError(f"{where}: {exc}\n{detail}")

    def stage_call(stage, call, state, start, end, received):
        log[stage].append(("compute", (call, start // 2)))
        return (call, start)

    monkeypatch.setattr(distributed_denoise, "dist", SimpleNamespace(isend=isend, irecv=irecv))
    monkeypatch.setattr(distributed_denoise, "run_stage", stage_call)
    errors: list[BaseException] = []

    class Worker:  # a worker's runner: its part is the worker's rank (the stub logs it)
        def __init__(self, r: int) -> None:
            self.r = r

        def part(self, _p: Any) -> int:
            return self.r

    program = SimpleNamespace(stages=(0, 1), runners=(Worker(0), Worker(1)))

    def rank(r: int) -> None:
        cp = SimpleNamespace(comm=Ex(r), rank=r, world=2,
                             options=SimpleNamespace(timeout=None, queue_depth=2))
        jobs = distributed_denoise._Jobs(cp, [0, 1], None, lambda m: program,
                                         lambda m: latents[r][m], 1, leader=1)

        def finish(t: int, m: int, values: Any) -> None:  # the last rank steps patch m
            latents[r][m] += 1

        try:
            jobs.run(dry, finish)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not errors, errors
    for r in (0, 1):
        want = [("compute", a.job) if a.kind == "compute" else (a.kind, a.peer)
                for a in dry.actions[r]]
        assert log[r] == want
    torch.testing.assert_close(latents[0], torch.ones(3, 2))  # step 0's patches came back
    torch.testing.assert_close(latents[1], torch.full((3, 2), 2.0))
