"""Owned files and directories: a sweep removes exactly those whose owner process is dead.

The owners are child processes that create an entry, report it and then either wait (alive)
or are killed with SIGKILL (dead, nothing run at exit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tppc.processes import owned_files

ROOT = Path(__file__).resolve().parents[2]

_OWNER = """
import sys, time
from pathlib import Path
from tppc.processes import owned_files
root = Path(sys.argv[1])
path = (owned_files.create_dir("tppc-test-", root) if sys.argv[2] == "dir"
        else owned_files.create_file(root, "tppc-test-"))
print(path, flush=True)
time.sleep(600)
"""


def _owner(root: Path, kind: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, str(root), kind], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    line = proc.stdout.readline().strip()  # type: ignore[union-attr]
    assert line, "the owner process printed nothing"
    return proc, Path(line)


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_a_live_owners_entry_is_kept_a_dead_owners_is_swept(tmp_path: Path, kind: str) -> None:
    live, kept = _owner(tmp_path, kind)
    dead, gone = _owner(tmp_path, kind)
    try:
        if kind == "dir":
            (gone / "rank0.log").write_text("x")  # content goes with it
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait()
        assert gone.exists()  # a process killed outright removed nothing itself
        assert owned_files.sweep(tmp_path, "tppc-test-") == [gone]
        assert kept.exists() and not gone.exists()
    finally:
        live.kill()
        live.wait()
    assert owned_files.sweep(tmp_path, "tppc-test-") == [kept]
    assert list(tmp_path.iterdir()) == []


def test_own_entries_are_not_swept_and_release_removes_them(tmp_path: Path) -> None:
    path = owned_files.create_file(tmp_path, "tppc-test-")
    folder = owned_files.create_dir("tppc-test-", tmp_path)
    (folder / "out.npz").write_bytes(b"1")
    assert path.name.startswith(f"tppc-test-{os.getpid()}-")
    assert owned_files.sweep(tmp_path, "tppc-test-") == []
    owned_files.release_all()
    owned_files.release_all()  # twice is harmless
    assert list(tmp_path.iterdir()) == []


def test_a_directory_without_its_lock_file_is_left_alone(tmp_path: Path) -> None:
    """(being created, or not tppc's): only an entry whose lock can be taken is swept."""
    (tmp_path / "tppc-test-abc").mkdir()
    (tmp_path / "other").write_text("x")
    assert owned_files.sweep(tmp_path, "tppc-test-") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "tppc-test-abc"]
