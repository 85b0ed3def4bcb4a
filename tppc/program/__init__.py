"""The emitted program as data: stage graphs and wiring, the schedule as per-stage actions,
and the per-call state (K/V buffers, positional values) that executors fill.

``program`` holds :class:`Program`, :class:`StageProgram` and :class:`BufferSpec`;
``schedule`` the actions every executor and the simulator read; ``state`` a call's buffers.
"""

from __future__ import annotations

__all__: list[str] = []
