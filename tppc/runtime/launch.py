"""``tppc.launch``: run a multi-process pipeline job on this machine (one process per stage).

It does what ``torchrun --nproc-per-node S -m tppc.cli.rank ...`` does, minus the elastic
agent: it hosts the job's c10d store itself (so the store outlives any rank, and a killed
rank's failure can still be reported), starts ``S`` processes of :mod:`tppc.run` with the
torchrun environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
``OMP_NUM_THREADS``), waits for them, and returns rank 0's outputs.

Unlike torchrun it does not kill the other ranks when one fails: each rank must notice and
exit on its own within ``comm_timeout`` (which is what the failure tests check); only after
``timeout`` seconds does it kill what is left.

Example:
    >>> out = tppc.launch("tppc.examples:hf_llama", 2, checkpoint="llama.safetensors",
    ...                   inputs={"args.0": ids})                         # doctest: +SKIP
    >>> out.outputs["out.0"].shape
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tppc.driver.options import check_seconds
from tppc.errors import SpecError, StageFailed

__all__ = ["LaunchResult", "launch"]


@dataclass(frozen=True)
class LaunchResult:
    """What a job returned.

    Attributes:
        outputs: rank 0's outputs by name (``out.0``..., or ``ids``).
        reports: each rank's report (times, memory; see :mod:`tppc.run`).
        returncodes: exit status of each rank.
        seconds: wall time of the job.
        logs: each rank's stderr.
    """

    outputs: dict[str, torch.Tensor]
    reports: list[dict[str, Any]]
    returncodes: tuple[int | None, ...]
    seconds: float
    logs: list[str] = field(repr=False)


def launch(factory: str | Path, nprocs: int, *, checkpoint: str | Path | None = None,
           inputs: Mapping[str, Any] | None = None, generate: int | None = None,
           factory_kwargs: str = "{}", chunks: int | None = None, cluster: str | None = None,
           threads: int = 1, comm_timeout: float = 30.0, timeout: float = 300.0,
           repeat: int = 1, env: Mapping[str, str] | None = None,
           extra_args: Sequence[str] = ()) -> LaunchResult:
    """Run ``python -m tppc.cli.rank FACTORY ...`` as ``nprocs`` local ranks; see the module doc.

    Args:
        factory: ``MODULE:FACTORY``, or a directory written by :func:`tppc.export` (each
            rank loads its stage's ONNX file; ``inputs`` named as in its ``plan.json``).
        nprocs: ranks (= stages).
        checkpoint: safetensors file of the weights.
        inputs: ``args.0``, ``kwargs.NAME``... tensors (default: the factory's examples).
        generate: greedy-generate this many tokens instead of one call.
        factory_kwargs: JSON keywords of the factory.
        chunks, cluster: planning options (see :mod:`tppc.run`).
        threads: intra-op threads per rank.
        comm_timeout: seconds a rank waits for a peer before failing.
        timeout: seconds after which the remaining ranks are killed.
        repeat: calls per job (for timing).
        env: extra environment of the ranks (e.g. ``TPPC_FAULT``).
        extra_args: more ``tppc.run`` arguments.

    Raises:
        StageFailed: a rank exited non-zero (the message holds every rank's error line;
            ``returncodes`` every exit status) or the job outlived ``timeout``.

    The job's temporary directory (inputs, outputs, reports, logs) is removed on return.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise SpecError(f"nprocs={nprocs!r} must be an integer ≥ 1 (one process per stage)")
    check_seconds("comm_timeout", comm_timeout)
    check_seconds("timeout", timeout)
    work = Path(tempfile.mkdtemp(prefix="tppc-launch-"))
    try:
        return _launch(work, factory, nprocs, checkpoint, inputs, generate, factory_kwargs,
                       chunks, cluster, threads, comm_timeout, timeout, repeat, env,
                       extra_args)
    finally:  # outputs, reports and logs are read into the result first
        shutil.rmtree(work, ignore_errors=True)


def _launch(work: Path, factory: str | Path, nprocs: int, checkpoint: str | Path | None,
            inputs: Mapping[str, Any] | None, generate: int | None, factory_kwargs: str,
            chunks: int | None, cluster: str | None, threads: int, comm_timeout: float,
            timeout: float, repeat: int, env: Mapping[str, str] | None,
            extra_args: Sequence[str]) -> LaunchResult:
    import numpy as np

    argv = [sys.executable, "-m", "tppc.run", str(factory), "--factory-kwargs", factory_kwargs,
            "--output", str(work / "out.npz"), "--report", str(work),
            "--timeout", str(comm_timeout), "--threads", str(threads), "--device", "cpu",
            "--repeat", str(repeat), *extra_args]
    if checkpoint is not None:
        argv += ["--checkpoint", str(checkpoint)]
    if inputs is not None:
        np.savez(work / "in.npz", **{k: np.asarray(v) for k, v in inputs.items()})
        argv += ["--input", str(work / "in.npz")]
    if generate is not None:
        argv += ["--generate", str(generate)]
    if chunks is not None:
        argv += ["--chunks", str(chunks)]
    if cluster is not None:
        argv += ["--cluster", cluster]
    port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, nprocs, is_master=True,
                                       timeout=timedelta(seconds=timeout),
                                       wait_for_workers=False)
    t0 = time.perf_counter()
    procs, logs = [], []
    for rank in range(nprocs):
        log = open(work / f"rank{rank}.log", "w+")  # closed below
        logs.append(log)
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                      env=_rank_env(rank, nprocs, port, threads, env)))
    codes = _wait(procs, t0 + timeout)
    for p in procs:  # shared-memory outputs of a rank killed mid-call
        for leftover in Path("/dev/shm").glob(f"tppc-{p.pid}-*"):
            leftover.unlink(missing_ok=True)
    seconds = time.perf_counter() - t0
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    del store
    if any(c != 0 for c in codes):
        lines = [f"rank {r} (exit {c}): " + _error_line(t) for r, (c, t)
                 in enumerate(zip(codes, texts)) if c != 0]
        raise StageFailed(f"the job of {nprocs} ranks failed after {seconds:.1f} s:\n  "
                          + "\n  ".join(lines), returncodes=codes)
    outputs: dict[str, torch.Tensor] = {}
    if (work / "out.npz").exists():
        with np.load(work / "out.npz") as data:
            outputs = {k: torch.from_numpy(data[k].copy()) for k in data.files}
    import json

    reports = [json.loads((work / f"rank{r}.json").read_text()) for r in range(nprocs)
               if (work / f"rank{r}.json").exists()]
    return LaunchResult(outputs, reports, codes, seconds, texts)


def _rank_env(rank: int, world: int, port: int, threads: int,
              extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": str(threads)})
    env.update(extra or {})
    return env


def _wait(procs: list[subprocess.Popen], deadline: float) -> tuple[int | None, ...]:
    while any(p.poll() is None for p in procs) and time.perf_counter() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return tuple(p.returncode for p in procs)


def _error_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("[tppc.run")]
    if lines:
        return lines[-1]
    tail = text.strip().splitlines()
    return tail[-1] if tail else "(killed, no output)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
