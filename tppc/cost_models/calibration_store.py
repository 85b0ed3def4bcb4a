"""Where CPU and GPU calibrations are kept: the cache of measured rates, and a pinned file.

Terms:
    cache: ``$TPPC_CACHE_DIR`` or ``$XDG_CACHE_HOME/tppc`` or ``~/.cache/tppc``; one JSON
        file per calibration key (device, threads, co-running stages, CPU model, torch).
    pinned calibration: ``$TPPC_CALIBRATION`` names a JSON file (a cached calibration, or a
        ``{"1": {...}, "2": {...}}`` map from ``co_running`` to one) used instead of measuring.
        A map may also hold calibrations measured with ``k > 1`` intra-op threads, keyed
        ``"<co_running>t<k>"`` (``"1t2"``: one worker of 2 threads, the intra-op candidate
        of ``2xcpu``); without such a key, :func:`pinned` refuses ``threads=k`` by name.
    schema: the version of the measured fields; a file of another schema is measured again
        (cache) or refused (pinned).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tppc.errors import SpecError

__all__ = ["SCHEMA", "cache_dir", "pinned", "read_cached", "write_cached"]

SCHEMA = 6
"""3: half_rows, attention_efficiency, nn.Module op overhead, min timer; 4: dispatch;
5: attention efficiency of tppc::chunk_attention (causal, keys visited), weight streaming;
6: thread groups' collectives (``group_*``, co-running calibrations)."""


def cache_dir() -> Path:
    """Directory of tppc's cache (``$TPPC_CACHE_DIR``, else ``$XDG_CACHE_HOME/tppc``)."""
    if os.environ.get("TPPC_CACHE_DIR"):
        return Path(os.environ["TPPC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tppc"


def read_cached(path: Path) -> dict[str, Any] | None:
    """The cached calibration at ``path`` (name, description, measured), or None when it is
    missing, unreadable or of another schema (then it is measured again)."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = data.get("schema") == SCHEMA and isinstance(data.get("measured"), dict)
    return data if ok and "name" in data and "description" in data else None


def write_cached(path: Path, name: str, description: str, measured: dict[str, float]) -> None:
    """Write a calibration to the cache (atomically; a read-only cache is skipped)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"schema": SCHEMA, "name": name, "description": description,
                                   "measured": measured}, indent=2), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # read-only cache dir: the spec is still returned


def pinned(path: str, co_running: int, threads: int = 1) -> dict[str, Any]:
    """The pinned calibration of ``co_running`` stages of ``threads`` intra-op threads each
    in the file ``path`` (``threads > 1``: the key ``"<co_running>t<threads>"``).

    Raises:
        SpecError: the file cannot be read, is of another schema, or pins no calibration of
            ``threads > 1`` threads.
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SpecError(f"TPPC_CALIBRATION={path!r} cannot be read as JSON ({exc}). fix: point "
                        "it at a calibration file (~/.cache/tppc/calibration/*.json) or unset "
                        "it") from exc
    if threads > 1:
        key = f"{co_running}t{threads}"
        if "measured" in data or key not in data:
            raise SpecError(f"TPPC_CALIBRATION={path!r} pins no calibration of {threads} "
                            f"intra-op threads (key {key!r}). fix: add one (tppc.calibrate("
                            f"'cpu', threads={threads}, co_running={co_running}, force=True) "
                            "without the pin, then copy its JSON under that key)")
        data = data[key]
    elif "measured" not in data:  # a map from co_running to calibrations
        counts = [k for k in data if k.isdigit()]
        data = data.get(str(co_running)) or data[max(counts, key=int)]
    if data.get("schema") != SCHEMA:
        raise SpecError(f"TPPC_CALIBRATION={path!r} has schema {data.get('schema')!r}, this tppc "
                        f"reads schema {SCHEMA}. fix: calibrate again (tppc.calibrate('cpu', "
                        "force=True)) and pin the new file")
    return data
