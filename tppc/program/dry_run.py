"""The dry run of per-stage action lists: proof that they complete, or the action that fails.

Terms:
    round: one step of the symbolic run. In each round every stage, last stage first, does
        the receives and sends at the head of its list that can go, at most one compute,
        and the sends and receives after it that can go. A receive waits until its message
        was sent (blocking); a send waits while ``capacity`` messages to that stage are not
        yet received (``None``: never, as ``torch.distributed.pipelining`` simulates).
    rules: a stage receives from the stage before it (and, in ``feedback`` stages, from the
        last stage) and sends to the stage after it (the last stage: back to ``feedback``);
        messages between two stages are received in the order they were sent; a job is
        computed after its input arrived (from the previous stage; for a later step on a
        ``feedback`` stage, the same chunk of the previous step from the last stage), after
        the chunk before it in the same step and after the same chunk of the previous step;
        every stage computes every chunk of every step exactly once; every send is received.
        A collective (:data:`tppc.program.actions.COLLECTIVES`) names a group the stage is
        a member of, comes after the stage computed its job, and goes when every member of
        the group has reached it: the ``n``-th collective of a group is the same action
        (kind, job, axes) on every member, or the lists are refused.
    grid: the lists laid out by round (stages as rows), the actions no round reached in a
        last column, the failing action marked ``[like this]``.

The run is cached per list, so executors call :func:`check_actions` on every call.

Example:
    >>> from tppc.program.actions import flow_shop
    >>> print(check_actions(flow_shop(((0, 4), (4, 8)), 2)).grid())
    stage | 0           | 1           | 2
        0 | C0.0 S0.0>1 | C0.1 S0.1>1 |
        1 |             | R0.0<0 C0.0 | R0.1<0 C0.1
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tppc.errors import ScheduleError
from tppc.program.actions import Action, Actions, Groups, job_count, lower

__all__ = ["DryRun", "check_actions"]


@dataclass(frozen=True)
class DryRun:
    """The lowered lists and when the dry run did each action.

    Attributes:
        actions: the lowered lists (what executors follow).
        rounds: ``rounds[s][k]``: the round of action ``k`` of stage ``s`` (``-1``: never).
        order: ``(stage, k)`` in an order one thread can do them (dependencies first, the
            last stage first within a round, so chunks leave the pipeline early; every
            member of a collective has reached it before its first member's entry).
        groups: the named groups the collectives run over.
        stages: the stage of each list's worker (empty: list ``w`` is stage ``w``).
    """

    actions: Actions
    rounds: tuple[tuple[int, ...], ...]
    order: tuple[tuple[int, int], ...]
    groups: Groups = ()
    stages: tuple[int, ...] = ()

    def stage(self, worker: int) -> int:
        """The stage list ``worker`` belongs to."""
        return self.stages[worker] if self.stages else worker

    def members(self, group: str) -> tuple[int, ...]:
        """The workers of ``group``."""
        return dict(self.groups)[group]

    def computes(self) -> list[tuple[int, Action]]:
        """``(stage, compute action)`` in :attr:`order`."""
        acts = self.actions
        return [(s, acts[s][k]) for s, k in self.order if acts[s][k].kind == "compute"]

    def where(self, stage: int, index: int) -> str:
        """``step t, chunk i [a, b), action k (C0.1, a compute)`` of ``stage``."""
        if index == len(self.actions[stage]) and index:
            return "after its last action (its sends in flight)"
        if not 0 <= index < len(self.actions[stage]):
            return "before its first action"
        act = self.actions[stage][index]
        return (f"step {act.step}, chunk {act.chunk} [{act.start}, {act.end}), action "
                f"{index} ({act}, a {act.kind})")

    def describe(self, stage: int, index: int) -> str:
        """:meth:`where`, and the grid with that action marked."""
        return f"{self.where(stage, index)}:\n{self.grid([(stage, index)])}"

    def grid(self, mark: Iterable[tuple[int, int]] = (), width: int = 8) -> str:
        """The lists by round (stages as rows), ``mark``ed ``(stage, k)`` in brackets, at
        most ``width`` rounds (around the first marked one), then the actions never done."""
        marked = {(s, k) for s, k in mark if 0 <= k < len(self.actions[s])}
        total = 1 + max((r for row in self.rounds for r in row), default=-1)
        focus = min((self.rounds[s][k] for s, k in marked if self.rounds[s][k] >= 0),
                    default=total)
        lo = max(0, min(focus - width // 2, total - width))
        hi = min(total, lo + width)
        cut_left, cut_right = ["…"] if lo > 0 else [], ["…"] if hi < total else []
        never = any(r < 0 for row in self.rounds for r in row)
        table = [["stage", *cut_left, *map(str, range(lo, hi)), *cut_right,
                  *(["not run"] if never else [])]]
        for s, row in enumerate(self.actions):
            def label(k: int, s: int = s, row: tuple[Action, ...] = row) -> str:
                return f"[{row[k]}]" if (s, k) in marked else str(row[k])

            by_round: list[list[str]] = [[] for _ in range(lo, hi)]
            not_run = []
            for k, r in enumerate(self.rounds[s]):
                if lo <= r < hi:
                    by_round[r - lo].append(label(k))
                elif r < 0:
                    not_run.append(k)
            shown = not_run[:4] + [k for k in not_run[4:] if (s, k) in marked]
            rest = " ".join(map(label, shown)) + (" …" if len(shown) < len(not_run) else "")
            table.append([str(s), *cut_left, *map(" ".join, by_round), *cut_right,
                          *([rest] if never else [])])
        widths = [max(map(len, column)) for column in zip(*table)]
        return "\n".join(" | ".join(v.rjust(w) if c == 0 else v.ljust(w)
                                    for c, (v, w) in enumerate(zip(line, widths))).rstrip()
                         for line in table)


def check_actions(actions: Actions, feedback: Sequence[int] = (0,),
                  capacity: int | None = None, groups: Groups = (),
                  stages: Sequence[int] = ()) -> DryRun:
    """Dry-run the lists (compute lists are lowered first, :func:`tppc.program.actions.lower`).

    Args:
        actions: compute or lowered lists, one per stage.
        feedback: stages that get each chunk back from the last stage between steps.
        capacity: messages a send may leave unreceived per pair of stages (None: any).
        groups: ``((name, member stages), ...)`` the collectives run over.
        stages: the stage of each list when a stage has several workers (a tensor- or
            sequence-parallel group): then list indices are workers, a worker receives
            from a worker of the stage before and sends to one of the stage after, and
            the rules above hold per worker (empty: one worker per stage, list ``s`` is
            stage ``s``). Lists of several workers per stage come lowered.

    Returns:
        The lowered lists and the order of the dry run (cached per arguments).

    Raises:
        ScheduleError: a rule of the module docstring is broken; the message names the
            action and prints the grid with it marked.
    """
    return _check(actions, tuple(sorted(set(feedback))), capacity, tuple(groups),
                  tuple(stages))


@functools.lru_cache(maxsize=256)
def _check(actions: Actions, feedback: tuple[int, ...], capacity: int | None,
           groups: Groups, stages: tuple[int, ...]) -> DryRun:
    run = _Replay(lower(actions, feedback) if not stages else actions, feedback, capacity,
                  groups, stages)
    run.play()
    run.finish()
    return run.result()


class _Replay:
    """The state of one dry run (see the module docstring)."""

    def __init__(self, lowered: Actions, feedback: tuple[int, ...], capacity: int | None,
                 groups: Groups = (), stages: tuple[int, ...] = ()) -> None:
        self.acts, self.capacity, self.groups = lowered, capacity, groups
        self.stages = stages
        self.stage = stages or tuple(range(len(lowered)))
        self.members = dict(groups)
        self.together: dict[tuple[str, int], dict[int, int]] = {}  # (group, n) -> {s: k}
        self.count: dict[tuple[str, int], int] = {}  # (group, stage) -> collectives done
        self.last = max(self.stage, default=-1)
        self.steps, self.chunks = job_count(lowered)
        self.back = {r for r in feedback if 0 <= r < self.last} if self.steps > 1 else set()
        self.pos = [0] * len(lowered)
        self.rounds = [[-1] * len(row) for row in lowered]
        self.order: list[tuple[int, int]] = []
        self.computed: list[set[tuple[int, int]]] = [set() for _ in lowered]
        self.parts: dict[tuple[int, tuple[int, int]], int] = {}  # (stage, job) -> next part
        self.got: list[set[tuple[int, int, int]]] = [set() for _ in lowered]
        self.queues: dict[tuple[int, int], deque[tuple[tuple[int, int], int]]] = {}
        self.round = 0

    def result(self) -> DryRun:
        return DryRun(self.acts, tuple(map(tuple, self.rounds)), tuple(self.order),
                      self.groups, self.stages)

    def fail(self, why: str, mark: Iterable[tuple[int, int]] = ()) -> ScheduleError:
        grid = self.result().grid(list(mark))
        return ScheduleError(f"{why}. fix: pass lists that follow the rules of "
                             f"tppc.program.dry_run (or compute lists, which are lowered)\n{grid}")

    def play(self) -> None:
        """Rounds until every list is done; raises on a broken rule or a deadlock."""
        while any(p < len(row) for p, row in zip(self.pos, self.acts)):
            moved = False
            for s in reversed(range(len(self.acts))):
                moved |= self.turn(s)
            if not moved:
                heads = [(s, p) for s, p in enumerate(self.pos) if p < len(self.acts[s])]
                waits = "; ".join(f"stage {s} waits at {self.acts[s][p]} "
                                  f"({self.waiting(s, self.acts[s][p])})" for s, p in heads)
                raise self.fail(f"the schedule deadlocks in round {self.round}: {waits}",
                                heads)
            self.round += 1

    def turn(self, s: int) -> bool:
        """Stage ``s``'s actions in this round; whether it did any."""
        row, did, computed = self.acts[s], False, False
        while self.pos[s] < len(row):
            act = row[self.pos[s]]
            if act.kind == "compute" and computed:
                break
            if not self.ready(s, act):
                break
            self.rounds[s][self.pos[s]] = self.round
            self.order.append((s, self.pos[s]))
            self.pos[s] += 1
            did, computed = True, computed or act.kind == "compute"
        return did

    def ready(self, s: int, act: Action) -> bool:
        """Whether ``act`` can go now; raises when it breaks a rule."""
        here = [(s, self.pos[s])]
        if act.kind == "compute":
            self.check_compute(s, act, here)
            self.computed[s].add(act.job)
            self.parts[(s, act.job)] = act.part + 1
            return True
        if act.collective:
            return self.arrive(s, act, here)
        peer = act.peer
        if not 0 <= peer < len(self.acts):
            raise self.fail(f"stage {s}: {act} names stage {peer}, which has no list", here)
        me, them = self.stage[s], self.stage[peer]
        if act.kind == "send":
            if not (them == me + 1 <= self.last or (me == self.last and them in self.back)):
                raise self.fail(f"stage {s} sends {act} to stage {peer}; a stage sends to "
                                "the next stage only (the last stage: back to the feedback "
                                f"stages {sorted(self.back)})", here)
            if act.job not in self.computed[s]:
                raise self.fail(f"stage {s} sends {act} before computing it", here)
            queue = self.queues.setdefault((s, peer), deque())
            if self.capacity is not None and len(queue) >= self.capacity:
                return False
            queue.append((act.job, self.pos[s]))
            return True
        if not (them == me - 1 >= 0 or (them == self.last and me in self.back)):
            raise self.fail(f"stage {s} receives {act} from stage {peer}; a stage receives "
                            "from the previous stage only (feedback stages also from the "
                            "last)", here)
        queue = self.queues.get((peer, s))
        if not queue:
            return False
        if queue[0][0] != act.job:
            raise self.fail(f"stage {s} receives {act} but the next message from stage "
                            f"{peer} is job {queue[0][0]}: messages between two stages "
                            "arrive in the order they were sent", here)
        queue.popleft()
        self.got[s].add((them, *act.job))
        return True

    def check_compute(self, s: int, act: Action, here: list[tuple[int, int]]) -> None:
        (t, i), done, me = act.job, self.computed[s], self.stage[s]
        why = None
        if act.part or ((s, act.job) in self.parts and act.job in done):
            if self.parts.get((s, act.job), 0) != act.part:  # a stage's parts, in order
                why = (f"stage {s} computes {act} after part "
                       f"{self.parts.get((s, act.job), 0) - 1} of its job")
        elif act.job in done:
            why = f"stage {s} computes {act} twice"
        elif i and (t, i - 1) not in done:
            why = f"stage {s} computes {act} before chunk {i - 1} of step {t}"
        elif t and (t - 1, i) not in done:
            why = f"stage {s} computes {act} before chunk {i} of step {t - 1}"
        elif me and (me - 1, t, i) not in self.got[s]:
            why = f"stage {s} computes {act} before receiving it from stage {me - 1}"
        elif t and me in self.back and (self.last, t - 1, i) not in self.got[s]:
            why = (f"stage {s} computes {act} before receiving chunk {i} of step {t - 1} "
                   f"back from stage {self.last}")
        if why is not None:
            raise self.fail(why, here)

    def arrive(self, s: int, act: Action, here: list[tuple[int, int]]) -> bool:
        """Stage ``s`` has reached collective ``act``; whether every member has."""
        members = self.members.get(act.group)
        if members is None or s not in members:
            known = {g: list(m) for g, m in self.groups}
            raise self.fail(f"stage {s} runs {act} over group {act.group!r}, which "
                            f"{'does not hold it' if members else 'is not named'} "
                            f"(groups: {known})", here)
        if act.job not in self.computed[s]:
            raise self.fail(f"stage {s} runs {act} before computing its job", here)
        n = self.count.get((act.group, s), 0)
        met = self.together.setdefault((act.group, n), {})
        met[s] = self.pos[s]
        for r, k in met.items():
            other = self.acts[r][k]
            if (other.kind, other.job, other.dims, other.first) != (
                    act.kind, act.job, act.dims, act.first):
                raise self.fail(f"collective {n} of group {act.group!r} is {act} on stage "
                                f"{s} but {other} on stage {r}: every member runs the "
                                "group's collectives in the same order", [*here, (r, k)])
        if len(met) < len(members):
            return False
        self.count[(act.group, s)] = n + 1
        return True

    def waiting(self, s: int, act: Action) -> str:
        if act.collective:
            n = self.count.get((act.group, s), 0)
            met = self.together.get((act.group, n), {})
            away = [r for r in self.members[act.group] if r not in met]
            return f"group {act.group!r}: stages {away} have not reached it"
        if act.kind == "send":
            return f"stage {act.peer} has not received the {self.capacity} sent before it"
        return f"no message from stage {act.peer} yet"

    def finish(self) -> None:
        """Every send received; every stage computed every chunk of every step."""
        for (src, _dst), queue in self.queues.items():
            if queue:
                (_job, k), *_ = queue
                raise self.fail(f"stage {src} sends {self.acts[src][k]} that is never "
                                "received", [(src, k)])
        want = {(t, i) for t in range(self.steps) for i in range(self.chunks)}
        for s, done in enumerate(self.computed):
            missing = sorted(want - done)
            if missing:
                t, i = missing[0]
                raise self.fail(f"stage {s} never computes chunk {i} of step {t} (every "
                                f"stage computes all {self.chunks} chunks of all "
                                f"{self.steps} steps once; {len(missing)} missing)")
