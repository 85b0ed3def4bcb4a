"""Capture a model with fewer copies of its repeated block, then re-expand the layer list.

Sound only when every block is the same computation: same class, same parameter and buffer
shapes and dtypes, and no per-layer attention type in the config (``layer_types``). Used by
the planning front end (``capture_front_end(plan_only=True)``: ``tppc.plan``,
``tppc.cost_report``) so that an 80-layer model is exported with 2 blocks (torch.export
dominates planning time); the priced layers are identical, so the plan is the one
``tppc.compile`` makes from the whole model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tppc.ir.records import LayerInfo

__all__ = ["expand_layers", "few_blocks"]


@contextmanager
def few_blocks(model: nn.Module, keep: int = 2) -> Iterator[tuple[str, int] | None]:
    """Temporarily keep only the first ``keep`` blocks; yields (module path, real count)."""
    found = _repeated_list(model)
    if found is None or len(found[2]) <= keep or not _identical(model, found[2]):
        yield None
        return
    path, parent_name, blocks = found
    parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    setattr(parent, parent_name, nn.ModuleList(list(blocks)[:keep]))
    try:
        yield path, len(blocks)
    finally:
        setattr(parent, parent_name, blocks)


def expand_layers(layers: list[LayerInfo], path: str, count: int) -> list[LayerInfo]:
    """Repeat the last captured block up to ``count`` blocks, renaming and renumbering."""
    blocks = [layer for layer in layers if layer.kind == "block"]
    if not blocks or len(blocks) >= count or not blocks[-1].name.startswith(f"{path}."):
        return layers
    template = blocks[-1]
    extra = [_renamed(template, f"{path}.{i}") for i in range(len(blocks), count)]
    at = layers.index(template) + 1
    merged = layers[:at] + extra + layers[at:]
    return [dataclasses.replace(layer, index=i, parts=tuple(
        dataclasses.replace(p, index=i) for p in layer.parts)) for i, layer in enumerate(merged)]


def _renamed(layer: LayerInfo, name: str) -> LayerInfo:
    """``layer`` named ``name``, its parts ``name.<suffix>``."""
    parts = tuple(dataclasses.replace(p, name=name + p.name[len(layer.name):])
                  for p in layer.parts)
    return dataclasses.replace(layer, name=name, parts=parts)


def _repeated_list(model: nn.Module) -> tuple[str, str, nn.ModuleList] | None:
    best: tuple[str, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            if best is None or name.count(".") < best[0].count("."):
                best = (name, name.rpartition(".")[2], module)
    return best


def _identical(model: nn.Module, blocks: nn.ModuleList) -> bool:
    config = getattr(model, "config", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and len(set(layer_types)) > 1:
        return False

    def signature(block: nn.Module) -> tuple:
        tensors = list(block.named_parameters()) + list(block.named_buffers())
        return (type(block), tuple((n, tuple(t.shape), t.dtype) for n, t in tensors),
                tuple(type(m) for m in block.modules()))

    first = signature(blocks[0])
    return all(signature(b) == first for b in blocks) and all(
        isinstance(t, torch.Tensor) for t in blocks[0].parameters())
