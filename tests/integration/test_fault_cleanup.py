"""Faults leave nothing behind: no rank process, shared-memory file or job directory.

Each job (2 ranks, gloo, the own GPT) runs in a child process of the test: ``torchrun`` or a
script calling ``tppc.launch``. While it runs, the test records the job's ranks (children of
that process, ``RANK`` from their environment), the shared-output files they own
(``/dev/shm/tppc-<pid>-*``) and the launch directory (``TPPC_LAUNCH_DIR``). It then breaks
the job (``TPPC_FAULT`` makes a stage raise or hang at its second chunk; the test kills a
rank or the launcher) and, once the job is over, lists what remains of those pids and paths.
A hanging stage makes "mid-call" certain: its shared-output file exists while it hangs, and
the test waits to see it (so a run that never created one cannot pass for a clean one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
RANK_ARGS = ["tppc.examples:gpt", "--chunks", "4", "--threads", "1", "--device", "cpu"]
JOB_S = 240.0
"""Generous bound on one job, compile included, on a loaded 2-core machine."""


class Job:
    """A job's top process and what the test saw of its ranks (module docstring)."""

    def __init__(self, argv: list[str], fault: str | None) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("TPPC_FAULT", None)
        if fault:
            env["TPPC_FAULT"] = fault
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.ranks: dict[int, int] = {}  # rank -> pid
        self.launch_dir: Path | None = None
        self.segments: set[Path] = set()

    def watch(self, until: Callable[[], bool], limit: float = JOB_S) -> bool:
        """Record ranks and files every 0.1 s until ``until()`` or the top process ended."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            self._look()
            if until():
                return True
            if self.proc.poll() is not None:
                return until()
            time.sleep(0.1)
        return False

    def finish(self, limit: float = JOB_S) -> str:
        """Wait for the top process (killing its group past ``limit``); returns its output."""
        try:
            out, _ = self.proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
            pytest.fail(f"the job outlived {limit} s:\n{out.decode()[-3000:]}")
        return out.decode()

    def hung_mid_call(self) -> bool:
        """Both ranks are up and the last one holds its shared-output file."""
        return len(self.ranks) == 2 and any(
            p.name.startswith(f"tppc-{self.ranks[1]}-") for p in self.segments)

    def leftovers(self, wait: float) -> tuple[list[int], list[Path], bool]:
        """(live rank pids, their shared-output files, launch directory present) once every
        rank is gone or ``wait`` seconds passed."""
        deadline = time.monotonic() + wait
        while any(_alive(p) for p in self.ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        live = [p for p in self.ranks.values() if _alive(p)]
        files = [p for pid in self.ranks.values()
                 for p in Path("/dev/shm").glob(f"tppc-{pid}-*")]
        return live, files, self.launch_dir is not None and self.launch_dir.exists()

    def kill_ranks(self) -> None:
        for pid in self.ranks.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    def _look(self) -> None:
        for pid in _children(self.proc.pid):
            env = _environ(pid)
            if "RANK" in env:
                self.ranks.setdefault(int(env["RANK"]), pid)
                if env.get("TPPC_LAUNCH_DIR"):
                    self.launch_dir = Path(env["TPPC_LAUNCH_DIR"])
        for pid in self.ranks.values():
            self.segments.update(Path("/dev/shm").glob(f"tppc-{pid}-*"))


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie may wait for a PID 1 that never reaps)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _torchrun(checkpoint: str, fault: str | None, logs: Path, comm_timeout: float = 60) -> Job:
    """(``logs``: torchrun's own log directory, which it never removes; default in /tmp.)"""
    return Job([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--log-dir", str(logs), "--nproc-per-node", "2", "-m", "tppc.run", *RANK_ARGS,
                "--checkpoint", checkpoint, "--timeout", str(comm_timeout)], fault)


def _launcher(checkpoint: str, fault: str | None, comm_timeout: float = 60,
              timeout: float | None = 240) -> Job:
    script = ("import signal, tppc; signal.signal(signal.SIGINT, signal.default_int_handler); "
              f"tppc.launch('tppc.examples:gpt', 2, checkpoint={checkpoint!r}, chunks=4, "
              f"comm_timeout={comm_timeout}, timeout={timeout})")  # (SIGINT may be ignored in a
    # background job)
    return Job([sys.executable, "-c", script], fault)


def _assert_clean(job: Job, wait: float, output: str) -> None:
    assert len(job.ranks) == 2, f"the job's ranks were never seen:\n{output[-3000:]}"
    live, files, launch_dir = job.leftovers(wait)
    job.kill_ranks()  # (only if the assertion below fails)
    assert not live, f"ranks {live} outlived the job by {wait} s:\n{output[-3000:]}"
    assert not files, f"left behind: {files}\n{output[-3000:]}"
    assert not launch_dir, f"left behind: {job.launch_dir}\n{output[-3000:]}"


@pytest.mark.parametrize("killed", [1, 0])
def test_torchrun_rank_killed_mid_call_leaves_nothing(checkpoint: str, killed: int,
                                                      tmp_path: Path) -> None:
    """SIGKILL of the last rank (it owns the shared-output file: rank 0 sweeps it) or of
    rank 0 (the last rank releases its own), while rank ``killed`` hangs mid-call."""
    job = _torchrun(checkpoint, f"hang@{killed}:1", tmp_path)
    assert job.watch(job.hung_mid_call), job.finish(10)
    os.kill(job.ranks[killed], signal.SIGKILL)
    output = job.finish()
    assert job.proc.returncode != 0
    _assert_clean(job, 10.0, output)


def test_torchrun_hung_rank_leaves_nothing(checkpoint: str, tmp_path: Path) -> None:
    """The last rank hangs mid-call: rank 0 fails after the communication timeout, torchrun
    or the watchdog ends the hung rank, and its shared-output file goes with it."""
    job = _torchrun(checkpoint, "hang@1:1", tmp_path, comm_timeout=5)
    assert job.watch(job.hung_mid_call), job.finish(10)
    output = job.finish()
    assert job.proc.returncode != 0
    _assert_clean(job, 10.0, output)


def test_torchrun_killed_takes_its_ranks_and_files(checkpoint: str, tmp_path: Path) -> None:
    """SIGKILL of torchrun itself: its ranks (their parent gone) release their files and
    exit within a second or so, instead of waiting out the communication timeout."""
    job = _torchrun(checkpoint, "hang@1:1", tmp_path)
    assert job.watch(job.hung_mid_call), job.finish(10)
    t0 = time.monotonic()
    os.kill(job.proc.pid, signal.SIGKILL)
    output = job.finish(30)
    _assert_clean(job, 10.0, output)
    assert time.monotonic() - t0 < 10.0


def test_torchrun_raising_stage_leaves_nothing(checkpoint: str, tmp_path: Path) -> None:
    job = _torchrun(checkpoint, "raise@1:1", tmp_path)
    job.watch(lambda: False)
    output = job.finish()
    assert job.proc.returncode != 0 and "TPPC_FAULT injected" in output, output[-3000:]
    _assert_clean(job, 10.0, output)


def test_launcher_killed_takes_its_ranks_and_files(checkpoint: str) -> None:
    """SIGKILL of the process running ``tppc.launch``: the ranks get the parent-death
    signal, release their files, remove the dead launcher's directory and exit."""
    job = _launcher(checkpoint, "hang@1:1")
    assert job.watch(job.hung_mid_call), job.finish(10)
    assert job.launch_dir is not None and job.launch_dir.is_dir()
    t0 = time.monotonic()
    os.kill(job.proc.pid, signal.SIGKILL)
    output = job.finish(30)
    _assert_clean(job, 10.0, output)
    assert time.monotonic() - t0 < 10.0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_launcher_interrupted_stops_its_ranks(checkpoint: str, sig: signal.Signals) -> None:
    """SIGINT (Ctrl-C) or SIGTERM to the launcher: it stops its ranks, removes their files
    and its directory, and exits; no rank re-creates the directory afterwards."""
    job = _launcher(checkpoint, "hang@1:1")
    assert job.watch(job.hung_mid_call), job.finish(10)
    t0 = time.monotonic()
    os.kill(job.proc.pid, sig)
    output = job.finish(30)
    assert job.proc.returncode != 0
    assert time.monotonic() - t0 < 15.0, output[-3000:]
    _assert_clean(job, 5.0, output)
    time.sleep(1.0)
    assert job.launch_dir is not None and not job.launch_dir.exists()


def test_launcher_raising_stage_leaves_nothing(checkpoint: str) -> None:
    job = _launcher(checkpoint, "raise@1:1")
    job.watch(lambda: False)
    output = job.finish()
    assert "StageFailed" in output and "TPPC_FAULT injected" in output, output[-3000:]
    _assert_clean(job, 5.0, output)


def test_launcher_stopped_rank_ends_the_job_within_the_comm_timeout(checkpoint: str) -> None:
    """The last rank stops itself (SIGSTOP) mid-call, holding its shared-output file, under
    ``timeout=None``: rank 0 fails after ``comm_timeout`` (5 s), the launcher kills the
    stopped rank at once and sweeps its file (before: it waited for the stopped rank until
    ``timeout``, forever with None)."""
    job = _launcher(checkpoint, "stop@1:1", comm_timeout=5, timeout=None)
    assert job.watch(lambda: job.hung_mid_call() and _stopped(job.ranks[1])), job.finish(10)
    t0 = time.monotonic()
    output = job.finish(60)
    assert job.proc.returncode != 0 and "StageFailed" in output, output[-3000:]
    assert time.monotonic() - t0 < 5 + 10, output[-3000:]
    _assert_clean(job, 5.0, output)



def test_torchrun_stopped_rank_ends_the_job_within_the_comm_timeout(checkpoint: str,
                                                                     tmp_path: Path) -> None:
    """The last rank stops itself (SIGSTOP) mid-call under torchrun: rank 0 fails after
    ``comm_timeout`` (5 s), kills its stopped sibling (same torchrun agent, same run id) and
    sweeps its file, so torchrun ends the job at once (before: torchrun's SIGTERM stayed
    pending in the stopped rank until its SIGKILL 30 s later)."""
    job = _torchrun(checkpoint, "stop@1:1", tmp_path, comm_timeout=5)
    assert job.watch(lambda: job.hung_mid_call() and _stopped(job.ranks[1])), job.finish(10)
    t0 = time.monotonic()
    output = job.finish(90)
    elapsed = time.monotonic() - t0
    assert job.proc.returncode != 0 and "killed stopped rank process" in output, output[-3000:]
    assert elapsed < 5 + 10, f"{elapsed:.1f} s\n{output[-3000:]}"
    _assert_clean(job, 5.0, output)
