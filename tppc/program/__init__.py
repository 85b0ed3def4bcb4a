"""The emitted program as data: stage graphs and wiring, the schedule as per-stage actions,
and the per-call state (K/V buffers, positional values) that executors fill.

``program`` holds :class:`Program`, :class:`StageProgram` and :class:`BufferSpec`;
``actions`` the per-stage action lists and their lowering to sends and receives;
``dry_run`` the check that lowered lists complete without deadlock (and the action grid);
``schedule`` the face of both that every executor and the simulator read (with
``simulate``); ``state`` a call's buffers; ``patches`` PipeFusion's patch rules, one copy
for the torch pipeline and the numpy artifact.
"""

from __future__ import annotations

__all__: list[str] = []
