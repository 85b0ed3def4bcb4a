"""A loaded artifact's outputs: chunks' rows into full-length arrays, then the model's structure.

Imports no torch (:mod:`tppc.artifact.core`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tppc.backends.onnxruntime import span

__all__ = ["Assembler", "Outputs", "unflatten"]


class Outputs(dict):
    """A model's named outputs (what HF's ModelOutput is): ``out.logits``, ``out["logits"]``
    and ``out[0]``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, int):
            return list(self.values())[key]
        return super().__getitem__(key)


class Assembler:
    """Writes each chunk's outputs into full-length outputs (a sink).

    An output's token axis holds ``prefix + scale · length`` positions (its entry's
    ``scale`` and ``prefix``: a DiT's latent rows per patch row); with ``chunks``, chunk
    ``i`` is written at its own rows (:func:`tppc.backends.onnxruntime.span`; the leaves may
    be kept across calls, a denoising step's patches), else chunks arrive in order.
    """

    def __init__(self, outputs: list[dict[str, Any]], length: int,
                 chunks: Sequence[tuple[int, int]] | None = None) -> None:
        self.outputs = outputs
        self.axes = [o["axis"] for o in outputs]
        self.length, self.chunks = length, chunks
        self.leaves: list[Any] = [None] * len(self.axes)
        self.offset = 0

    def __call__(self, index: int, values: list[np.ndarray]) -> None:
        size = 0
        for j, (axis, value) in enumerate(zip(self.axes, values)):
            if axis is None:
                self.leaves[j] = value
                continue
            if self.leaves[j] is None:
                shape = list(value.shape)
                shape[axis] = span(self.outputs[j], 0, self.length)[1]
                self.leaves[j] = np.empty(shape, dtype=value.dtype)
            size = value.shape[axis]
            lo = self.offset if self.chunks is None else \
                span(self.outputs[j], *self.chunks[index])[0]
            target = [slice(None)] * value.ndim
            target[axis] = slice(lo, lo + size)
            self.leaves[j][tuple(target)] = value
        self.offset += size


def unflatten(tree: dict[str, Any], leaves: Any) -> Any:
    kind = tree["type"]
    if kind == "leaf":
        return next(leaves)
    children = [unflatten(c, leaves) for c in tree["children"]]
    if kind == "tuple":
        return tuple(children)
    if kind == "list":
        return children
    if kind == "dict":
        return dict(zip(tree["keys"], children))
    return Outputs(zip(tree["keys"], children))
