"""Translation validation at compile time: the emitted program against its capture.

``validate`` the check ``tppc.compile`` runs (lengths, tolerance, what it costs); ``replay``
the captured graph and a program run side by side; ``localize`` the first diverging node of a
difference (and a crash).
"""

from __future__ import annotations

__all__: list[str] = []
