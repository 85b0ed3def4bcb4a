"""Where torch.export fixed the sequence length: the model's line, and what it is.

Terms:
    guard site: the ``file:line in function`` torch's shape environment logs when the model
        code adds a guard ``Eq(s, N)`` that pins the sequence symbol ``s`` to the example's
        length ``N`` (``eval Eq(s70, 12) [guard added] (…/modeling_mamba.py:261 in
        mamba_selective_scan)``). Read from the ``torch.fx.experimental.symbolic_shapes``
        logger at INFO while one export runs (exports are serialised, see
        :mod:`tppc.frontend.isolation`).
    loop over positions: a guard site whose line is ``for … in range(…)``: a recurrence
        stepped token by token in Python (transformers' Mamba slow path), which torch.export
        unrolls at the example's length.

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
import sys
from collections.abc import Iterator

__all__ = ["describe_site", "guard_sites", "loop_over_positions"]

_LOGGER = "torch.fx.experimental.symbolic_shapes"
_SITE = re.compile(r"eval Eq\((\w+), (\d+)\) \[guard added\].*?\((\S+?):(\d+) in (\w+)\)")
_LOOP = re.compile(r"^\s*for\s+.+\s+in\s+range\(")


class _Sites(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.sites: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            found = _SITE.search(record.getMessage())
        except Exception:  # a record that does not format: not ours to judge
            return
        if found:
            self.sites.append((found.group(3), int(found.group(4)), found.group(5)))


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
    return f"{path}:{line} in {function}", _source(path, line)


def loop_over_positions(source: str) -> bool:
    """Whether a guard site's source line is a Python ``for … in range(…)`` loop."""
    return bool(_LOOP.match(source))


def _source(path: str, line: int) -> str:
    """The source line, found through the loaded modules (the log gives a relative path)."""
    for module in list(sys.modules.values()):
        filename = getattr(module, "__file__", None) or ""
        if filename.endswith(path):
            return linecache.getline(filename, line).strip()
    return ""
