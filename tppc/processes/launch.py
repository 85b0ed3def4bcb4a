"""``tppc.launch``: run a multi-process pipeline job on this machine (one process per worker).

It does what ``torchrun --nproc-per-node S -m tppc.cli.rank ...`` does, minus the elastic
agent: it hosts the job's c10d store itself (so the store outlives any rank, and a killed
rank's failure can still be reported), starts ``S`` processes of :mod:`tppc.run` with the
torchrun environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
``OMP_NUM_THREADS``), waits for them, and returns rank 0's outputs.

Unlike torchrun it does not kill the other ranks when one fails: each rank must notice and
exit on its own within ``comm_timeout`` (which is what the failure tests check). Once a rank
failed, it kills a rank that is stopped (SIGSTOP: it cannot notice anything) at once, and any
rank still running ``comm_timeout`` + :data:`STOP_GRACE_S` later; after ``timeout`` seconds
it kills what is left. A stopped rank thus ends the job within about ``comm_timeout``: its
peers give up on it after that.

Terms:
    job directory: ``<tmp>/tppc-launch-XXXX`` (inputs, outputs, reports, logs), owned by the
        launcher (:mod:`tppc.processes.owned_files`: locked while it lives).
    cleanup: however :func:`launch` ends (a result, a failed rank, an exception, SIGINT, or
        SIGTERM when it runs in the main thread without a SIGTERM handler of its own), it
        stops the ranks still running (SIGTERM, SIGKILL after :data:`STOP_GRACE_S`),
        removes the shared-output files of its dead ranks and its job directory. When the
        launcher itself is killed (SIGKILL), its ranks get SIGTERM from the kernel (parent
        death signal, :mod:`tppc.processes.rank_exit`), release their files, remove the dead
        launcher's directory and exit; whatever a process killed outright left is swept
        by the next launch or rank (:func:`tppc.processes.owned_files.sweep_all`).

Example:
    >>> out = tppc.launch("tppc.examples:hf_llama", 2, checkpoint="llama.safetensors",
    ...                   inputs={"args.0": ids})                         # doctest: +SKIP
    >>> out.outputs["out.0"].shape
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from tppc.driver.options import check_seconds
from tppc.errors import SpecError, StageFailed
from tppc.processes import owned_files
from tppc.processes.rank_exit import LAUNCH_DIR_ENV, LAUNCHER_PID_ENV
from tppc.program.cores import cores_per_device

__all__ = ["STOP_GRACE_S", "LaunchResult", "launch"]

STOP_GRACE_S = 5.0
"""Seconds the ranks get to exit after SIGTERM before they are killed."""


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
           threads: int | None = None, comm_timeout: float = 30.0, timeout: float | None = 300.0,
           repeat: int = 1, env: Mapping[str, str] | None = None,
           extra_args: Sequence[str] = (),
           tensor_parallel: int | Sequence[int] | None = None,
           cfg_parallel: int | None = None, ulysses: int | None = None,
           ring: int | None = None) -> LaunchResult:
    """Run ``python -m tppc.cli.rank FACTORY ...`` as ``nprocs`` local ranks; see the module doc.

    Args:
        factory: ``MODULE:FACTORY``, or a directory written by :func:`tppc.export` (each
            rank loads its stage's ONNX file; ``inputs`` named as in its ``plan.json``).
        nprocs: ranks (= workers: the stages, or with ``tensor_parallel`` the sum of their
            degrees, times ``cfg_parallel x ulysses x ring``; a job of another size is
            refused, naming both numbers).
        checkpoint: safetensors file of the weights.
        inputs: ``args.0``, ``kwargs.NAME``... tensors (default: the factory's examples).
        generate: greedy-generate this many tokens instead of one call.
        factory_kwargs: JSON keywords of the factory.
        chunks, cluster: planning options (see :mod:`tppc.run`).
        threads: intra-op threads per rank (``--threads``); None: each rank its CPU
            device's share of this machine's physical cores, the ``nprocs`` ranks sharing
            them (:mod:`tppc.distributed.rank_threads`).
        comm_timeout: seconds a rank waits for a peer before failing.
        timeout: seconds after which the remaining ranks are killed (None: no limit; the
            ranks still end on their own ``comm_timeout`` when a peer is gone).
        repeat: calls per job (for timing).
        env: extra environment of the ranks (e.g. ``TPPC_FAULT``).
        extra_args: more ``tppc.run`` arguments.
        tensor_parallel: each stage's tensor-parallel degree (one int for every stage, or
            one per stage; ``--tensor-parallel``); None: the plan's.
        cfg_parallel, ulysses, ring: every stage's degree of that axis (``--cfg-parallel``,
            ``--ulysses``, ``--ring``); None: the plan's.

    Raises:
        StageFailed: a rank exited non-zero (the message holds every rank's error line;
            ``returncodes`` every exit status) or the job outlived ``timeout``.

    However it ends, no rank, shared-output file or job directory is left (module doc).
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise SpecError(f"nprocs={nprocs!r} must be an integer ≥ 1 (one process per worker)")
    check_seconds("comm_timeout", comm_timeout)
    check_seconds("timeout", timeout)
    if tensor_parallel is not None:
        degrees = [tensor_parallel] if isinstance(tensor_parallel, int) else tensor_parallel
        extra_args = (*extra_args, "--tensor-parallel", ",".join(map(str, degrees)))
    for flag, degree in (("--cfg-parallel", cfg_parallel), ("--ulysses", ulysses),
                         ("--ring", ring)):
        if degree is not None:
            extra_args = (*extra_args, flag, str(degree))
    owned_files.sweep_all()  # what launches and ranks killed outright left behind
    work = owned_files.create_dir(owned_files.LAUNCH_PREFIX)
    procs: list[subprocess.Popen] = []
    try:
        with _sigterm_raises():
            return _launch(work, procs, factory, nprocs, checkpoint, inputs, generate,
                           factory_kwargs, chunks, cluster, threads, comm_timeout, timeout,
                           repeat, env, extra_args)
    finally:  # outputs, reports and logs are read into the result first
        _stop(procs)
        owned_files.sweep(owned_files.SHM_ROOT, owned_files.SHM_PREFIX)  # of killed ranks
        owned_files.release(work)


