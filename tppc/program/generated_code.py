"""The source torch.fx keeps for every generated ``forward``, released with its program.

Terms:
    generated code: each ``GraphModule.recompile()`` compiles its ``forward`` from source
        under a new file name (``<eval_with_key>.N``) and keeps that source, for tracebacks,
        in ``torch.fx.graph_module._loader.eval_cache`` and ``linecache.cache`` (with a copy
        of the code's globals), forever: torch never removes an entry. A pipeline that
        re-plans as call lengths change emits new stage graphs each time, so this grew by
        about 60 KB of source (125 KB of RSS) per re-plan of a 4-block GPT (issue 30).
    release: :func:`emitted` records the entries created while a program is emitted, and
        drops them from both caches when the program is garbage collected (evicted from the
        program cache and no call holding it). The code objects stay valid (they are
        compiled); only the source lines of their tracebacks are gone, and so are those of
        a graph another thread generated during the emission (tracebacks only).
"""

from __future__ import annotations

import linecache
import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

from torch.fx import graph_module

__all__ = ["emitted", "generated_entries"]

T = TypeVar("T")
_PREFIX = "<eval_with_key>."
_guard = threading.Lock()


def generated_entries() -> int:
    """How many generated sources torch.fx holds now (for tests and benchmarks)."""
    return len(graph_module._loader.eval_cache)


def emitted(make: Callable[[], T]) -> T:
    """``make()`` (an emission); the sources generated meanwhile are released when its
    result is garbage collected (module docstring)."""
    loader = graph_module._loader
    first = loader.next_id
    result = make()
    last = loader.next_id
    if last > first:
        weakref.finalize(result, _release, first, last)
    return result


def _release(first: int, last: int) -> None:
    cache = graph_module._loader.eval_cache
    with _guard:
        keys = [k for k in list(cache) if _number(k) in range(first, last)]
        for key in keys:
            cache.pop(key, None)
            linecache.cache.pop(key, None)


def _number(key: str) -> int:
    if not key.startswith(_PREFIX):
        return -1
    digits = key[len(_PREFIX):].split(" ", 1)[0]
    return int(digits) if digits.isdigit() else -1
