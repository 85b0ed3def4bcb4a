"""Random action lists with collectives, and an independent reference that runs them.

``random_lists(rng)`` lowers a flow shop of 2-4 stages and inserts, for one or two random
disjoint groups of stages (so the members of a group hold values of one shape), collectives on random jobs at random places after each member computed
that job (the same jobs in the same order on every member): some of these deadlock (a
member waits in a collective for a stage that waits for its send), the others run.

``reference(lists, groups)`` is written apart from ``tppc.program``: it repeatedly does any
head action that can go (a receive whose message was sent, a collective every member has
reached), with the same value semantics as the interpreter (module docstring of
``tppc.program.interpreter``) and collectives written out in numpy. It returns the outputs
per (stage, job), or None when every remaining head waits (a deadlock).

Values are integer-valued float64 arrays with an axis 0 of 576 rows (= 2^6 · 3^2, cut by a
group of 2, 3 or 4 up to three times), so every transport's sums are exact in any order.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import numpy as np

from tppc.program.actions import COLLECTIVES, Action, flow_shop, lower

ROWS = 576


def compute(stage: int, act: Action, got: Any) -> list[np.ndarray]:
    """A job's new values: a function of what it holds (two arrays that reset the shape)."""
    base = sum(float(np.sum(v)) for v in got) % 997 if len(got) else 0.0
    salt = 10.0 * stage + act.step * 5 + act.chunk + 1
    return [np.arange(ROWS * 2, dtype=np.float64).reshape(ROWS, 2) % 7 + base + salt,
            np.full((ROWS, 1), salt, dtype=np.float64)]


def random_lists(rng: random.Random) -> tuple[tuple[tuple[Action, ...], ...],
                                               tuple[tuple[str, tuple[int, ...]], ...]]:
    """Lowered lists with collectives and their groups (see the module docstring)."""
    stages = rng.randint(2, 4)
    chunks = rng.randint(1, 3)
    bounds = tuple((i * 4, i * 4 + 4) for i in range(chunks))
    rows = [list(row) for row in lower(flow_shop(bounds, stages))]
    groups = []
    pool = rng.sample(range(stages), stages)
    cut = rng.randint(1, stages)
    for g, part in enumerate((pool[:cut], pool[cut:])):
        if not part:
            continue
        members = tuple(sorted(part))
        name = f"g{g}"
        groups.append((name, members))
        jobs = sorted(rng.sample(range(chunks), rng.randint(1, chunks)))
        acts = [_collective(rng, name, i, bounds[i]) for i in jobs]
        for s in members:
            row, floor = rows[s], 0
            for act in acts:
                done = next(k for k, a in enumerate(row)
                            if a.kind == "compute" and a.job == act.job)
                at = rng.randint(max(done + 1, floor), len(row))
                row.insert(at, act)
                floor = at + 1
    return tuple(tuple(row) for row in rows), tuple(groups)


def random_worker_lists(rng: random.Random) -> tuple[
        tuple[tuple[Action, ...], ...], tuple[tuple[str, tuple[int, ...]], ...],
        tuple[int, ...]]:
    """Lowered lists of 1-3 stages of 1-3 workers each (a stage's workers form a group, as a
    tensor-parallel stage does): worker ``r`` of stage ``s`` receives each job from worker
    ``r mod w`` of the ``w`` workers of stage ``s - 1``; each worker runs collectives with
    its stage's group on random jobs, right after the compute (before its sends) or later.
    Returns the lists, the groups and the stage of each list."""
    widths = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
    chunks = rng.randint(1, 3)
    bounds = tuple((i * 4, i * 4 + 4) for i in range(chunks))
    first = [sum(widths[:s]) for s in range(len(widths))]
    stages = tuple(s for s, w in enumerate(widths) for _ in range(w))
    groups = tuple((f"s{s}", tuple(range(first[s], first[s] + w)))
                   for s, w in enumerate(widths))
    colls = {s: [_collective(rng, f"s{s}", i, bounds[i])
                 for i in sorted(rng.sample(range(chunks), rng.randint(0, chunks)))]
             for s in range(len(widths))}
    late = rng.random() < 0.5  # collectives after the sends (else right after the compute)
    rows = []
    for s, w in enumerate(widths):
        for r in range(w):
            row = []
            receivers = [first[s + 1] + q for q in range(widths[s + 1])
                         if q % w == r] if s + 1 < len(widths) else []
            for i, (a, b) in enumerate(bounds):
                if s:
                    row.append(Action(0, i, a, b, "recv", first[s - 1] + r % widths[s - 1]))
                row.append(Action(0, i, a, b))
                mine = [c for c in colls[s] if c.chunk == i]
                row += [] if late else mine
                row += [Action(0, i, a, b, "send", q) for q in receivers]
                row += mine if late else []
            rows.append(tuple(row))
    return tuple(rows), groups, stages


