"""THE interpreter of per-stage action lists: every executor runs its lists through it.

An executor gives the interpreter a stage's lowered list (from the dry run,
:func:`tppc.program.dry_run.check_actions`), a compute function and a transport; the
interpreter does the actions in order. Executors differ only in their transport (thread
queues, torch.distributed point-to-point, ONNX Runtime's thread queues, the denoise
feedback) and their compute (a torch stage graph, an ORT session).

Terms:
    slot: the values of one job on this worker. A forward receive fills it, a compute
        replaces it with its outputs, a collective with its result, a forward send reads
        it; it is dropped after its last use. A job whose last such action on this worker
        is a compute or a collective leaves through ``output`` (the last stage's outputs).
    forward, feedback: a send to a later stage (a receive from an earlier one) carries a
        job's slot along the pipeline; a send to an earlier stage (a receive from a later
        one: a denoised patch going back to the stages that read the latents) carries what
        the transport keeps (the stepped latents), not a slot.
    transport: how values move between workers (:class:`Transport`): ``recv``, ``send``,
        ``collective`` (the whole group's exchange; :mod:`tppc.program.collectives`),
        ``flush`` (wait for sends in flight), ``failure`` (what a failed action raises).
    failure note: an action that raises gets ``[tppc] in <who>, <where in the list>`` and the
        action grid with that action marked (:meth:`DryRun.describe`), unless the transport
        turns the error into its own (a distributed rank records and names the failed stage).
    deadline: checked after every compute; a call past it raises the transport's timeout.

Example:
    >>> from tppc.program.actions import flow_shop
    >>> from tppc.program.dry_run import check_actions
    >>> dry = check_actions(flow_shop(((0, 2), (2, 4)), 2))
    >>> out = []
    >>> run_in_order(dry, lambda s, act, got: (*got, f"s{s}c{act.chunk}"),
    ...              output=lambda s, act, values: out.append(values))
    >>> out
    [('s0c0', 's1c0'), ('s0c1', 's1c1')]
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Protocol

from tppc.program.actions import Action
from tppc.program.collectives import CollectiveOps, combine
from tppc.program.dry_run import DryRun

__all__ = ["Compute", "Deadline", "Interpreter", "Output", "SerialTransport", "Stopped",
           "Transport", "run_in_order"]

Compute = Callable[[Action, Any], Any]
"""``compute(action, received)``: the job's outputs from its slot (``()`` when none came)."""
Output = Callable[[Action, Any], None]
"""``output(action, values)``: a job's values that leave the list (the last stage's)."""


class Stopped(Exception):
    """Raised by a transport when another worker failed: this worker stops quietly."""


class Transport(Protocol):
    """How values move between the workers of one call (see the module docstring)."""

    def recv(self, act: Action) -> Any:
        """A forward receive's values (blocking); a feedback receive: None once it arrived."""
        ...

    def send(self, act: Action, values: Any) -> None:
        """Send ``values`` (a feedback send: None) to ``act.peer``."""
        ...

    def collective(self, act: Action, values: Any) -> Any:
        """This member's result of the group's collective ``act`` on ``values``."""
        ...

    def flush(self) -> None:
        """Wait for the sends in flight (the end of the list)."""
        ...

    def failure(self, exc: BaseException, where: Interpreter, k: int) -> BaseException:
        """What to raise when action ``k`` raised ``exc`` (``exc`` itself, noted, by default)."""
        ...


