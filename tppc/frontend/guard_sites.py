"""Where torch.export fixed the sequence length: the model's line, and what it is.

Terms:
    guard site: the model's line that adds a guard ``Eq(…)`` on the sequence symbol ``s``
        that pins it (``eval Eq(s70, 12) [guard added]``, or through a size computation:
        ``Eq(32*s70 + 32*Mod(8 - Mod(s70, 8), 8), 256)``, Mamba2's padding to whole blocks).
        Heard from the ``torch.fx.experimental.symbolic_shapes`` logger at INFO while one
        export runs (exports are serialised, see :mod:`tppc.frontend.isolation`); the line is
        the innermost frame of the call stack outside torch and tppc when the guard is added
        (the log itself names torch's frame when an op adds it).
    loop over positions: a guard site whose line is ``for … in range(…)``: a recurrence
        stepped position by position (transformers' Mamba slow path) or block by block
        (MiniMax's lightning attention) in Python, which torch.export unrolls at the
        example's length.

Example:
    >>> with guard_sites() as sites:                                   # doctest: +SKIP
    ...     torch.export.export(mamba, (ids,), dynamic_shapes=...)
    >>> describe_site(sites)                                           # doctest: +SKIP
    ('transformers/models/mamba/modeling_mamba.py:261 in mamba_selective_scan',
     'for index in range(seq_len):')
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import re
import traceback
from collections.abc import Iterator

__all__ = ["describe_site", "guard_sites", "loop_over_positions"]

_LOGGER = "torch.fx.experimental.symbolic_shapes"
_GUARD = re.compile(r"eval (Eq\(.*?) \[guard added\]")
_LOOP = re.compile(r"^\s*for\s+.+\s+in\s+range\(")
_LIBRARY = ("/torch/", "/tppc/", "/logging/", "/sympy/", "/contextlib.py", "/threading.py")


class _Sites(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.sites: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            found = _GUARD.search(record.getMessage())
        except Exception:  # a record that does not format: not ours to judge
            return
        if not found:
            return
        for frame in reversed(traceback.extract_stack()):
            if not any(part in frame.filename for part in _LIBRARY) \
                    and not frame.filename.startswith("<"):
                self.sites.append((frame.filename, frame.lineno or 0, frame.name))
                return


@contextlib.contextmanager
def guard_sites() -> Iterator[list[tuple[str, int, str]]]:
    """Collect the guard sites ``(file, line, function)`` that pin a size while it runs."""
    logger, handler = logging.getLogger(_LOGGER), _Sites()
    level, propagate, before = logger.level, logger.propagate, logger.getEffectiveLevel()
    others = {h: h.level for h in logger.handlers}
    logger.addHandler(handler)
    if before > logging.INFO:  # heard by us only: torch's own handlers print nothing new
        logger.setLevel(logging.INFO)
        logger.propagate = False
        for other in others:
            other.setLevel(max(other.level, before))
    try:
        yield handler.sites
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
        for other, old in others.items():
            other.setLevel(old)


def describe_site(sites: list[tuple[str, int, str]]) -> tuple[str, str] | None:
    """``("file:line in function", source line)`` of the first guard site, or None."""
    if not sites:
        return None
    path, line, function = sites[0]
    return f"{_short(path)}:{line} in {function}", linecache.getline(path, line).strip()


def loop_over_positions(source: str) -> bool:
    """Whether a guard site's source line is a Python ``for … in range(…)`` loop."""
    return bool(_LOOP.match(source))


def _short(path: str) -> str:
    """A path from its package on (``transformers/models/…``), as torch's log writes it."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path
