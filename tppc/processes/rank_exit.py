"""How a rank process ends: however it ends, it leaves no file behind and dies with its launcher.

Terms:
    launcher: the process that started this rank and named itself in the rank's environment
        (:data:`LAUNCHER_PID_ENV`, and its job directory in :data:`LAUNCH_DIR_ENV`), as
        :func:`tppc.launch` does. Under torchrun (``TORCHELASTIC_RUN_ID`` set) the launcher
        is the rank's parent when it starts, torchrun's agent: torchrun ends its ranks
        (SIGTERM, then SIGKILL after 30 s) when one fails or it is interrupted, and the
        guard thread ends them when torchrun itself is killed.
    parent-death signal: on Linux the kernel sends a rank of :func:`tppc.launch` SIGTERM when
        its launcher dies, however it dies (``prctl(PR_SET_PDEATHSIG)``); the guard thread
        also checks every :data:`POLL_S` seconds that its parent is still the launcher
        (torchrun's ranks, other systems, and a launcher that died before the rank set the
        signal). The signal comes when the
        launcher's thread that started the rank exits; the launcher's other threads may
        still hold its files (and its directory's lock) for a moment.
    guard thread: wakes on SIGTERM, SIGINT or SIGHUP (through :func:`signal.set_wakeup_fd`,
        so it acts even while the main thread is blocked in a collective or a hung stage) or
        on the launcher's death; it then :func:`cleanup` s and ends the process at once
        (exit status 128 + the signal's number, or 1 when the launcher died).
    cleanup: remove what this process owns (its shared-output files) and what dead
        processes owned (:func:`tppc.processes.owned_files.sweep_all`): shared-output files of
        killed ranks, and the launch directory of a dead launcher (a live launcher removes
        its own).

Example (what ``python -m tppc.cli.rank`` does first)::

    guard_rank()            # main thread, before the job starts
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

from tppc.processes.owned_files import LAUNCH_PREFIX, release_all, sweep, sweep_all

__all__ = ["LAUNCHER_EXIT_S", "LAUNCHER_PID_ENV", "LAUNCH_DIR_ENV", "POLL_S", "TORCHRUN_ENV",
           "cleanup", "end_stopped_peers", "guard_rank", "launcher_alive"]

LAUNCHER_PID_ENV = "TPPC_LAUNCHER_PID"
"""Environment variable: the pid of the process that launched this rank."""
TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
"""Environment variable torchrun sets in its ranks."""
LAUNCH_DIR_ENV = "TPPC_LAUNCH_DIR"
"""Environment variable: the launcher's job directory (inputs, outputs, reports, logs)."""
POLL_S = 0.2
"""Seconds between two checks that the launcher is alive."""
LAUNCHER_EXIT_S = 3.0
"""Seconds a rank waits for its dead launcher's last thread to exit (module docstring)."""

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
_guarded = False


def launcher_alive() -> bool:
    """Whether this rank has no launcher named in its environment, or that launcher is
    still its parent and running."""
    pid = os.environ.get(LAUNCHER_PID_ENV)
    return pid is None or _parent_alive(int(pid))


def _parent_alive(pid: int) -> bool:
    """Whether ``pid`` is still this process's parent and running (a parent killed while
    several of its threads run is a zombie for a moment first)."""
    if os.getppid() != pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no /proc: the parent check is all
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def cleanup() -> None:
    """Remove what this process created (module docstring); safe from any thread, twice.

    When the launcher is dead, waits up to :data:`LAUNCHER_EXIT_S` for the kernel to drop
    its lock (the last of its threads to exit does) and removes its directory."""
    release_all()
    sweep_all()
    where = os.environ.get(LAUNCH_DIR_ENV)
    if not where or launcher_alive():
        return
    job = Path(where)
    deadline = time.monotonic() + LAUNCHER_EXIT_S
    while job.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
        sweep(job.parent, LAUNCH_PREFIX)


def end_stopped_peers(wait: float = 2.0) -> list[int]:
    """Under torchrun, kill the ranks of this job that are stopped (SIGSTOP, state ``T`` or
    ``t`` in ``/proc``) and wait up to ``wait`` s for them to die; returns their pids.

    Called by a failing rank before it leaves. A stopped rank runs no thread, so neither its
    watchdog nor its guard thread can act, and torchrun's teardown SIGTERM stays pending in
    it: torchrun waited its whole grace period (30 s) before its SIGKILL. The job's ranks are
    this rank's siblings under torchrun's agent with the same ``TORCHELASTIC_RUN_ID``; their
    files are swept by :func:`cleanup` afterwards (the kernel drops a dead owner's lock).
    ``tppc.launch`` does the same from the launcher. Elsewhere a no-op."""
    run_id = os.environ.get(TORCHRUN_ENV)
    if run_id is None:
        return []
    parent, me, killed = os.getppid(), os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if int(ppid) != parent or state not in ("T", "t"):
                continue
            if f"{TORCHRUN_ENV}={run_id}".encode() not in \
                    (entry / "environ").read_bytes().split(b"\0"):
                continue
            os.kill(int(entry.name), signal.SIGKILL)
            killed.append(int(entry.name))
        except (OSError, ValueError):
            continue
    deadline = time.monotonic() + wait
    while killed and time.monotonic() < deadline and any(_running(p) for p in killed):
        time.sleep(0.05)
    return killed


def _running(pid: int) -> bool:
    """Whether a thread of ``pid`` is still alive. Its leader turns zombie first; its files
    (and their locks) are released when the last of its threads has exited, so every thread
    is checked, not the leader's state alone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                return True
        except OSError:
            continue
    return False


def guard_rank() -> None:
    """Start the guard thread of this rank (module docstring). Call it once, from the main
    thread, before the job starts; a rank whose launcher is already gone leaves at once."""
    global _guarded
    if _guarded:
        return
    _guarded = True
    launcher: int | None = None
    if os.environ.get(LAUNCHER_PID_ENV) is not None:
        launcher = int(os.environ[LAUNCHER_PID_ENV])
        _set_parent_death_signal(signal.SIGTERM)
    elif os.environ.get(TORCHRUN_ENV) is not None:
        launcher = os.getppid()
    if launcher is not None and not _parent_alive(launcher):
        _leave(1, "its launcher is gone")
    read, write = os.pipe()
    os.set_blocking(write, False)
    if threading.current_thread() is threading.main_thread():  # else: no signal handlers
        for sig in _SIGNALS:
            signal.signal(sig, _note)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_guard, args=(read, launcher), name="tppc-rank-exit",
                     daemon=True).start()


def _note(signum: int, frame: object) -> None:
    """The main thread's handler: the guard thread, woken by the same signal, acts."""


def _guard(read: int, launcher: int | None) -> None:
    while True:
        ready, _, _ = select.select([read], [], [], None if launcher is None else POLL_S)
        if ready:
            for number in os.read(read, 64):
                if number in _SIGNALS:
                    _leave(128 + number, f"{signal.Signals(number).name} received")
        if launcher is not None and not _parent_alive(launcher):
            _leave(1, "its launcher died")


def _leave(status: int, why: str) -> None:
    """Clean up, say why on stderr (``os.write``: no lock another thread may hold) and end
    the process with ``status``."""
    try:
        cleanup()
        rank = os.environ.get("RANK", "?")
        os.write(2, f"[tppc.run rank {rank}] stopped: {why}; its files were removed\n"
                 .encode())
    finally:
        os._exit(status)


def _set_parent_death_signal(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the guard thread's poll remains
        pass
