"""Executors of the stage graphs: ``torch_local`` (the reference) and ``torch_threads``."""

from __future__ import annotations

__all__: list[str] = []
