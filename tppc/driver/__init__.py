"""The planning glue: front end -> cost table -> planner -> emitted program.

``options`` holds :class:`CompileOptions`; ``planning`` the one path from a captured model to
a :class:`~tppc.planner.Plan`; ``emit`` partitions a chunk graph by a plan into a
:class:`~tppc.program.program.Program`; ``costing`` prices each layer (``tppc.cost_report``).
"""

from __future__ import annotations

__all__: list[str] = []
