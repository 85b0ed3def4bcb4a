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
    block padding: a guard (of any kind) on ``Mod(s, k)``, the sequence length modulo a
        constant ``k ≥ 2``: the model pads the sequence to a multiple of ``k``, to reshape it
        into blocks of ``k`` rows (Mamba2's chunked SSD scan, Gated DeltaNet's chunked delta
        rule: ``pad_size = (k - L % k) % k``). Recorded with the first sites outside torch.
    stopping: for a token stream, an export is stopped (:class:`StopExport` raised from the
        log handler) at the first block-padding guard, and at the first pinning guard when
        it is a loop over positions: the first is captured in blocks, the second re-rolled
        from exports at fixed lengths (or refused: :mod:`tppc.frontend.recurrence_refusals`),
        and the rest of the export would take
        minutes (Mamba2: 40 s for one tiny layer on the loaded 2-core machine, 2 s stopped).

Example:
    >>> with guard_sites() as log:                                     # doctest: +SKIP
    ...     torch.export.export(mamba, (ids,), dynamic_shapes=...)
    >>> describe_site(log.sites)                                       # doctest: +SKIP
    ('transformers/models/mamba/modeling_mamba.py:261 in mamba_selective_scan',
     'for index in range(seq_len):')
    >>> log.block, describe_sites(log.block_sites)     # Mamba2, chunk_size=4 # doctest: +SKIP
    (4, ['transformers/models/mamba2/modeling_mamba2.py:69 in reshape_into_chunks '
         '(`return input_tensor.reshape(`)'])
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import re
import traceback
from collections.abc import Iterator

__all__ = ["GuardLog", "StopExport", "describe_site", "describe_sites", "guard_sites",
           "loop_over_positions"]

_LOGGER = "torch.fx.experimental.symbolic_shapes"
_GUARD = re.compile(r"eval (Eq\(.*?) \[guard added\]")
_ANY_GUARD = re.compile(r"eval (.*?) \[guard added\]")
_BLOCK = re.compile(r"Mod\(s\d+, (\d+)\)")
_BLOCK_SITES = 3
"""Distinct block-padding sites kept (the padding, the reshape into blocks, the crop)."""
_LOOP = re.compile(r"^\s*for\s+.+\s+in\s+range\(")
_LIBRARY = ("/torch/", "/tppc/", "/logging/", "/sympy/", "/contextlib.py", "/threading.py")


class StopExport(Exception):
    """Raised inside an export at a guard that decides its refusal, to stop it there."""


class GuardLog(logging.Handler):
    """The guard sites heard while one export runs.

    Attributes:
        sites: ``(file, line, function)`` of every ``Eq`` guard, in order.
        block: the ``k`` of the first block-padding guard (``Mod(s, k)``), or None.
        block_sites: the first distinct sites of block-padding guards.
        range_sites: ``(guard, site)`` of every inequality guard (``s70 + 2 <= 66``: a
            branch on the length, :mod:`tppc.frontend.length_bounds`), in order.
        stop: raise :class:`StopExport` at the first block-padding guard (unless
            ``stop_blocks`` is False: the export with ``L = k × blocks``, where torch still
            logs guards on ``Mod(s, k)`` that hold; there, at any pinning guard on a loop
            over positions), or at the first pinning guard when its site is a loop over
            positions: the rest of such an export
            is minutes of symbolic reasoning about the padded length (or the unrolled loop).
    """

    def __init__(self, stop: bool = False, blocks: bool = True) -> None:
        super().__init__(logging.INFO)
        self.stop_blocks = blocks
        self.sites: list[tuple[str, int, str]] = []
        self.block: int | None = None
        self.block_sites: list[tuple[str, int, str]] = []
        self.range_sites: list[tuple[str, tuple[str, int, str]]] = []
        self.stop = stop

    def emit(self, record: logging.LogRecord) -> None:
        try:
            found = _ANY_GUARD.search(record.getMessage())
        except Exception:  # a record that does not format: not ours to judge
            return
        if not found:
            return
        pinned = _GUARD.match(found.group(0)) is not None
        blocks = [int(k) for k in _BLOCK.findall(found.group(1)) if int(k) >= 2]
        ranged = not (pinned or blocks) and re.search(r"[<>]", found.group(1)) is not None
        if not (pinned or blocks or ranged):
            return
        frames = _user_frames()
        if not frames:
            return
        if ranged:
            self.range_sites.append((found.group(1), frames[0]))
            return
        if pinned:
            self.sites.append(frames[0])
            loop = (len(self.sites) == 1 or not self.stop_blocks) and loop_over_positions(
                linecache.getline(frames[0][0], frames[0][1]))
            if self.stop and loop:
                raise StopExport(f"a loop over positions pins the length: {found.group(1)}")
        if blocks:
            self.block = blocks[0] if self.block is None else self.block
            caller = [f for f in frames[1:2] if f[0] == frames[0][0]]  # the same file's caller
            for site in frames[:1] + caller:
                if site not in self.block_sites and len(self.block_sites) < _BLOCK_SITES:
                    self.block_sites.append(site)
            if self.stop and self.stop_blocks:
                raise StopExport(f"the sequence is padded to a multiple of {self.block}: "
                                   f"{found.group(1)}")


def _user_frames() -> list[tuple[str, int, str]]:
    """The frames of the call stack outside torch, tppc and the standard library, innermost
    first."""
    return [(frame.filename, frame.lineno or 0, frame.name)
            for frame in reversed(traceback.extract_stack())
            if not any(part in frame.filename for part in _LIBRARY)
            and not frame.filename.startswith("<")]


@contextlib.contextmanager
def guard_sites(stop: bool = False, blocks: bool = True) -> Iterator[GuardLog]:
    """Collect the guard sites that pin a size, and those that pad it to blocks, while it
    runs (stopping the run at a refused construct with ``stop``: see :class:`GuardLog`; at a
    loop over positions only, without ``blocks``)."""
    logger, handler = logging.getLogger(_LOGGER), GuardLog(stop, blocks)
    level, propagate, before = logger.level, logger.propagate, logger.getEffectiveLevel()
    others = {h: h.level for h in logger.handlers}
    logger.addHandler(handler)
    if before > logging.INFO:  # heard by us only: torch's own handlers print nothing new
        logger.setLevel(logging.INFO)
        logger.propagate = False
        for other in others:
            other.setLevel(max(other.level, before))
    try:
        yield handler
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


def describe_sites(sites: list[tuple[str, int, str]]) -> list[str]:
    """``"file:line in function (`source line`)"`` for each site."""
    return [f"{_short(path)}:{line} in {function} (`{linecache.getline(path, line).strip()}`)"
            for path, line, function in sites]


def loop_over_positions(source: str) -> bool:
    """Whether a guard site's source line is a Python ``for … in range(…)`` loop."""
    return bool(_LOOP.match(source))


def _short(path: str) -> str:
    """A path from its package on (``transformers/models/…``), as torch's log writes it."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path
