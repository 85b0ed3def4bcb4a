"""Re-roll a Python loop over positions that torch.export unrolled into one :class:`LoopScan`.

Terms:
    collector: ``stack(outputs, dim)`` of ``n ≥ 2`` values, one per loop step (transformers'
        Mamba: ``torch.stack(scan_outputs, dim=-1)``).
    position select: ``select(X, axis, t)`` of a value ``X`` computed before the loop; a
        *sliced input* is an ``(X, axis)`` selected at every ``t`` in ``0 … n − 1`` exactly
        once among the collector's ancestors.
    loop region: the collector's ancestors that depend on a position select; *invariants*
        are its other ancestors (weights, ``X``, the carries' initial values).
    step ``t``: the region's nodes that output ``t`` depends on and no earlier output does.
    signature: a step written with its reads as ``("l", j)`` (its own ``j``-th node),
        ``("c", j)`` (the previous step's ``j``-th node: a carry), ``("i", node)`` (an
        invariant) and its position selects' index as ``("pos",)``.

A loop is re-rolled only when every step ``t ≥ 1`` has the signature of step 1, step 0 has
it with each carry read replaced by one invariant (the carry's initial value), every output
is the same node of its step, and no value of a step is read after the loop except by the
collector (a final state read afterwards is refused). Anything else keeps the loop unrolled
and the reason is returned (the capture then refuses the model, naming the loop's line):
never a graph that computes something else.

Example:
    >>> loops = reroll_loops(gm, "model.py:12")           # doctest: +SKIP
    >>> [n.target for n in gm.graph.nodes if is_loop_scan(n)]
    [LoopScan(carries=1, xs_dims=(2,), out_dim=2, source='model.py:12')]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from tppc.frontend.reroll_first_step import first_step
from tppc.ir.loop_scan import LoopScan

__all__ = ["RerollError", "reroll_loops"]

_aten = torch.ops.aten
_ASSERTS = (_aten._assert_tensor_metadata.default,)


class RerollError(Exception):
    """The unrolled loop is not a recurrence the re-roller can prove (the reason)."""


def reroll_loops(gm: fx.GraphModule, source: str) -> int:
    """Re-roll every stacked loop of ``gm`` in place; returns how many.

    Raises:
        RerollError: a collector of ``n ≥ 2`` outputs that is no re-rollable loop (why).
    """
    count = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _aten.stack.default \
                and len(node.args[0]) >= 2:
            _reroll(gm, node, source)
            count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _position_groups(nodes: list[fx.Node], n: int
                     ) -> dict[tuple[fx.Node, int], list[list[fx.Node]]]:
    """``(X, axis) -> [selects at 0, …, selects at n − 1]`` for the sliced inputs (a step
    may index a position twice: ``z[:, t]`` written twice)."""
    found: dict[tuple[fx.Node, int], dict[int, list[fx.Node]]] = {}
    for node in nodes:
        if node.target is not _aten.select.int or not isinstance(node.args[0], fx.Node):
            continue
        src, axis, index = node.args[0], node.args[1], node.args[2]
        rank = _rank(src)
        if rank is None or not isinstance(index, int):
            continue
        key = (src, axis % rank)
        size = _size(src, axis % rank)
        index = index % size if size else index
        found.setdefault(key, {}).setdefault(index, []).append(node)
    return {key: [m[i] for i in range(n)] for key, m in found.items()
            if sorted(m) == list(range(n)) and len({len(v) for v in m.values()}) == 1}


def _rank(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else None


def _size(node: fx.Node, axis: int) -> int | None:
    val = node.meta.get("val")
    size = val.shape[axis] if isinstance(val, torch.Tensor) else None
    return size if isinstance(size, int) else None


def _region(nodes: list[fx.Node], groups: dict[tuple[fx.Node, int], list[list[fx.Node]]]
            ) -> tuple[set[fx.Node], dict[tuple[fx.Node, int], list[list[fx.Node]]]]:
    """The loop region and the groups whose input is invariant (computed before the loop)."""
    while True:
        selects = {s for group in groups.values() for at in group for s in at}
        region: set[fx.Node] = set()
        for node in nodes:  # in graph order
            if node in selects or any(a in region for a in node.all_input_nodes):
                region.add(node)
        kept = {key: g for key, g in groups.items() if key[0] not in region}
        if len(kept) == len(groups):
            return region, groups
        groups = kept


def _steps(outputs: list[fx.Node], order: dict[fx.Node, int], region: set[fx.Node]
           ) -> list[list[fx.Node]]:
    seen: set[fx.Node] = set()
    steps = []
    for out in outputs:
        step = sorted((a for a in _ancestors(out) if a in region and a not in seen),
                      key=order.__getitem__)
        seen.update(step)
        steps.append(step)
    return steps


def _signature(step: list[fx.Node], before: list[fx.Node],
               positions: dict[fx.Node, tuple[fx.Node, int]], region: set[fx.Node]
               ) -> list[tuple[Any, ...]]:
    local = {n: j for j, n in enumerate(step)}
    previous = {n: j for j, n in enumerate(before)}

    def enc(value: Any) -> Any:
        if isinstance(value, fx.Node):
            if value in local:
                return ("l", local[value])
            if value in previous:
                return ("c", previous[value])
            if value in region:
                raise RerollError(f"{value.name} of an earlier step is read two steps later")
            return ("i", value)
        if isinstance(value, list | tuple):
            return (type(value).__name__, *(enc(v) for v in value))
        if isinstance(value, dict):
            return ("dict", *((k, enc(v)) for k, v in sorted(value.items())))
        return ("lit", type(value).__name__, value)

    sig = []
    for node in step:
        if node in positions:
            sig.append(("pos", positions[node]))
        else:
            sig.append((node.op, node.target, enc(node.args), enc(node.kwargs)))
    return sig


def _first_difference(step: list[fx.Node], template: list[fx.Node], sig: list[Any],
                      want: list[Any]) -> str:
    """Where a step's signature first differs from the template's (for the message)."""
    if len(sig) != len(want):
        return f" ({len(step)} ops, not {len(template)})"
    for node, mine, theirs in zip(step, sig, want, strict=True):
        if mine != theirs:
            return f": {node.name} ({node.format_node()}) is not {theirs}"
    return ""


def _reroll(gm: fx.GraphModule, collector: fx.Node, source: str) -> None:
    outputs = list(collector.args[0])
    n = len(outputs)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    nodes = sorted(set().union(*(_ancestors(o) for o in outputs)), key=order.__getitem__)
    groups = _position_groups(nodes, n)
    region, groups = _region(nodes, groups)
    if not groups:
        raise RerollError(f"no input is read one position per step (select(x, axis, t) for "
                          f"t = 0 … {n - 1})")
    positions = {s: key for key, g in groups.items() for at in g for s in at}
    steps = _steps(outputs, order, region)
    for t, step in enumerate(steps[1:], start=1):  # step 0: matched to step 1 below
        if outputs[t] not in step:
            raise RerollError(f"output {t} ({outputs[t].name}) reads no position of the loop")
        if {positions[s] for s in step if s in positions} != set(groups) or \
                any(s not in groups[positions[s]][t] for s in step if s in positions):
            raise RerollError(f"step {t} does not read position {t} of every sliced input")
    if n < 3:
        raise RerollError(f"a loop of {n} steps: the re-roller matches steps 1 and 2")
    sigs = {t: _signature(steps[t], steps[t - 1], positions, region) for t in range(2, n)}
    template = sigs[2]
    for t in range(3, n):
        if sigs[t] != template:
            raise RerollError(f"step {t} is not the same computation as step 2"
                              f"{_first_difference(steps[t], steps[2], sigs[t], template)}")
    at_zero = {s: groups[positions[s]][0] for s in steps[1] if s in positions}
    try:
        steps[0], inits = first_step(steps[1], steps[2], (outputs[1], outputs[0]), at_zero)
    except ValueError as exc:
        raise RerollError(f"the first step differs from the others beyond its carries' "
                          f"initial values: {exc}") from exc
    if _signature(steps[1], steps[0], positions, region) != template:
        raise RerollError("step 1 is not the same computation as step 2")
    out_index = steps[1].index(outputs[1])
    if any(steps[t].index(outputs[t]) != out_index for t in range(n)):
        raise RerollError("the collected output is not the same value of every step")
    carries = sorted(inits)
    _check_escapes(steps, carries, collector)
    loop = _loop_node(gm, collector, steps, groups, carries, inits, out_index, source)
    collector.replace_all_uses_with(loop)
    gm.graph.erase_node(collector)
    for step in reversed(steps):
        for node in reversed(step):
            for user in list(node.users):
                if user.target in _ASSERTS:
                    gm.graph.erase_node(user)
            gm.graph.erase_node(node)


def _check_escapes(steps: list[list[fx.Node]], carries: list[int], collector: fx.Node) -> None:
    """Refuse a step value read outside its step, the next step's carry reads and the
    collector (dtype asserts excepted: they are dropped with the steps)."""
    for t, step in enumerate(steps):
        inside = set(step) | (set(steps[t + 1]) if t + 1 < len(steps) else set())
        for j, node in enumerate(step):
            for user in node.users:
                if user in inside or user is collector or user.target in _ASSERTS:
                    continue
                last = " (the final state, read after the loop)" if j in carries else ""
                raise RerollError(f"{node.name} of step {t} is read by {user.name} outside "
                                  f"the loop{last}")


def _loop_node(gm: fx.GraphModule, collector: fx.Node, steps: list[list[fx.Node]],
               groups: dict[tuple[fx.Node, int], list[list[fx.Node]]], carries: list[int],
               inits: dict[int, fx.Node], out_index: int, source: str) -> fx.Node:
    """The step GraphModule (from step 1, reading step 0's carries) and the loop node."""
    first, template = steps[0], steps[1]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for j in carries:
        ph = graph.placeholder(f"carry_{j}")
        ph.meta.update(first[j].meta)
        env[first[j]] = ph
    for (src, _), group in groups.items():
        ph = graph.placeholder(f"rows_{src.name}")
        ph.meta.update(group[1][0].meta)
        env.update(dict.fromkeys(group[1], ph))
    invariants: list[fx.Node] = []

    def read(arg: fx.Node) -> fx.Node:
        if arg not in env:  # an invariant
            ph = graph.placeholder(f"inv_{arg.name}")
            ph.meta.update(arg.meta)
            env[arg] = ph
            invariants.append(arg)
        return env[arg]

    inside = set(template)
    for node in template:
        if node in env:
            continue
        for arg in node.all_input_nodes:
            if arg not in inside:
                read(arg)
    # placeholders must come first: move the body after them
    for node in template:
        if node not in env:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output((*(env[template[j]] for j in carries), env[template[out_index]]))
    step_gm = fx.GraphModule(gm, graph)
    rank = collector.meta["val"].dim()
    loop = LoopScan(step_gm, carries=len(carries), xs_dims=tuple(a for _, a in groups),
                    out_dim=collector.args[1] % rank if len(collector.args) > 1 else 0,
                    source=source)
    args = (*(inits[j] for j in carries), *(src for src, _ in groups), *invariants)
    with gm.graph.inserting_before(collector):
        node = gm.graph.call_function(loop, args)
    node.meta.update(collector.meta)
    return node
