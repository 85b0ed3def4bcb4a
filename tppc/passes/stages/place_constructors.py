"""Put the tensors a stage graph makes on the stage's device (device-clean stage graphs).

Terms:
    device argument: the ``device=`` keyword the capture recorded on a node that makes or
        moves a tensor (``aten.arange``, ``aten.zeros``, ``aten.full``, ``aten._to_copy``
        ...): the device of the example the model was captured with (``cpu`` here), so a
        stage placed on ``cuda:1`` would otherwise make its positions and masks on the CPU
        and mix devices.

:func:`place_constructors` rewrites every such argument of a graph and its submodules (the
positional program, hoisted constants) to the stage's device; it transforms, and changes
nothing on the device the graph was captured on.

Example:
    >>> place_constructors(stage_gm, torch.device("cuda", 1))   # doctest: +SKIP
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["place_constructors"]


def place_constructors(gm: fx.GraphModule, device: torch.device) -> int:
    """Rewrite the ``device=`` arguments of ``gm``'s nodes (and its submodules') to
    ``device``; returns how many nodes changed."""
    changed = 0
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        mine = 0
        for node in sub.graph.nodes:
            where = node.kwargs.get("device")
            if where is None or not isinstance(where, torch.device | str):
                continue
            if torch.device(where) != device:
                node.kwargs = {**node.kwargs, "device": device}
                mine += 1
        if mine:
            sub.recompile()
            changed += mine
    return changed
