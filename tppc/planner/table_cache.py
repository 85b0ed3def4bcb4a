"""The last few results of a pure function of a cost table: :class:`TableCache`.

Terms:
    table key: a cost table's first ``num_stages`` layer rows (by identity), the links
        between them, its length and the stage count. A plan prices several placements,
        device subsets and splits of one table, each a call with the same key.

An entry keeps its table alive, so the ids in its key stay unique while it is cached.

Example:
    >>> cache = TableCache(size=8)
    >>> cache.get(table, 2, (128,), lambda: expensive(table, 2, 128))  # doctest: +SKIP
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from tppc.cost_models.table import CostTable

__all__ = ["TableCache"]

T = TypeVar("T")


class TableCache(Generic[T]):
    """The ``size`` latest results, keyed by the table key and ``extra`` (module docstring).

    Args:
        size: entries kept; the least recently used goes first.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, tuple[CostTable, T]] = OrderedDict()

    def get(self, table: CostTable, num_stages: int, extra: tuple[Hashable, ...],
            compute: Callable[[], T]) -> T:
        """The cached result for ``(table, num_stages, *extra)``, else ``compute()`` cached."""
        key = (tuple(map(id, table.layers[:num_stages])), table.links[: num_stages - 1],
               table.seq_len, num_stages, *extra)
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key][1]
        got = compute()
        self._entries[key] = (table, got)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return got

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()
