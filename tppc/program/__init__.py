"""The emitted program as data: stage graphs and wiring, the schedule as per-stage actions,
THE interpreter every executor runs them through, and the per-call state.

``program`` holds :class:`Program`, :class:`StageProgram` and :class:`BufferSpec`;
``actions`` the per-stage action lists (compute, send, receive, collectives) and their
lowering to sends and receives; ``dry_run`` the check that lowered lists complete without
deadlock, collectives matched across their group (and the action grid); ``schedule`` the
face of both that every executor and the simulator read (with ``simulate``);
``interpreter`` THE interpreter of a worker's list (slots, failure note, deadline) and the
serial transport; ``threads`` the thread transport (queues, shared buffers for
collectives); ``collectives`` what a collective computes on torch or numpy arrays;
``patches`` PipeFusion's patch rules for torch and numpy; ``state`` a call's buffers.
"""

from __future__ import annotations

__all__: list[str] = []
