"""Executors of the stage graphs: ``torch_local`` (the reference), ``torch_threads``,
``torch_distributed`` (one process per stage, over ``wire``: the one wire format between
ranks) and ``onnxruntime`` (torch-free)."""

from __future__ import annotations

__all__: list[str] = []