class Deadline:
    """A call's deadline (``time.monotonic``), checked by the interpreter after computes.

    Args:
        seconds: the call's timeout (None: none).
        late: ``late(stage, act)`` builds the error a compute that ends past it raises.
    """

    def __init__(self, seconds: float | None,
                 late: Callable[[int, Action], BaseException]) -> None:
        self.seconds, self.late = seconds, late
        self.at = None if seconds is None else time.monotonic() + seconds

    def passed(self) -> bool:
        """Whether the deadline has passed."""
        return self.at is not None and time.monotonic() > self.at

    def left(self) -> float | None:
        """Seconds left (never negative; None: no deadline)."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())


class Interpreter:
    """One worker's lowered list (see the module docstring).

    Args:
        dry: the dry run the list comes from (its grid names a failing action).
        stage: the worker (its list is ``dry.actions[stage]``; its stage is
            ``dry.stage(stage)``).
        compute: runs a compute action.
        transport: moves values (None: :meth:`do` is driven by :func:`run_in_order`).
        output: receives the jobs that leave the list.
        who: how the failure note names the worker (``stage 1 (cpu)``).
        deadline: checked after every compute.
        trace: receives ``(stage, chunk, start, end)`` (``time.perf_counter``) per compute.
        before: ``before(k, act)`` runs before action ``k`` (thread counts, fault drills).
    """

    def __init__(self, dry: DryRun, stage: int, compute: Compute, transport: Transport,
                 output: Output, *, who: str = "", deadline: Deadline | None = None,
                 trace: list | None = None,
                 before: Callable[[int, Action], None] | None = None) -> None:
        self.dry, self.stage, self.compute, self.transport = dry, stage, compute, transport
        self.output, self.who = output, who or f"stage {stage}"
        self.deadline, self.trace, self.before = deadline, trace, before
        self.actions = dry.actions[stage]
        self.slots: dict[tuple[int, int], Any] = {}
        self.uses = Counter(a.job for a in self.actions if self._carries(a))
        self.done = 0
        """Computes done so far."""

    def run(self) -> None:
        """Every action in order, then the sends in flight."""
        for k in range(len(self.actions)):
            self.do(k)
        self.finish()

    def finish(self) -> None:
        """Wait for the sends in flight (failures noted like an action's)."""
        self._guard(len(self.actions), self.transport.flush)

    def do(self, k: int) -> None:
        """Action ``k``; a failure is noted (or turned into the transport's error)."""
        self._guard(k, lambda: self._do(k))

    def where(self, k: int) -> str:
        """``<who>, step t, chunk i [a, b), action k (…)``."""
        return f"{self.who}, {self.dry.where(self.stage, k)}"

    def note(self, k: int) -> str:
        """The failure note of action ``k``: where, and the grid with it marked."""
        return f"[tppc] in {self.who}, {self.dry.describe(self.stage, k)}"

    def _guard(self, k: int, step: Callable[[], None]) -> None:
        try:
            step()
        except Stopped:
            raise
        except BaseException as exc:
            new = self.transport.failure(exc, self, k)
            if new is exc:
                raise
            raise new from exc

    def _do(self, k: int) -> None:
        act = self.actions[k]
        if self.before is not None:
            self.before(k, act)
        forward = self.dry.stage(act.peer) > self.dry.stage(self.stage)
        if act.kind == "recv":
            values = self.transport.recv(act)
            if self.dry.stage(act.peer) < self.dry.stage(self.stage):
                self.uses[act.job] -= 1
                self.slots[act.job] = values
        elif act.kind == "send":
            self.transport.send(act, self._use(act) if forward else None)
        elif act.kind == "compute":
            t0 = time.perf_counter()
            values = self.compute(act, self.slots.pop(act.job, ()))
            if self.trace is not None:
                self.trace.append((self.stage, act.chunk, t0, time.perf_counter()))
            self.done += 1
            self._keep(act, values)
            if self.deadline is not None and self.deadline.passed():
                raise self.deadline.late(self.stage, act)
        else:
            values = self._use(act, keep=True)
            if act.first:  # the rest of the slot passes through
                head = self.transport.collective(act, _head(act, values))
                self._keep(act, (*head, *values[act.first:]))
            else:
                self._keep(act, self.transport.collective(act, values))

    def _carries(self, act: Action) -> bool:
        """Whether ``act`` reads or writes its job's slot (a forward send or receive, a
        compute, a collective)."""
        if act.kind in ("send", "recv"):
            ahead = self.dry.stage(act.peer) > self.dry.stage(self.stage)
            return ahead == (act.kind == "send")
        return True

    def _keep(self, act: Action, values: Any) -> None:
        """The slot after a compute or collective; out through ``output`` after its last use."""
        self.uses[act.job] -= 1
        if self.uses[act.job] > 0:
            self.slots[act.job] = values
        else:
            self.output(act, values)

    def _use(self, act: Action, keep: bool = False) -> Any:
        """The slot ``act`` reads (dropped after its last use unless ``keep``)."""
        if not keep:
            self.uses[act.job] -= 1
        if keep or self.uses[act.job] > 0:
            return self.slots[act.job]
        return self.slots.pop(act.job)


class SerialTransport:
    """The transport of :func:`run_in_order`: mailboxes, and collectives that read every
    member's slot at once (every member has reached it when its first member's turn comes).

    Args:
        interpreters: every worker's interpreter (filled by :func:`run_in_order`).
        ops: the array operations of the collectives.
    """

    def __init__(self, ops: CollectiveOps | None = None) -> None:
        self.ops = ops
        self.interpreters: list[Interpreter] = []
        self.boxes: dict[tuple[int, int], deque[Any]] = {}
        self.results: dict[tuple[str, int, int], Any] = {}  # (group, n, member) -> result
        self.count: Counter[tuple[str, int]] = Counter()  # (group, member) -> collectives

    def at(self, stage: int) -> _SerialEnd:
        """The transport as worker ``stage`` sees it."""
        return _SerialEnd(self, stage)


class _SerialEnd:
    """One worker's end of a :class:`SerialTransport`."""

    def __init__(self, world: SerialTransport, stage: int) -> None:
        self.world, self.stage = world, stage

    def recv(self, act: Action) -> Any:
        box = self.world.boxes.get((act.peer, self.stage))
        return box.popleft() if box else None

    def send(self, act: Action, values: Any) -> None:
        if values is not None:
            self.world.boxes.setdefault((self.stage, act.peer), deque()).append(values)

    def collective(self, act: Action, values: Any) -> Any:
        world, members = self.world, self.world.interpreters[self.stage].dry.members(act.group)
        n = world.count[(act.group, self.stage)]
        world.count[(act.group, self.stage)] = n + 1
        if (act.group, n, self.stage) not in world.results:
            if world.ops is None:
                raise TypeError(f"{act} needs array operations: pass ops to run_in_order")
            inputs = [values if m == self.stage else _head(act, world.interpreters[m].slots[
                act.job]) for m in members]
            for m, result in zip(members, combine(act, inputs, world.ops), strict=True):
                world.results[(act.group, n, m)] = result
        return world.results.pop((act.group, n, self.stage))

    def flush(self) -> None:
        return None

    def failure(self, exc: BaseException, where: Interpreter, k: int) -> BaseException:
        exc.add_note(where.note(k))
        return exc


def _head(act: Action, values: Any) -> Any:
    """The values of a slot collective ``act`` runs on (its first ``act.first``; all at 0)."""
    return tuple(values[:act.first]) if act.first else values


def run_in_order(dry: DryRun, compute: Callable[[int, Action, Any], Any], *,
                 output: Callable[[int, Action, Any], None], ops: CollectiveOps | None = None,
                 who: Callable[[int], str] | None = None, deadline: Deadline | None = None,
                 trace: list | None = None) -> None:
    """Every worker's list in the dry run's order, in the calling thread (the serial
    executors): ``compute(stage, act, received)``, ``output(stage, act, values)``."""
    world = SerialTransport(ops)
    for s in range(len(dry.actions)):
        world.interpreters.append(Interpreter(
            dry, s, lambda act, got, s=s: compute(s, act, got), world.at(s),
            lambda act, values, s=s: output(s, act, values),
            who=who(s) if who else "", deadline=deadline, trace=trace))
    for s, k in dry.order:
        world.interpreters[s].do(k)
