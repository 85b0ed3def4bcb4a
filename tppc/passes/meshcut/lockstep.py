"""A reference runner of a stage's workers in lockstep: every worker's parts in order, each
join applied over its mesh axis's groups with :func:`tppc.program.collectives.combine`.

Terms:
    feed: what a stage graph's call-fed placeholders get for one chunk, by name (the same
        for every worker); K/V buffers are allocated per worker from its graph's specs.
    lockstep: part ``q`` of every worker, then join ``q`` on every group of its mesh axis,
        then part ``q + 1``. Every worker of a stage has the same joins in the same order
        (the cuts rewrite one graph the same way for every coordinate), which this checks.

The runner is a checker (tests, debugging): the program's executors run the same parts
through their own transports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from tppc.errors import ScheduleError
from tppc.ir.records import CHUNK_INPUT
from tppc.passes.sharding.split_parts import Join, split_parts
from tppc.program.actions import Action
from tppc.program.collectives import CollectiveOps, combine
from tppc.program.mesh import Mesh

__all__ = ["TORCH", "Workers", "run_workers"]

TORCH = CollectiveOps(cat=lambda arrays, axis: torch.cat(list(arrays), axis),
                      split=lambda array, n, axis: torch.tensor_split(array, n, axis),
                      copy=torch.clone)
"""The array operations of collectives on torch tensors."""

Workers = list[tuple[tuple[fx.GraphModule, ...], tuple[Join, ...]]]
"""Every worker's parts and joins (:func:`split_parts` of its worker graph), in rank order."""


def run_workers(graphs: Sequence[fx.GraphModule], mesh: Mesh, feed: Mapping[str, Any],
                boundary: Sequence[Sequence[Any]], buffers: list[dict[str, torch.Tensor]],
                rows: Mapping[str, int]) -> list[tuple[Any, ...]]:
    """Every worker's outputs of one chunk (module docstring).

    Args:
        graphs: the workers' graphs (:func:`tppc.passes.meshcut.worker_graph.worker_graph`).
        mesh: the stage's mesh.
        feed: the call-fed values by placeholder name.
        boundary: each worker's boundary inputs (in order).
        buffers: each worker's K/V buffers by name (allocated here when missing, ``rows``
            long on their token axis, zeros; a ring worker's own block: its part of them).
        rows: the K/V buffers' length on their token axis (of one worker per stage).
    """
    workers: Workers = [split_parts(g) for g in graphs]
    joins = workers[0][1]
    if any(w[1] != joins for w in workers):
        raise ScheduleError("the workers of a stage disagree on their joins: "
                            f"{[w[1] for w in workers]}")
    for gm, mine in zip(graphs, buffers, strict=True):
        for ph in gm.graph.find_nodes(op="placeholder"):
            spec = ph.meta.get(CHUNK_INPUT)
            if spec is not None and spec.kind in ("key", "value") and ph.name not in mine:
                text = spec.prefix + spec.suffix  # a ring worker's own block: 1/parts
                length = text + (rows[ph.name] - text) // spec.parts
                shape = tuple(length if s is None else s for s in spec.shape)
                mine[ph.name] = torch.zeros(shape, dtype=spec.dtype)
    slots: list[tuple[Any, ...]] = [tuple(b) for b in boundary]
    for q in range(len(joins) + 1):
        outs = []
        for (parts, _), slot, mine in zip(workers, slots, buffers, strict=True):
            outs.append(_run(parts[q], slot, feed, mine))
        if q == len(joins):
            return outs
        slots = _join(joins[q], q, mesh, outs)
    raise AssertionError("unreachable")


def _run(part: fx.GraphModule, slot: tuple[Any, ...], feed: Mapping[str, Any],
         buffers: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    args, given = [], iter(slot)
    for ph in part.graph.find_nodes(op="placeholder"):
        spec = ph.meta.get(CHUNK_INPUT)
        if spec is not None and spec.kind in ("key", "value"):
            args.append(buffers[ph.name])
        elif spec is None or spec.kind == "boundary":
            args.append(next(given))
        else:
            args.append(feed[ph.name])
    with torch.no_grad():
        out = part(*args)
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _join(join: Join, q: int, mesh: Mesh, outs: list[tuple[Any, ...]]
          ) -> list[tuple[Any, ...]]:
    """Every worker's next slot: the join's result on the first value, the rest as is."""
    act = Action(0, 0, 0, 0, join.kind, group=join.group, dims=join.dims, part=q)
    slots: list[tuple[Any, ...]] = [()] * len(outs)
    done: set[int] = set()
    for rank in range(len(outs)):
        if rank in done:
            continue
        members = mesh.members(join.group, rank)
        results = combine(act, [outs[m][:join.first] for m in members], TORCH)
        for m, got in zip(members, results, strict=True):
            slots[m] = (*got, *outs[m][join.first:])
            done.add(m)
    return slots
