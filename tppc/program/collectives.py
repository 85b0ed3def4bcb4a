"""What a collective computes, on any array library (torch tensors, numpy arrays).

Terms:
    values: what one member holds of one job: a tuple (or list) of arrays; a collective
        runs on each position of it (every member holds the same number of arrays).
    ring shift: member ``m`` gets member ``m - 1``'s values (modulo ``n``): a neighbour
        exchange, each member's values cross one link.
    parts: the equal pieces an array is cut into along an axis (``reduce_scatter`` and
        ``all_to_all`` need the axis's size divisible by the group's size).

:func:`combine` is the reference every in-process transport uses (thread workers exchange
their values through shared buffers and each computes the whole group's result in member
order, so every member's result is bit-identical); a process group computes the same with
its own kernels (an all-reduce may add in another order).

Example:
    >>> import numpy as np
    >>> from tppc.program.actions import Action
    >>> act = Action(0, 0, 0, 2, "all_gather", group="g", dims=(0,))
    >>> [v[0].tolist() for v in combine(act, [[np.array([1])], [np.array([2])]], NUMPY)]
    [[1, 2], [1, 2]]
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tppc.errors import ScheduleError
from tppc.program.actions import Action

__all__ = ["NUMPY", "CollectiveOps", "combine", "parts"]


@dataclass(frozen=True)
class CollectiveOps:
    """The array operations a collective needs beyond ``+``.

    Attributes:
        cat: ``cat(arrays, axis)``: the arrays joined along ``axis``.
        split: ``split(array, n, axis)``: ``n`` equal parts along ``axis`` (views).
        copy: ``copy(array)``: a copy (each member owns its result).
    """

    cat: Callable[[Sequence[Any], int], Any]
    split: Callable[[Any, int, int], Sequence[Any]]
    copy: Callable[[Any], Any]


NUMPY = CollectiveOps(cat=lambda arrays, axis: np.concatenate(list(arrays), axis),
                      split=lambda array, n, axis: np.split(array, n, axis),
                      copy=np.copy)
"""The operations on numpy arrays."""


def parts(act: Action, shape: Sequence[int], n: int) -> int:
    """The size of one of ``n`` equal parts of axis ``act.dims[0]`` of ``shape``.

    Raises:
        ScheduleError: the axis does not divide into ``n`` parts (naming the action).
    """
    axis = act.dims[0]
    size = shape[axis]
    if size % n:
        raise ScheduleError(f"{act} cuts axis {axis} of size {size} (shape {tuple(shape)}) "
                            f"into {n} equal parts for the {n} members of group "
                            f"{act.group!r}. fix: a size divisible by the group's size")
    return size // n


def combine(act: Action, inputs: Sequence[Sequence[Any]], ops: CollectiveOps,
            share: bool = False) -> list[tuple[Any, ...]]:
    """Every member's result of collective ``act``, given every member's values (in
    member order); the sums add in member order. ``share``: the members of an
    ``all_reduce``, ``all_gather`` or ``ring_shift`` get the one result array (read-only: the stage graphs
    are functional), not a copy each."""
    n = len(inputs)
    if len({len(v) for v in inputs}) > 1:
        raise ScheduleError(f"{act}: the members hold {[len(v) for v in inputs]} values; "
                            "every member of a collective holds as many")
    out: list[list[Any]] = [[] for _ in range(n)]
    for column in zip(*inputs):
        for m, result in enumerate(_one(act, list(column), ops, share)):
            out[m].append(result)
    return [tuple(values) for values in out]


def _one(act: Action, arrays: list[Any], ops: CollectiveOps, share: bool) -> list[Any]:
    """The members' results for one position of their values."""
    n = len(arrays)
    if act.kind in ("all_reduce", "all_gather"):
        whole = functools.reduce(operator.add, arrays) if act.kind == "all_reduce" \
            else ops.cat(arrays, act.dims[0])
        return [whole, *((whole if share else ops.copy(whole)) for _ in range(n - 1))]
    if act.kind == "reduce_scatter":
        parts(act, arrays[0].shape, n)
        total = functools.reduce(operator.add, arrays)
        return [ops.copy(p) for p in ops.split(total, n, act.dims[0])]
    if act.kind == "all_to_all":
        parts(act, arrays[0].shape, n)
        pieces = [ops.split(a, n, act.dims[0]) for a in arrays]
        return [ops.cat([pieces[src][dst] for src in range(n)], act.dims[1])
                for dst in range(n)]
    if act.kind == "ring_shift":  # member m gets member m - 1's
        return [arrays[(m - 1) % n] if share else ops.copy(arrays[(m - 1) % n])
                for m in range(n)]
    raise ScheduleError(f"{act} is not a collective (kinds: all_reduce, all_gather, "
                        "reduce_scatter, all_to_all, ring_shift)")
