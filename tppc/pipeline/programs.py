"""The programs a pipeline holds: one per (capture, length), given by its emitter.

Terms:
    program cache: one :class:`tppc.program.program.Program` per (capture key, sequence
        length), least recently used first out (``CompileOptions.program_cache``). A length
        not seen yet gets its program from the emitter (:class:`tppc.driver.emit.Emitter`:
        re-planned when tppc made the plan, refused when it was given).
    admit: what the pipeline does with an emitted program before holding it (the executor's
        check; a rank of a job loads its stage's weights).
    generated code: the source torch.fx keeps for the graphs of an emission is released
        when its program is collected (:mod:`tppc.program.generated_code`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tppc.driver.emit import Emitter
from tppc.program.generated_code import emitted
from tppc.program.program import Program

if TYPE_CHECKING:
    from tppc.frontend.front_end import FrontEnd

__all__ = ["Programs"]


class Programs:
    """The program cache of one pipeline (module docstring); thread-safe.

    Args:
        emitter: the programs of the lengths not held yet.
        admit: applied to every emitted program before it is held.
        keep: programs held at most.
    """

    def __init__(self, emitter: Emitter, admit: Callable[[Program], Program], keep: int
                 ) -> None:
        self._emitter, self._admit, self.keep = emitter, admit, keep
        self._held: OrderedDict[tuple[Any, int], Program] = OrderedDict()
        self._lock = threading.RLock()  # admit may read the pipeline

    @property
    def emitter(self) -> Emitter:
        """The emitter of the programs not held yet."""
        return self._emitter

    def get(self, front: FrontEnd, length: int) -> Program:
        """The program of ``length`` tokens on ``front``'s capture (emitted on first use).

        Raises:
            RuntimeInputError: a length other than a given plan's.
        """
        key = (front.key, length)
        with self._lock:
            if key in self._held:
                self._held.move_to_end(key)
                return self._held[key]
            program = emitted(lambda: self._admit(self._emitter(front, length)))
            self._hold(key, program)
            return program

    def hold(self, front: FrontEnd, program: Program, emitter: Emitter | None = None) -> None:
        """Hold ``program`` (already admitted) for its length on ``front``'s capture; with
        ``emitter``, first drop every program and emit later ones with it (a re-plan)."""
        with self._lock:
            if emitter is not None:
                self._emitter = emitter
                self._held.clear()
            self._hold((front.key, program.plan.seq_len), program)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _hold(self, key: tuple[Any, int], program: Program) -> None:
        self._held[key] = program
        self._held.move_to_end(key)
        while len(self._held) > self.keep:
            self._held.popitem(last=False)
