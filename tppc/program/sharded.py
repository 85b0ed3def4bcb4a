"""The action lists of stages with several workers (a mesh of workers per stage), lowered.

Terms:
    worker ``(s, r)``: rank ``r`` of stage ``s``'s mesh (:class:`tppc.program.mesh.Mesh`;
        axes cfg, ring, ulysses, tp, tp fastest); its list is a flow shop over the call's
        jobs in which each job is received, computed part by part with a collective of one
        of its groups between two parts (on the slot's first value: the partial sum or the
        cut value; the rest passes through), and sent on.
    group: the workers of stage ``s`` that differ only in one axis's coordinate
        (:meth:`Mesh.members`); named :func:`group_name`: ``tp<s>`` for the one group of a
        stage that is only tensor-parallel (as before meshes), else ``<axis><s>.<k>`` for
        its ``k``-th group of that axis (:meth:`Mesh.group_index`).
    wiring: boundary values stay cut by cfg, ring and ulysses (every stage has the same
        degrees of those) and are whole across tp (every member of a tp group holds the same
        values after its last collective): worker ``r`` of stage ``s`` receives every job
        from the worker of stage ``s - 1`` with its cfg, ring and ulysses coordinates and tp
        coordinate ``tp mod t(s-1)``; so a worker sends to every worker of stage ``s + 1``
        with its coordinates whose tp coordinate ``i`` has ``i mod t(s) = tp`` (none when its
        tp coordinate is past stage ``s + 1``'s degree).
    feedback (several steps, denoising): the first worker of the last stage sends every job
        of a step but the last back to every worker of stage 0, which receives it before it
        starts that chunk of the next step (as :func:`tppc.program.actions.lower` does).

Example:
    >>> rows = sharded_lists(((0, 2),), 1, (0, 1, 1), (1, 2, 2), ((), (("all_reduce", ()),),
    ...                      (("all_reduce", ()),)))
    >>> [[str(a) for a in row] for row in rows]
    [['C0.0', 'S0.0>1', 'S0.0>2'], ['R0.0<0', 'C0.0', 'AR0.0@tp1^1', 'C0.0/1'], \
['R0.0<0', 'C0.0', 'AR0.0@tp1^1', 'C0.0/1']]
"""

from __future__ import annotations

from collections.abc import Sequence

from tppc.errors import PlanError
from tppc.program.actions import Action, Actions, Groups
from tppc.program.mesh import AXES, Mesh

__all__ = ["JoinSpec", "group_name", "mesh_groups", "sharded_groups", "sharded_lists", "stage_meshes"]

JoinSpec = tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], str]
"""A collective after a part: ``(kind, dims)`` (over the tp group) or ``(kind, dims, axis)``."""


def group_name(stage: int, axis: str = "tp", mesh: Mesh | None = None, rank: int = 0) -> str:
    """The name of ``rank``'s group of ``axis`` on stage ``stage`` (module docstring)."""
    if mesh is None or mesh.size == mesh.tp:
        return f"{axis}{stage}"
    return f"{axis}{stage}.{mesh.group_index(axis, rank)}"


def stage_meshes(stage_of: Sequence[int], meshes: Sequence[Mesh] = ()) -> tuple[Mesh, ...]:
    """Every stage's mesh: ``meshes``, or (empty) one tp group per stage of its workers.

    Raises:
        PlanError: a mesh's size is not its stage's worker count.
    """
    counts = [sum(st == s for st in stage_of) for s in range(max(stage_of, default=-1) + 1)]
    if not meshes:
        return tuple(Mesh(tp=n) for n in counts)
    for s, (mesh, n) in enumerate(zip(meshes, counts, strict=True)):
        if mesh.size != n:
            raise PlanError(f"stage {s} has {n} workers but its mesh {mesh} has {mesh.size}")
    return tuple(meshes)


def mesh_groups(stage_of: Sequence[int], meshes: Sequence[Mesh] = ()) -> Groups:
    """Every group of every stage, ``((name, workers), ...)``: per stage, per axis of degree
    above 1 (in :data:`AXES` order), per group in order; workers are list indices."""
    meshes = stage_meshes(stage_of, meshes)
    first = {s: stage_of.index(s) for s in set(stage_of)}
    groups: list[tuple[str, tuple[int, ...]]] = []
    for s, mesh in enumerate(meshes):
        for axis in AXES:
            if getattr(mesh, axis) == 1:
                continue
            seen: set[str] = set()
            for r in range(mesh.size):
                name = group_name(s, axis, mesh, r)
                if name not in seen:
                    seen.add(name)
                    groups.append((name, tuple(first[s] + m for m in mesh.members(axis, r))))
    return tuple(groups)


