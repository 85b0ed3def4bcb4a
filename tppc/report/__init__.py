"""Human-readable views of plans and graphs: layer tables, Gantt timelines, Chrome traces."""

from __future__ import annotations

__all__: list[str] = []