def _launch(work: Path, procs: list[subprocess.Popen], factory: str | Path, nprocs: int,
            checkpoint: str | Path | None, inputs: Mapping[str, Any] | None,
            generate: int | None, factory_kwargs: str, chunks: int | None,
            cluster: str | None, threads: int | None, comm_timeout: float,
            timeout: float | None, repeat: int, env: Mapping[str, str] | None,
            extra_args: Sequence[str]) -> LaunchResult:
    import numpy as np

    argv = [sys.executable, "-m", "tppc.run", str(factory), "--factory-kwargs", factory_kwargs,
            "--output", str(work / "out.npz"), "--report", str(work),
            "--timeout", str(comm_timeout), "--device", "cpu", "--repeat", str(repeat),
            *extra_args]
    if threads is not None:
        argv += ["--threads", str(threads)]
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
                                       timeout=timedelta(seconds=timeout or comm_timeout),
                                       wait_for_workers=False)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:  # the logs are closed however this ends
        logs = [stack.enter_context(open(work / f"rank{rank}.log", "w+"))
                for rank in range(nprocs)]
        for rank, log in enumerate(logs):
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                          env=_rank_env(rank, nprocs, port, threads, env,
                                                        work)))
        codes = _wait(procs, math.inf if timeout is None else t0 + timeout,
                      comm_timeout + STOP_GRACE_S)
        seconds = time.perf_counter() - t0
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
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


def _rank_env(rank: int, world: int, port: int, threads: int | None,
              extra: Mapping[str, str] | None, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "OMP_NUM_THREADS": str(threads or cores_per_device(world)),
                LAUNCHER_PID_ENV: str(os.getpid()), LAUNCH_DIR_ENV: str(work)})
    env.update(extra or {})
    return env


def _wait(procs: list[subprocess.Popen], deadline: float, grace: float
          ) -> tuple[int | None, ...]:
    """Wait for every rank until ``deadline``, then kill what is left. Once a rank failed,
    a rank that cannot act (stopped: SIGSTOP, a debugger) is killed at once, and one still
    running ``grace`` seconds later (``comm_timeout`` + :data:`STOP_GRACE_S`: each must
    notice a lost peer on its own within ``comm_timeout``) too."""
    failed_at: float | None = None
    while any(p.poll() is None for p in procs) and time.perf_counter() < deadline:
        now = time.perf_counter()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if failed_at is not None:
            for p in procs:
                if p.poll() is None and (_stopped(p.pid) or now > failed_at + grace):
                    p.kill()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return tuple(p.returncode for p in procs)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state ``T``: SIGSTOP; ``t``: a tracer's stop)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")


def _stop(procs: list[subprocess.Popen]) -> None:
    """End the ranks still running: SIGTERM (they release their files), then SIGKILL
    after :data:`STOP_GRACE_S`; every rank is reaped."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(143)`` while the job runs, so that :func:`launch` cleans
    up before the process ends as SIGTERM would end it; only in the main thread, and only
    when the process has no SIGTERM handler of its own."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


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
