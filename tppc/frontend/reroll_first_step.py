"""The first step of an unrolled loop, matched op by op to the second (:mod:`.reroll`).

Terms as in :mod:`tppc.frontend.reroll` (step, carry, invariant, position select).

Steps ``t ≥ 1`` are found from the position selects; the first is not always: an op of the
step that reads only the carry (``h * pooled`` in ``h = h * pooled + x[:, t]``) reads only
values made before the loop at ``t = 0`` (``zeros``), so nothing marks it as the loop's.
It is found by matching step 1 backwards from its output and its carries: where step 1
reads a carry (a value step 2 reads from step 1 at the same place), step 0 reads the
carry's initial value; where it reads a position, step 0 reads position 0; everything else
must be the same op with the same arguments. What does not match refuses the loop.
"""

from __future__ import annotations

from typing import Any

from torch import fx

__all__ = ["carry_slots", "first_step"]

Path = tuple[Any, ...]


def _leaves(value: Any, path: Path = ()) -> list[tuple[Path, Any]]:
    """``(path, leaf)`` of nested args (a container's type and length are in the path)."""
    if isinstance(value, list | tuple):
        found = [((*path, type(value).__name__, len(value)), None)]
        for i, v in enumerate(value):
            found += _leaves(v, (*path, i))
        return found
    if isinstance(value, dict):
        found = [((*path, "dict", tuple(sorted(value))), None)]
        for k in sorted(value):
            found += _leaves(value[k], (*path, k))
        return found
    return [(path, value)]


def _reads(node: fx.Node) -> list[tuple[Path, Any]]:
    return _leaves((node.args, node.kwargs))


def carry_slots(template: list[fx.Node], nxt: list[fx.Node]) -> dict[tuple[int, Path], int]:
    """``(i, path) -> j`` where step 2's ``i``-th op reads step 1's ``j``-th at ``path``."""
    index = {n: j for j, n in enumerate(template)}
    slots = {}
    for i, node in enumerate(nxt):
        for path, value in _reads(node):
            if isinstance(value, fx.Node) and value in index:
                slots[i, path] = index[value]
    return slots


def first_step(template: list[fx.Node], nxt: list[fx.Node], outputs: tuple[fx.Node, fx.Node],
               at_zero: dict[fx.Node, list[fx.Node]]
               ) -> tuple[list[fx.Node], dict[int, fx.Node]]:
    """Step 0 aligned with ``template`` (step 1), and carry ``j`` -> its initial value.

    Args:
        template: step 1's ops; ``nxt``: step 2's, aligned with them.
        outputs: the collected outputs of steps 1 and 0.
        at_zero: each position select of step 1 -> the selects of its input at position 0.

    Raises:
        ValueError: step 0 is not step 1's computation on the initial carries (why).
    """
    slots = carry_slots(template, nxt)
    index = {n: i for i, n in enumerate(template)}
    mapped: dict[fx.Node, fx.Node] = {}
    inits: dict[int, fx.Node] = {}

    def unify(tau: fx.Node, u: Any) -> None:
        if tau in mapped:
            if mapped[tau] is not u:
                raise ValueError(f"{tau.name} of step 1 is two values of step 0")
            return
        if not isinstance(u, fx.Node):
            raise ValueError(f"{tau.name} of step 1 is {u!r} in step 0")
        if tau in at_zero:
            if u not in at_zero[tau]:
                raise ValueError(f"{u.name} of step 0 reads no position 0 where step 1 reads "
                                 f"position 1 ({tau.name})")
            mapped[tau] = u
            return
        mine, theirs = _reads(tau), _reads(u)
        if (tau.op, tau.target) != (u.op, u.target) or [p for p, _ in mine] != \
                [p for p, _ in theirs]:
            raise ValueError(f"{u.name} ({u.target}) of step 0 is not {tau.name} "
                             f"({tau.target}) of step 1")
        mapped[tau] = u
        for (path, a), (_, b) in zip(mine, theirs, strict=True):
            if (index[tau], path) in slots:
                j = slots[index[tau], path]
                if not isinstance(b, fx.Node) or inits.setdefault(j, b) is not b:
                    raise ValueError(f"carry {j} starts as two values in step 0")
            elif isinstance(a, fx.Node) and a in index:
                unify(a, b)
            elif a is not b and not (not isinstance(a, fx.Node) and type(a) is type(b)
                                     and a == b):
                raise ValueError(f"{u.name} of step 0 reads {b} where step 1's {tau.name} "
                                 f"reads {a}")

    unify(outputs[0], outputs[1])
    for (i, path), j in slots.items():  # each carry's own computation in step 0
        carried = dict(_reads(template[i]))[path]
        unify(template[j], carried)
    if len(mapped) != len(template):
        missing = [n.name for n in template if n not in mapped]
        raise ValueError(f"step 1's {missing} have no counterpart in step 0")
    first = [mapped[n] for n in template]
    if len(set(first)) != len(first) or set(first) & set(template) \
            or set(inits.values()) & set(first):
        raise ValueError("step 0 and step 1 share ops")
    return first, inits