def _collective(rng: random.Random, group: str, chunk: int, bounds: tuple[int, int]) -> Action:
    kind = rng.choice(sorted(COLLECTIVES))
    dims = {"all_reduce": (), "all_gather": (1,), "reduce_scatter": (0,),
            "all_to_all": (0, 1), "ring_shift": ()}[kind]
    return Action(0, chunk, *bounds, kind, group=group, dims=dims)


def reference(lists: tuple[tuple[Action, ...], ...],
              groups: tuple[tuple[str, tuple[int, ...]], ...], stages: tuple[int, ...] = ()
              ) -> dict[tuple[int, tuple[int, int]], list[np.ndarray]] | None:
    """The outputs per ``(worker, job)``, or None on a deadlock (see the module docstring);
    ``stages``: each list's stage (empty: list ``w`` is stage ``w``)."""
    members = dict(groups)
    stage = stages or tuple(range(len(lists)))
    pos = [0] * len(lists)
    slots: list[dict] = [{} for _ in lists]
    left = [_uses(row, s, stage) for s, row in enumerate(lists)]
    boxes: dict[tuple[int, int], deque] = {}
    seen = {(g, s): 0 for g, ms in groups for s in ms}  # collectives each member has done
    out: dict[tuple[int, tuple[int, int]], list[np.ndarray]] = {}

    def keep(s: int, job: tuple[int, int], values: list[np.ndarray]) -> None:
        left[s][job] -= 1
        if left[s][job]:
            slots[s][job] = values
        else:
            out[(s, job)] = values

    while any(p < len(row) for p, row in zip(pos, lists)):
        moved = False
        for s, row in enumerate(lists):
            if pos[s] >= len(row):
                continue
            act = row[pos[s]]
            if act.kind == "recv":
                box = boxes.get((act.peer, s))
                if not box:
                    continue
                left[s][act.job] -= 1
                slots[s][act.job] = box.popleft()
            elif act.kind == "send":
                left[s][act.job] -= 1
                values = slots[s][act.job] if left[s][act.job] else slots[s].pop(act.job)
                boxes.setdefault((s, act.peer), deque()).append(values)
            elif act.kind == "compute":
                keep(s, act.job, compute(s, act, slots[s].pop(act.job, [])))
            else:
                group = members[act.group]
                n = seen[(act.group, s)]
                heads = [lists[m][pos[m]] if pos[m] < len(lists[m]) else None for m in group]
                if any(h is None or h.group != act.group or seen[(act.group, m)] != n
                       for h, m in zip(heads, group)):
                    continue
                results = _collect(act, [slots[m][act.job] for m in group])
                for m, result in zip(group, results):
                    seen[(act.group, m)] += 1
                    keep(m, act.job, result)
                    pos[m] += 1
                moved = True
                continue
            pos[s] += 1
            moved = True
        if not moved:
            return None
    return out


def _uses(row: tuple[Action, ...], s: int, stage: tuple[int, ...]) -> dict[tuple[int, int], int]:
    uses: dict[tuple[int, int], int] = {}
    for a in row:
        ahead = a.peer >= 0 and stage[a.peer] > stage[s]
        if a.kind == "compute" or a.collective or (a.kind == "send" and ahead) \
                or (a.kind == "recv" and not ahead):
            uses[a.job] = uses.get(a.job, 0) + 1
    return uses


def _collect(act: Action, inputs: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """Every member's result, written out per kind."""
    n = len(inputs)
    results: list[list[np.ndarray]] = [[] for _ in range(n)]
    for j in range(len(inputs[0])):
        arrays = [values[j] for values in inputs]
        for m in range(n):
            if act.kind == "all_reduce":
                results[m].append(np.sum(arrays, axis=0))
            elif act.kind == "all_gather":
                results[m].append(np.concatenate(arrays, axis=act.dims[0]))
            elif act.kind == "ring_shift":  # the previous member's, around the group
                results[m].append(arrays[(m - 1) % n])
            elif act.kind == "reduce_scatter":
                size = arrays[0].shape[0] // n
                results[m].append(np.sum(arrays, axis=0)[m * size:(m + 1) * size])
            else:  # all_to_all: from every member, its m-th part, side by side
                size = arrays[0].shape[0] // n
                results[m].append(np.concatenate(
                    [a[m * size:(m + 1) * size] for a in arrays], axis=act.dims[1]))
    return results
