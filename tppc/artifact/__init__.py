"""The artifact: a compiled pipeline written as files (``write``), verified and run without
torch (``load``, ``loaded``, ``run``), or run as a torch.distributed job (``distributed``).

The loading half (``load``, ``loaded``, ``run``) imports no torch; keep it that way.
"""

from __future__ import annotations

__all__: list[str] = []
