"""The thread transport: one call's workers as threads of one process, joined by queues.

Terms:
    world: what the workers of one call share (:class:`ThreadWorld`): one inbox queue per
        worker and one for the calling thread (``inboxes[-1]``), the stop flag, the errors,
        and one meeting per group for its collectives.
    message: ``(job, values, event)`` on a worker's inbox; ``event`` is what ``ship``
        returned for the receiver's ``land`` (a CUDA event after an asynchronous copy).
    meeting: a group's shared buffers: each member puts its values, the last one to come
        computes every member's result (:func:`tppc.program.collectives.combine`, in member
        order, so the members' results are bit-identical) and each takes its own (the
        members of an all-reduce or all-gather share the one result: the graphs that read
        it are functional).
    feedback: a receive from a later stage (a denoised patch coming back) waits on the
        ``feedback`` hook; the matching send is the hook's owner's (the calling thread's).

Every wait polls the stop flag, so one failed worker stops every other (:class:`Stopped`)
and its error, noted with the action grid, is re-raised by the executor.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from tppc.errors import ScheduleError
from tppc.program.actions import Action
from tppc.program.collectives import CollectiveOps, combine
from tppc.program.dry_run import DryRun
from tppc.program.interpreter import Interpreter, Stopped

__all__ = ["POLL", "ThreadEnd", "ThreadWorld"]

POLL = 0.05
"""Seconds between looks at the stop flag while a thread waits."""

Ship = Callable[[Any], tuple[Any, Any]]
"""``ship(values) -> (values, event)``: before a forward send (a copy to the next device)."""
Land = Callable[[Any], None]
"""``land(event)``: after a forward receive (wait for that copy)."""


class ThreadWorld:
    """The queues, stop flag, errors and meetings of one call (see the module docstring).

    Args:
        dry: the dry run the workers follow (its groups name the meetings).
        depth: messages an inbox holds (0: any).
        ops: the array operations of the collectives (None: lists without collectives).
    """

    def __init__(self, dry: DryRun, depth: int = 0, ops: CollectiveOps | None = None) -> None:
        self.dry, self.ops = dry, ops
        self.inboxes: list[queue.Queue] = [queue.Queue(depth) for _ in range(
            len(dry.actions) + 1)]
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.meetings = {name: _Meeting(members, self) for name, members in dry.groups}

    def get(self, box: queue.Queue, timeout: float | None = None) -> Any:
        """The next item of ``box``; :class:`Stopped` once the stop flag is up.

        Raises:
            queue.Empty: ``timeout`` seconds passed (None: wait as long as it takes).
        """
        waited = 0.0
        while True:
            if self.stop.is_set():
                raise Stopped
            wait = POLL if timeout is None else min(POLL, timeout - waited)
            try:
                return box.get(timeout=max(wait, 0.0))
            except queue.Empty:
                waited += wait
                if timeout is not None and waited >= timeout:
                    raise

    def put(self, box: queue.Queue, item: Any) -> None:
        """Put ``item`` on ``box`` (waiting while it is full); :class:`Stopped` on stop."""
        while True:
            if self.stop.is_set():
                raise Stopped
            try:
                box.put(item, timeout=POLL)
                return
            except queue.Full:
                continue

    def end(self, stage: int, *, ship: Ship | None = None, land: Land | None = None,
            feedback: Callable[[Action], None] | None = None) -> ThreadEnd:
        """Worker ``stage``'s transport."""
        return ThreadEnd(self, stage, ship, land, feedback)

    def work(self, interpreter: Interpreter) -> None:
        """A worker thread's body: its list; an error is kept and stops every worker."""
        try:
            interpreter.run()
        except Stopped:
            return
        except BaseException as exc:  # re-raised by the executor, in the calling thread
            self.errors.append(exc)
            self.stop.set()

    def threads(self, body: Callable[[int], None], name: str) -> list[threading.Thread]:
        """One started daemon thread per worker running ``body(stage)``."""
        threads = [threading.Thread(target=body, args=(s,), name=f"{name}-{s}", daemon=True)
                   for s in range(len(self.dry.actions))]
        for t in threads:
            t.start()
        return threads


class ThreadEnd:
    """One worker's end of a :class:`ThreadWorld` (a :class:`Transport`)."""

    def __init__(self, world: ThreadWorld, stage: int, ship: Ship | None, land: Land | None,
                 feedback: Callable[[Action], None] | None) -> None:
        self.world, self.stage = world, stage
        self.ship, self.land, self.feedback = ship, land, feedback

    def recv(self, act: Action) -> Any:
        if self.world.dry.stage(act.peer) > self.world.dry.stage(self.stage):
            self._feedback(act)
            return None
        job, values, event = self.world.get(self.world.inboxes[self.stage])
        if job != act.job:
            raise ScheduleError(f"stage {self.stage} expected {act}, got job {job}")
        if self.land is not None:
            self.land(event)
        return values

    def send(self, act: Action, values: Any) -> None:
        if self.world.dry.stage(act.peer) < self.world.dry.stage(self.stage):
            self._feedback(act, sending=True)
            return
        values, event = self.ship(values) if self.ship is not None else (values, None)
        self.world.put(self.world.inboxes[act.peer], (act.job, values, event))

    def collective(self, act: Action, values: Any) -> Any:
        return self.world.meetings[act.group].exchange(self.stage, act, values)

    def flush(self) -> None:
        return None

    def failure(self, exc: BaseException, where: Interpreter, k: int) -> BaseException:
        exc.add_note(where.note(k))
        return exc

    def _feedback(self, act: Action, sending: bool = False) -> None:
        if self.feedback is None:
            raise ScheduleError(f"stage {self.stage}: {act} goes back along the pipeline and "
                                "this executor has no feedback (only denoising has)")
        if not sending:  # the send back is the hook owner's (the calling thread steps it)
            self.feedback(act)


class _Meeting:
    """A group's shared buffers (see the module docstring)."""

    def __init__(self, members: Sequence[int], world: ThreadWorld) -> None:
        self.members, self.world = tuple(members), world
        self.cond = threading.Condition()
        self.count: Counter[int] = Counter()  # member -> collectives it has come to
        self.inputs: dict[int, dict[int, Any]] = {}  # n -> {member: values}
        self.outputs: dict[int, list[Any]] = {}  # n -> results in member order
        self.taken: Counter[int] = Counter()

    def exchange(self, stage: int, act: Action, values: Any) -> Any:
        """``stage``'s result of the group's next collective (``act``)."""
        if self.world.ops is None:
            raise ScheduleError(f"{act}: this executor runs no collectives")
        with self.cond:
            n = self.count[stage]
            self.count[stage] = n + 1
            came = self.inputs.setdefault(n, {})
            came[stage] = values
            if len(came) == len(self.members):
                del self.inputs[n]
                self.outputs[n] = combine(act, [came[m] for m in self.members],
                                          self.world.ops, share=True)
                self.cond.notify_all()
            while n not in self.outputs:
                if self.world.stop.is_set():
                    raise Stopped
                self.cond.wait(POLL)
            result = self.outputs[n][self.members.index(stage)]
            self.taken[n] += 1
            if self.taken[n] == len(self.members):
                del self.outputs[n], self.taken[n]
            return result