def sharded_groups(stage_of: Sequence[int]) -> Groups:
    """One group per stage of several workers, ``(("tp<s>", workers), ...)``."""
    return mesh_groups(stage_of)


def sharded_lists(chunks: tuple[tuple[int, int], ...], steps: int, stage_of: Sequence[int],
                  parts: Sequence[int], joins: Sequence[Sequence[JoinSpec]],
                  meshes: Sequence[Mesh] = (), feedback: Sequence[int] = (0,),
                  later: tuple[Sequence[int], Sequence[Sequence[JoinSpec]]] | None = None
                  ) -> Actions:
    """Every worker's lowered list (see the module docstring).

    Args:
        chunks: the call's chunks.
        steps: pipelined steps (each runs every chunk).
        stage_of: the stage of every worker (workers of a stage in rank order).
        parts: parts per worker.
        joins: the collective after each part but the last, per worker.
        meshes: every stage's mesh (empty: one tp group per stage).
        feedback: the stages whose workers get every job back before the next step's
            (several steps: denoising's stepped patches, :func:`tppc.program.actions.lower`);
            the first worker of the last stage (whose outputs are the model's) sends them.
        later: ``(parts, joins)`` of every worker for the chunks after the first (None:
            ``parts`` and ``joins``): joint attention's later patches.
    """
    meshes = stage_meshes(stage_of, meshes)
    workers: dict[int, list[int]] = {}
    for w, s in enumerate(stage_of):
        workers.setdefault(s, []).append(w)
    last = max(workers, default=0)
    leader = workers[last][0] if workers else 0
    back = [v for s in sorted({f for f in feedback if 0 <= f < last}) for v in workers[s]] \
        if steps > 1 else []
    rows = []
    for w, s in enumerate(stage_of):
        r = workers[s].index(w)
        src, dsts = _wiring(meshes, workers, s, r)
        row: list[Action] = []
        for t in range(steps):
            for i, (a, b) in enumerate(chunks):
                if t and w in back:
                    row.append(Action(t - 1, i, a, b, "recv", peer=leader))
                if src is not None:
                    row.append(Action(t, i, a, b, "recv", peer=src))
                n, mine = (parts[w], joins[w]) if i == 0 or later is None else (
                    later[0][w], later[1][w])
                for p in range(n):
                    row.append(Action(t, i, a, b, part=p))
                    if p < len(mine):
                        kind, dims, *axis = mine[p]
                        group = group_name(s, axis[0] if axis else "tp", meshes[s], r)
                        row.append(Action(t, i, a, b, kind, group=group,  # type: ignore[arg-type]
                                          dims=dims, first=1))
                row.extend(Action(t, i, a, b, "send", peer=d) for d in dsts)
                if w == leader and t + 1 < steps:
                    row.extend(Action(t, i, a, b, "send", peer=v) for v in back)
        rows.append(tuple(row))
    return tuple(rows)


def _wiring(meshes: Sequence[Mesh], workers: dict[int, list[int]], s: int, r: int
            ) -> tuple[int | None, list[int]]:
    """Worker ``(s, r)``'s source on stage ``s - 1`` and destinations on ``s + 1``."""
    mesh, where = meshes[s], meshes[s].coords(r)
    src = None
    if s - 1 in workers:
        prev = meshes[s - 1]
        _same_cut(prev, mesh, s)
        src = workers[s - 1][prev.rank({**where, "tp": where["tp"] % prev.tp})]
    dsts = []
    if s + 1 in workers:
        nxt = meshes[s + 1]
        _same_cut(mesh, nxt, s + 1)
        dsts = [workers[s + 1][nxt.rank({**where, "tp": i})] for i in range(nxt.tp)
                if i % mesh.tp == where["tp"]]
    return src, dsts


def _same_cut(a: Mesh, b: Mesh, s: int) -> None:
    if (a.cfg, a.ring, a.ulysses) != (b.cfg, b.ring, b.ulysses):
        raise PlanError(f"stages {s - 1} and {s} cut the batch and tokens differently "
                        f"({a} and {b}): their boundary values would not line up. fix: one "
                        "cfg_parallel, ring and ulysses for every stage")
