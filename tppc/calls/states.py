"""The call states of one pipeline: a pool per capture, and the last finished call's state.

Terms:
    call state: the K/V buffers and positional values one call fills
        (:class:`tppc.program.state.CallState`); a call takes one for its whole length and
        gives it back when it finishes, so concurrent calls of one pipeline never share one.
    pool: the idle states of one capture (one batch shape: their buffers are shaped for it),
        :class:`tppc.program.state.StatePool`. They belong to the pipeline, never to the
        capture: two pipelines emitted from one capture (``cp.with_plan``) keep their own.
    last call: the state of the last call that finished, with its use count, for
        ``cp.kv_cache()`` (a later call that reused the state makes it stale).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from tppc.program.state import CallState, StatePool

if TYPE_CHECKING:
    from tppc.frontend.front_end import FrontEnd

__all__ = ["CallStates"]


class CallStates:
    """The call states of one pipeline (module docstring); thread-safe.

    Args:
        keep: idle states each pool keeps (``CompileOptions.keep_states``).
        captures: pools kept at most, least recently used first out (one per capture).
    """

    def __init__(self, keep: int, captures: int) -> None:
        self.keep, self.captures = keep, captures
        self._pools: OrderedDict[Any, StatePool] = OrderedDict()
        self._lock = threading.Lock()
        self._last: tuple[CallState, int, FrontEnd] | None = None

    def pool(self, front: FrontEnd) -> StatePool:
        """The pool of ``front``'s capture (made on first use)."""
        with self._lock:
            pool = self._pools.get(front.key)
            if pool is None:
                pool = self._pools[front.key] = StatePool(self.keep)
                while len(self._pools) > self.captures:
                    self._pools.popitem(last=False)
            else:
                self._pools.move_to_end(front.key)
            return pool

    def acquire(self, front: FrontEnd, capacity: int) -> CallState:
        """A state of ``front``'s capture holding ``capacity`` units of the sequence (tokens;
        blocks of ``k`` tokens in a block capture), the caller's until released."""
        return self.pool(front).acquire(capacity)

    def release(self, front: FrontEnd, state: CallState) -> None:
        """Give ``state`` back to its capture's pool."""
        self.pool(front).release(state)

    def finish(self, front: FrontEnd, state: CallState, filled: int) -> None:
        """Record a successful call's state (``filled`` tokens: :attr:`last`) and give it
        back."""
        state.filled = filled
        with self._lock:
            self._last = (state, state.uses, front)
        self.release(front, state)

    @property
    def last(self) -> tuple[CallState, int, FrontEnd] | None:
        """``(state, its use count then, front end)`` of the last finished call, or None."""
        with self._lock:
            return self._last
