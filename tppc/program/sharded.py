"""The action lists of stages with several workers (tensor parallelism), lowered.

Terms:
    worker ``(s, r)``: rank ``r`` of stage ``s``'s group (``tp<s>``); its list is a flow
        shop over the call's jobs in which each job is received, computed part by part with
        the group's collective between two parts (on the slot's first value: the partial
        sum or the cut value; the rest passes through), and sent on.
    wiring: worker ``r`` of stage ``s`` receives every job from worker ``r mod t(s-1)`` of
        stage ``s - 1`` (every worker of a group holds the same whole boundary values after
        its last collective), so worker ``r`` of stage ``s - 1`` sends to every worker
        ``i`` of stage ``s`` with ``i mod t(s-1) = r`` (none when ``r`` is past stage
        ``s``'s size).

Example:
    >>> rows = sharded_lists(((0, 2),), 1, (0, 1, 1), (1, 2, 2), ((), (("all_reduce", ()),),
    ...                      (("all_reduce", ()),)))
    >>> [[str(a) for a in row] for row in rows]
    [['C0.0', 'S0.0>1', 'S0.0>2'], ['R0.0<0', 'C0.0', 'AR0.0@tp1^1', 'C0.0/1'], \
['R0.0<0', 'C0.0', 'AR0.0@tp1^1', 'C0.0/1']]
"""

from __future__ import annotations

from collections.abc import Sequence

from tppc.program.actions import Action, Actions, Groups

__all__ = ["group_name", "sharded_groups", "sharded_lists"]


def group_name(stage: int) -> str:
    """The name of stage ``stage``'s tensor-parallel group."""
    return f"tp{stage}"


def sharded_groups(stage_of: Sequence[int]) -> Groups:
    """One group per stage of several workers, ``(("tp<s>", workers), ...)``."""
    groups = []
    for s in sorted(set(stage_of)):
        members = tuple(w for w, st in enumerate(stage_of) if st == s)
        if len(members) > 1:
            groups.append((group_name(s), members))
    return tuple(groups)


def sharded_lists(chunks: tuple[tuple[int, int], ...], steps: int, stage_of: Sequence[int],
                  parts: Sequence[int], joins: Sequence[Sequence[tuple[str, tuple[int, ...]]]]
                  ) -> Actions:
    """Every worker's lowered list (see the module docstring).

    Args:
        chunks: the call's chunks.
        steps: pipelined steps (each runs every chunk).
        stage_of: the stage of every worker (workers of a stage in rank order).
        parts: parts per worker.
        joins: the collective after each part but the last, per worker.
    """
    ranks: dict[int, list[int]] = {}
    for w, s in enumerate(stage_of):
        ranks.setdefault(s, []).append(w)
    rows = []
    for w, s in enumerate(stage_of):
        mine, r = ranks[s], ranks[s].index(w)
        prev, nxt = ranks.get(s - 1, []), ranks.get(s + 1, [])
        src = prev[r % len(prev)] if prev else None
        dsts = [v for i, v in enumerate(nxt) if i % len(mine) == r]
        row: list[Action] = []
        for t in range(steps):
            for i, (a, b) in enumerate(chunks):
                if src is not None:
                    row.append(Action(t, i, a, b, "recv", peer=src))
                for p in range(parts[w]):
                    row.append(Action(t, i, a, b, part=p))
                    if p < len(joins[w]):
                        kind, dims = joins[w][p]
                        row.append(Action(t, i, a, b, kind, group=group_name(s),  # type: ignore[arg-type]
                                          dims=dims, first=1))
                row.extend(Action(t, i, a, b, "send", peer=d) for d in dsts)
        rows.append(tuple(row))
    return tuple(rows)
