"""Sizes passed as Python ints: tie the one that counts the token stream's units to its axis.

Terms:
    size ints: integer inputs that give the token grid of a packed latent (QwenImage's
        ``img_shapes=[(frames, rows, cols)]``, LTX's ``num_frames``, ``height``, ``width``);
        the model builds a table from them (a rotary table as long as the image), so with
        the ints kept constant torch.export equates the sequence length to the example's.
    unit int: the first of consecutive size ints whose product is the example's token
        count that is at least 2 (the frames of a video, or the rows of an image: the
        outermost grid axis that varies, so a unit is a contiguous band of tokens). It
        becomes the sequence symbol ``s``; the token axis is ``c * s`` with ``c`` the
        product of the other ints of the grid.

:func:`export_size_ints` exports with the unit int and the token axes as one ``Dim``, then
rewrites the graph so that every use of the unit int reads ``size(tokens) // c`` instead:
the graph then has one sequence symbol (as a capture of tensor inputs), its placeholder for
the int is unused, and a call's unit int is checked against its tokens
(:func:`tppc.frontend.front_end.bind`). The other ints stay constant: a call with another
value is a new batch shape and is captured again (:func:`tppc.frontend.front_end.batch_shape`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

__all__ = ["SIZE_INT", "UnitInt", "check_grid", "dynamic_int_spec", "export_size_ints",
           "find_unit_int", "read_from_tokens"]

SIZE_INT = "tppc.size_int"
"""``node.meta`` key on the placeholder of the unit int: its :class:`UnitInt`."""


@dataclass(frozen=True)
class UnitInt:
    """The size int tied to the sequence symbol.

    Attributes:
        name: its argument name.
        path: its pytree key path inside that argument (``()`` for a bare int).
        value: its example value (the example's units).
        per_unit: tokens per unit (the product of the grid's other ints).
        grid: the grid as passed (``"img_shapes=[(1, 4, 4)]"``), for notes and errors.
        names: the arguments that hold the grid.
        placeholder: the name of its placeholder in the captured graph.
    """

    name: str
    path: tuple[Any, ...]
    value: int
    per_unit: int
    grid: str
    names: tuple[str, ...] = ()
    placeholder: str = ""

    @property
    def note(self) -> str:
        """What the capture took from the ints, for summaries."""
        return (f"the sequence symbol counts the integer input {self.label} of {self.grid} "
                f"({self.per_unit} tokens a unit, read from the token axis); the grid's other "
                "ints are specialised to their values (torch.export keeps Python ints "
                "constant): a call with others is captured again")

    @property
    def label(self) -> str:
        """``img_shapes[0][1]`` or ``height``."""
        return self.name + "".join(f"[{getattr(k, 'idx', getattr(k, 'key', k))}]"
                                   for k in self.path)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def find_unit_int(bound: inspect.BoundArguments, tokens: int) -> UnitInt | None:
    """The unit int of consecutive integer inputs whose product is ``tokens`` (module
    docstring), or None. Consecutive: within one argument (a tuple of ints) or bare int
    arguments one after the other."""
    leaves: list[tuple[str, tuple[Any, ...], int] | None] = []
    for name, value in bound.arguments.items():
        if _is_int(value):
            leaves.append((name, (), value))
            continue
        if not isinstance(value, list | tuple) or not value:
            leaves.append(None)
            continue
        flat, _ = pytree.tree_flatten_with_path(value)
        for path, leaf in flat:
            leaves.append((name, tuple(path), leaf) if _is_int(leaf) else None)
        leaves.append(None)
    for start in range(len(leaves)):
        for stop in range(start + 2, len(leaves) + 1):
            window = leaves[start:stop]
            if any(w is None for w in window):
                break
            values = [w[2] for w in window]  # type: ignore[index]
            if math.prod(values) != tokens:
                continue
            first = next((w for w in window if w[2] >= 2), None)  # type: ignore[index]
            if first is None:
                return None
            name, path, value = first
            names = tuple(dict.fromkeys(w[0] for w in window))  # type: ignore[index]
            grid = ", ".join(f"{n}={bound.arguments[n]!r}" for n in names)
            return UnitInt(name, path, value, tokens // value, grid, names)
    return None


def dynamic_int_spec(value: Any, unit: UnitInt, dim: Any) -> Any:
    """The ``dynamic_shapes`` entry of argument ``unit.name``: ``dim`` at the unit int."""
    if not unit.path:
        return dim
    flat, spec = pytree.tree_flatten_with_path(value)
    return pytree.tree_unflatten([dim if tuple(p) == unit.path else None for p, _ in flat],
                                 spec)


def export_size_ints(export: Callable[[dict[str, Any]], Any], shapes: dict[str, Any],
                     bound: inspect.BoundArguments, unit: UnitInt, token_axes: dict[str, Any]
                     ) -> fx.GraphModule:
    """Export with ``unit`` dynamic and the token axes as ``token_axes`` (input name -> its
    ``dynamic_shapes`` entry, ``Dim.AUTO``: torch.export finds them ``c * unit``):
    ``export(shapes)`` runs the export and returns the runnable GraphModule (then
    :func:`read_from_tokens`)."""
    shapes = dict(shapes)
    shapes.update(token_axes)
    shapes[unit.name] = dynamic_int_spec(bound.arguments[unit.name], unit,
                                         torch.export.Dim.DYNAMIC)
    return export(shapes)


def read_from_tokens(gm: fx.GraphModule, unit: UnitInt, token_axes: dict[str, Any]
                     ) -> UnitInt:
    """Replace every use of the unit int's placeholder (a ``SymInt``) by
    ``size(first token input, axis) // per_unit``; the placeholder stays, unused, with
    :data:`SIZE_INT` in its meta (its value is checked per call, never read). Returns
    ``unit`` with its placeholder's name."""
    placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    units = [n for n in placeholders.values() if isinstance(n.meta.get("val"), torch.SymInt)]
    if len(units) != 1:
        raise ValueError(f"expected one symbolic int input, found {[n.name for n in units]}")
    unit = dataclasses.replace(unit, placeholder=units[0].name)
    source_name, spec = next(iter(token_axes.items()))
    source = placeholders[source_name]
    axis = next(iter(spec))
    last = max(placeholders.values(), key=lambda n: list(gm.graph.nodes).index(n))
    with gm.graph.inserting_after(last):
        size = gm.graph.call_function(torch.ops.aten.sym_size.int, (source, axis))
        size.meta["val"] = source.meta["val"].shape[axis]
    with gm.graph.inserting_after(size):
        rows = gm.graph.call_function(operator.floordiv, (size, unit.per_unit))
        rows.meta["val"] = size.meta["val"] // unit.per_unit
    for node in units:
        node.replace_all_uses_with(rows)
        node.meta["val"] = None
        node.meta[SIZE_INT] = unit
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return unit


def check_grid(unit: UnitInt, bound: inspect.BoundArguments, token_input: str, axis: int
               ) -> None:
    """Refuse a call whose grid ints do not multiply to its tokens (before capturing it
    again): the model would fail on it, torch.export with a size mismatch deep inside.

    Raises:
        ValueError: naming the ints, the tokens and the fix.
    """
    tensor = bound.arguments.get(token_input)
    if not isinstance(tensor, torch.Tensor):
        return
    tokens = int(tensor.shape[axis])
    if find_unit_int(bound, tokens) is None:
        grid = ", ".join(f"{n}={bound.arguments.get(n)!r}" for n in unit.names)
        raise ValueError(
            f"the integer inputs {grid} do not multiply to the {tokens} tokens of "
            f"{token_input!r} (axis {axis}); compiled with {unit.grid} for {unit.value} units "
            f"of {unit.per_unit} tokens. fix: pass the grid of these tokens (the product of "
            "its ints is the token count), or latents of the grid you pass")
