"""Bounded failure of a distributed job: a stage that raises or is killed (SIGKILL) makes
every other rank exit non-zero on its own, within the communication timeout, naming it.

``tppc.launch`` does not tear the job down when a rank fails (torchrun would): the ranks
must notice. ``TPPC_FAULT=ACTION@STAGE:CHUNK`` makes stage 1 fail at its second chunk.
"""

from __future__ import annotations

import signal
import time

import pytest

import tppc

pytestmark = pytest.mark.timeout(600)

COMM_TIMEOUT = 20.0


def _fail(checkpoint: str, nprocs: int, action: str) -> tppc.StageFailed:
    with pytest.raises(tppc.StageFailed) as info:
        tppc.launch("tppc.examples:gpt", nprocs, checkpoint=checkpoint, chunks=4,
                    comm_timeout=COMM_TIMEOUT, timeout=240,
                    env={"TPPC_FAULT": f"{action}@1:1"})
    return info.value


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_raising_stage_stops_every_rank(checkpoint: str, nprocs: int) -> None:
    err = _fail(checkpoint, nprocs, "raise")
    assert all(code == 1 for code in err.returncodes), err.returncodes  # none was killed
    lines = str(err).splitlines()[1:]
    assert len(lines) == nprocs
    assert all("stage 1 (rank 1) raised" in line for line in lines), str(err)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_killed_stage_stops_every_rank(checkpoint: str, nprocs: int) -> None:
    err = _fail(checkpoint, nprocs, "kill")
    codes = err.returncodes
    assert codes[1] == -signal.SIGKILL
    survivors = [c for r, c in enumerate(codes) if r != 1]
    assert survivors == [1] * (nprocs - 1), codes  # exited on their own, non-zero
    for line in str(err).splitlines()[1:]:
        if not line.strip().startswith("rank 1 "):
            assert "stage 1 (rank 1)" in line, str(err)


def test_survivors_exit_within_the_timeout(checkpoint: str) -> None:
    """A stage that hangs: the others give up after the communication timeout, and the
    hung rank's watchdog ends it once the failure is recorded (launch's own limit is 240 s)."""
    t0 = time.perf_counter()
    with pytest.raises(tppc.StageFailed) as info:
        tppc.launch("tppc.examples:gpt", 2, checkpoint=checkpoint, chunks=4, comm_timeout=5,
                    timeout=240, env={"TPPC_FAULT": "hang@1:1"})
    assert info.value.returncodes == (1, 1)
    assert "stage 1 (rank 1)" in str(info.value)
    assert time.perf_counter() - t0 < 150


def test_a_call_timeout_raises_stage_timeout_naming_the_stage(checkpoint: str) -> None:
    """``timeout=`` of a call (``--call-timeout``): stage 0 hangs at its second chunk, rank
    1 raises StageTimeout naming it after 3 s, well before the communication timeout."""
    t0 = time.perf_counter()
    with pytest.raises(tppc.StageFailed) as info:
        tppc.launch("tppc.examples:gpt", 2, checkpoint=checkpoint, chunks=4, comm_timeout=60,
                    timeout=240, env={"TPPC_FAULT": "hang@0:1"},
                    extra_args=["--call-timeout", "3"])
    assert info.value.returncodes == (1, 1)
    rank1 = str(info.value).splitlines()[2]
    assert "StageTimeout" in rank1 and "stage 0 (rank 0)" in rank1, str(info.value)
    assert time.perf_counter() - t0 < 90


def test_rank0s_wait_for_the_results_ends_at_the_call_timeout(checkpoint: str) -> None:
    """The last stage hangs on its last chunk while rank 0, its own stage done, waits for
    the results: rank 0 raises StageTimeout naming the last stage after ``--call-timeout 3``,
    not StageFailed after the 60 s communication timeout."""
    t0 = time.perf_counter()
    with pytest.raises(tppc.StageFailed) as info:
        tppc.launch("tppc.examples:gpt", 2, checkpoint=checkpoint, chunks=4, comm_timeout=60,
                    timeout=240, env={"TPPC_FAULT": "hang@1:3"},
                    extra_args=["--call-timeout", "3"])
    assert info.value.returncodes == (1, 1)
    rank0 = str(info.value).splitlines()[1]
    assert "StageTimeout" in rank0 and "stage 1 (rank 1)" in rank0, str(info.value)
    assert "the results" in rank0, str(info.value)
    assert time.perf_counter() - t0 < 90
