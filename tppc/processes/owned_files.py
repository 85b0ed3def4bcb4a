"""Files and directories a process owns while it lives, and the sweep that removes a dead owner's.

Terms:
    owner lock: the process that creates an owned file holds an exclusive ``flock`` on it (on
        ``.owner`` inside an owned directory) until it releases it; the kernel drops the lock
        when the process dies, however it dies (SIGKILL included). The descriptor is not
        inherited by child processes.
    release: the owner removes the file (the directory with everything in it) and drops the
        lock; :func:`release_all` does so for everything this process still owns (signal
        handlers, from any thread).
    sweep: any process may remove an owned entry whose lock it can take: its owner is dead.
        An entry still locked, not ours to remove, or a directory without ``.owner`` (being
        created) is left alone. Unlike a check of the owner's pid, this survives pid reuse
        and pid namespaces.

Torch-free: a rank's signal handlers import it before torch.

Example:
    >>> path = create_file(Path("/dev/shm"), "tppc-")          # doctest: +SKIP
    >>> sweep(Path("/dev/shm"), "tppc-")                      # another process: nothing
    []
    >>> release(path)
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import tempfile
import threading
from pathlib import Path

__all__ = ["LAUNCH_PREFIX", "LOCK_NAME", "SHM_PREFIX", "SHM_ROOT", "create_dir", "create_file",
           "release", "release_all", "sweep", "sweep_all"]

LOCK_NAME = ".owner"
"""The lock file inside an owned directory."""
SHM_ROOT = Path("/dev/shm")
SHM_PREFIX = "tppc-"
"""Shared-output files: ``/dev/shm/tppc-<pid>-<n>`` (:mod:`tppc.distributed.shared_results`)."""
LAUNCH_PREFIX = "tppc-launch-"
"""Job directories of :func:`tppc.launch`, in the temporary directory."""

_counter = itertools.count()
_owned: dict[Path, int] = {}
"""What this process owns, and the descriptor holding each lock."""
_guard = threading.Lock()


def create_file(root: Path, prefix: str) -> Path:
    """A new empty file ``<root>/<prefix><pid>-<n>``, owned by this process."""
    while True:
        path = root / f"{prefix}{os.getpid()}-{next(_counter)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        if _lock(fd):
            return _own(path, fd)
        os.close(fd)  # a sweep opened it first and removes it: take another name


def create_dir(prefix: str, root: Path | None = None) -> Path:
    """A new directory ``<root>/<prefix>XXXX`` (``root``: the temporary directory), owned by
    this process."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    _lock(fd)  # nobody else can have opened it yet
    return _own(path, fd)


def release(path: Path) -> None:
    """Remove ``path`` (a file, or a directory and its content) and drop its lock."""
    with _guard:
        fd = _owned.pop(path, None)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    if fd is not None:
        os.close(fd)


def release_all() -> None:
    """Remove everything this process still owns (safe from any thread, and twice)."""
    with _guard:
        paths = list(_owned)
    for path in paths:
        release(path)


def sweep(root: Path, prefix: str) -> list[Path]:
    """Remove the entries ``<root>/<prefix>*`` whose owner died; returns what was removed."""
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith(prefix))
    except OSError:
        return []
    removed = []
    for name in names:
        path = root / name
        if path in _owned:
            continue
        is_dir = path.is_dir() and not path.is_symlink()
        try:
            fd = os.open(path / LOCK_NAME if is_dir else path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if not _lock(fd):
                continue
            if is_dir:
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except OSError:  # not ours to remove
            pass
        finally:
            os.close(fd)
    return removed


def sweep_all() -> list[Path]:
    """:func:`sweep` the places tppc creates owned entries in: shared-output files and
    launch directories."""
    return [*sweep(SHM_ROOT, SHM_PREFIX), *sweep(Path(tempfile.gettempdir()), LAUNCH_PREFIX)]


def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _own(path: Path, fd: int) -> Path:
    with _guard:
        _owned[path] = fd
    return path
