"""The ``tppc`` command's arguments checked before any work: numbers, inputs and outputs.

Terms:
    count: an integer option with a least value (``--stages`` ≥ 1, ``--prefix`` ≥ 0); an
        option left out (None) is not checked.
    output file: a path a subcommand writes one file to (``run --output``, ``plan --png``);
        its directory must exist and take a new file, the path must not be a directory, and
        it must never be the command's input. ``run --output`` is written by ``numpy.savez``,
        which appends ``.npz`` to a name without it: the check reads that name.
    output directory: ``export --out``; created with its parents, so the nearest existing
        folder above it must take a new file, and the path itself, where it exists, must be a
        directory.

A failed check raises :class:`tppc.errors.SpecError` (one line: the option, its value and the
fix), which the command prints as ``tppc: error: ...`` and exits with status 2, before the
model is loaded and before anything is written. torch-free: ``tppc run`` needs no torch.

Example:
    >>> check_arguments(argparse.Namespace(command="export", out="art", stages=0, chunks=None))
    Traceback (most recent call last):
    tppc.errors.SpecError: --stages 0 must be an integer >= 1. fix: pass --stages 1 ...
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tppc.errors import SpecError

__all__ = ["check_arguments", "check_count", "check_output_dir", "check_output_file",
           "check_rank_arguments", "degrees_arg", "lengths_arg", "npz_path"]

#: Per subcommand: the integer options (attribute, flag, least value).
COUNTS: dict[str, tuple[tuple[str, str, int], ...]] = {
    "plan": (("seq_len", "--seq-len", 1), ("granularity", "--granularity", 1),
             ("steps", "--steps", 1), ("stages", "--stages", 1)),
    "export": (("stages", "--stages", 1), ("chunks", "--chunks", 1)),
    "run": (("threads", "--threads", 1), ("generate", "--generate", 1)),
    "cost": (("chunk", "--chunk", 1), ("prefix", "--prefix", 0), ("seq_len", "--seq-len", 1),
             ("device_index", "--device-index", 0)),
}


def degrees_arg(text: str) -> int | tuple[int, ...]:
    """``--tensor-parallel``: ``"2"`` → ``2``, ``"2,1"`` → ``(2, 1)`` (argparse names the
    flag when one does not parse; the degrees themselves are checked by the compile
    options)."""
    values = tuple(int(v) for v in text.split(",") if v.strip())
    return values[0] if len(values) == 1 and "," not in text else values


def check_arguments(ns: argparse.Namespace) -> None:
    """Check every number, input and output path of ``ns`` (a parsed ``tppc`` command).

    Raises:
        SpecError: the first bad argument, naming the option, its value and the fix.
    """
    for attr, flag, least in COUNTS.get(ns.command, ()):
        check_count(flag, getattr(ns, attr, None), least)
    if ns.command == "plan":
        limit = ns.time_limit
        if not 0 < limit < math.inf:
            raise SpecError(f"--time-limit {limit} must be a positive number of seconds. "
                            "fix: e.g. --time-limit 10")
        for flag, path in (("--png", ns.png), ("--trace", ns.trace)):
            if path is not None:
                check_output_file(flag, path)
    elif ns.command == "export":
        lengths_arg(ns.lengths)
        check_output_dir("--out", ns.out)
    elif ns.command == "run":
        source = Path(ns.input)
        if not source.is_file():
            raise SpecError(f"--input {ns.input!r} is not a file. fix: pass the .npz of the "
                            "inputs (numpy.savez)")
        check_output_file("--output", ns.output and str(npz_path(ns.output)),
                          source=("--input", source))


#: The rank entry's integer options (``python -m tppc.run``; attribute, flag, least value).
RANK_COUNTS: tuple[tuple[str, str, int], ...] = (
    ("generate", "--generate", 1), ("denoise", "--denoise", 1),
    ("warmup_steps", "--warmup-steps", 1), ("patches", "--patches", 1),
    ("chunks", "--chunks", 1), ("threads", "--threads", 1), ("repeat", "--repeat", 1))


def check_rank_arguments(ns: argparse.Namespace, rank: int | None) -> None:
    """Check the rank entry's numbers, ``--input`` and (on rank 0, which writes it; ``rank``
    None: unknown) ``--output``, before the model or the artifact is loaded.

    Raises:
        SpecError: the first bad argument, naming the option, its value and the fix.
    """
    for attr, flag, least in RANK_COUNTS:
        check_count(flag, getattr(ns, attr, None), least)
    source = None if ns.input is None else Path(ns.input)
    if source is not None and not source.is_file():
        raise SpecError(f"--input {ns.input!r} is not a file. fix: pass the .npz of the "
                        "inputs (numpy.savez), or leave --input out (the factory's examples)")
    if ns.output is not None and rank in (0, None):
        check_output_file("--output", ns.output and str(npz_path(ns.output)),
                          source=None if source is None else ("--input", source))


def check_count(flag: str, value: int | None, least: int) -> None:
    """Refuse an integer option below ``least`` (None: the option was left out)."""
    if value is not None and value < least:
        raise SpecError(f"{flag} {value} must be an integer >= {least}. fix: pass "
                        f"{flag} {max(least, 1)} or more, or leave {flag} out (the default)")


def lengths_arg(values: Sequence[str] | None) -> list[int] | None:
    """``--lengths 128 256`` or ``--lengths 128,256`` as ints (None: left out).

    Raises:
        SpecError: a length that is not an integer >= 1, naming it.
    """
    if not values:
        return None
    out = []
    for text in (v for item in values for v in str(item).split(",") if v):
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise SpecError(f"--lengths contains {text!r}; each length is a number of tokens, "
                            "an integer >= 1. fix: e.g. --lengths 128 256")
        out.append(value)
    return out


def npz_path(name: str) -> Path:
    """The file ``numpy.savez(name, ...)`` writes: ``name`` with ``.npz`` appended unless it
    ends so."""
    return Path(name if name.endswith(".npz") else name + ".npz")


def check_output_file(flag: str, name: str, *, source: tuple[str, Path] | None = None
                      ) -> None:
    """Refuse an output file that cannot be written, or that is the input ``source``
    (``(flag, path)``): never overwrite what the command reads.

    Raises:
        SpecError: an empty name, a directory, the input, a missing or read-only folder.
    """
    if not name:
        raise SpecError(f"{flag} '' is empty. fix: name the file to write")
    path = Path(name)
    if source is not None and (path.resolve() == source[1].resolve()
                               or (path.exists() and path.samefile(source[1]))):
        raise SpecError(f"{flag} '{path}' is the input ({source[0]} '{source[1]}'); it would "
                        f"be overwritten. fix: write the result to another file")
    if path.is_dir():
        raise SpecError(f"{flag} '{path}' is a directory. fix: name a file in it, e.g. "
                        f"{flag} {path / ('out' + (path.suffix or '.npz'))}")
    _check_folder(flag, path, path.parent)


def check_output_dir(flag: str, out: str) -> None:
    """Refuse an output directory that is empty, a file, or cannot be created.

    Raises:
        SpecError: naming the path, why and the fix.
    """
    if not out:
        raise SpecError(f"{flag} '' is empty (it would write into the current directory). "
                        f"fix: name a new directory, e.g. {flag} artifact")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise SpecError(f"{flag} '{out}' is a file, not a directory. fix: name a directory")
    folder = path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    _check_folder(flag, path, folder)


def _check_folder(flag: str, path: Path, folder: Path) -> None:
    """Refuse ``path`` when ``folder`` (the one it is written in) is missing, not a folder or
    takes no new file (tried: an unnamed temporary file, removed at once)."""
    folder = folder if str(folder) else Path(".")
    if not folder.exists():
        raise SpecError(f"{flag} '{path}': its directory '{folder}' does not exist. fix: "
                        f"create it first (mkdir -p {folder}) or write elsewhere")
    if not folder.is_dir():
        raise SpecError(f"{flag} '{path}': '{folder}' is not a directory. fix: write "
                        "elsewhere")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise SpecError(f"{flag} '{path}': its directory '{folder}' is not writable "
                        f"({exc.strerror}). fix: write to a directory you can write to") from exc
