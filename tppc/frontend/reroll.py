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

import torch
from torch import fx

from tppc.frontend.reroll_steps import (
    Canonical,
    RerollError,
    first_difference,
    initial_carries,
    live_ops,
    signature,
)
from tppc.frontend.scatter_chains import rank_of, stack_scatter_chains, static_size
from tppc.ir.loop_scan import LoopScan
from tppc.passes.shapes import ancestors

__all__ = ["RerollError", "loop_block", "reroll_loops"]

_aten = torch.ops.aten
_ASSERTS = (_aten._assert_tensor_metadata.default,)
_FILL = {_aten.zeros_like.default: 0, _aten.ones_like.default: 1, _aten.empty_like.default: 0,
         _aten.full_like.default: None, _aten.new_zeros.default: 0, _aten.new_ones.default: 1,
         _aten.new_empty.default: 0, _aten.new_full.default: None}
"""Ops that read only their input's shape, dtype and device, and the value they fill with
(None: their argument)."""


def reroll_loops(gm: fx.GraphModule, source: str) -> int:
    """Re-roll every loop of ``gm`` in place; returns how many.

    Every ``stack``, and every ``cat`` of equal blocks, is a candidate collector; one that
    reads no position of any input per step is no loop and is left alone.

    Raises:
        RerollError: no loop was re-rolled and a candidate that reads positions is no
            re-rollable loop (why).
    """
    for node in list(gm.graph.nodes):  # dtype asserts would keep dead values alive
        if node.target in _ASSERTS:
            gm.graph.erase_node(node)
    _creations_of_rows(gm)
    gm.graph.eliminate_dead_code()  # a final carry no one reads (the graph may keep it)
    stack_scatter_chains(gm)
    count, errors = 0, []
    for node in list(gm.graph.nodes):
        block = _collector_block(node)
        if block is None:
            continue
        try:
            count += _reroll(gm, node, source, block)
        except RerollError as exc:
            errors.append(exc)
    if not count and errors:
        raise errors[0]
    if count:
        gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return count


def loop_block(gm: fx.GraphModule) -> int | None:
    """The rows per step of the first loop in ``gm`` (of two steps or more), or None: 1 for a
    loop over positions, ``b`` for a loop over blocks of ``b`` rows."""
    stack_scatter_chains(gm)
    for node in gm.graph.nodes:
        block = _collector_block(node, least=2)
        if block is None:
            continue
        outputs = list(node.args[0])
        nodes = ancestors(outputs)
        if _position_groups(list(nodes), len(outputs), block):
            return block
    return None


def _collector_block(node: fx.Node, least: int = 3) -> int | None:
    """The rows each output adds: 1 for ``stack`` of ≥ ``least`` values, ``b`` for ``cat``
    of ≥ ``least`` values of ``b`` rows each along its axis, else None."""
    if node.op != "call_function" or node.target not in (_aten.stack.default,
                                                         _aten.cat.default):
        return None
    values = node.args[0]
    if len(values) < least or not all(isinstance(v, fx.Node) for v in values):
        return None
    if node.target is _aten.stack.default:
        return 1
    dim = node.args[1] if len(node.args) > 1 else 0
    sizes = {static_size(v, dim % max(rank_of(v) or 1, 1)) for v in values}
    size = sizes.pop() if len(sizes) == 1 else None
    return size if isinstance(size, int) and size >= 1 else None


def _position_groups(nodes: list[fx.Node], n: int, block: int
                     ) -> dict[tuple[fx.Node, int], list[list[fx.Node]]]:
    """``(X, axis) -> [selects at 0, …, selects at n − 1]`` for the sliced inputs (a step
    may index a position twice: ``z[:, t]`` written twice); with blocks of ``b > 1`` rows,
    the slices ``X[..., t·b:(t+1)·b]``."""
    found: dict[tuple[fx.Node, int], dict[int, list[fx.Node]]] = {}
    for node in nodes:
        at = _position(node, block)
        if at is not None:
            found.setdefault(at[0], {}).setdefault(at[1], []).append(node)
    return {key: [m[i] for i in range(len(m))] for key, m in found.items()
            if 2 <= len(m) <= n and sorted(m) == list(range(len(m)))
            and len({len(v) for v in m.values()}) == 1}  # the last steps may not read one


def _creations_of_rows(gm: fx.GraphModule) -> None:
    """A value made like a row (RWKV's initial state ``torch.zeros_like(key[:, 0])``) is
    made from its shape alone (``full``): the row is no position the loop reads, and no
    read of the token axis before the first chunk."""
    for node in list(gm.graph.nodes):
        src = node.args[0] if node.op == "call_function" and node.target in _FILL else None
        val = node.meta.get("val")
        if not isinstance(src, fx.Node) or src.target not in (_aten.select.int,
                                                              _aten.slice.Tensor) \
                or not isinstance(val, torch.Tensor) \
                or not all(isinstance(d, int) for d in val.shape):
            continue
        fill = _FILL[node.target]
        if fill is None:  # full_like(x, value) / new_full(x, size, value)
            fill = node.args[2 if node.target is _aten.new_full.default else 1]
        with gm.graph.inserting_before(node):
            made = gm.graph.call_function(_aten.full.default, (list(val.shape), fill),
                                          {"dtype": val.dtype, "device": val.device})
        made.meta.update(node.meta)
        node.replace_all_uses_with(made)
        gm.graph.erase_node(node)


def _position(node: fx.Node, block: int) -> tuple[tuple[fx.Node, int], int] | None:
    """``((X, axis), t)`` of a select at ``t`` (``block == 1``) or a slice of the ``t``-th
    block of ``block`` rows, else None."""
    want = _aten.select.int if block == 1 else _aten.slice.Tensor
    if node.target is not want or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    rank = rank_of(src)
    axis = node.args[1] if len(node.args) > 1 else 0
    if rank is None or not isinstance(axis, int):
        return None
    size = static_size(src, axis % rank)
    if block == 1:
        index = node.args[2]
        if not isinstance(index, int):
            return None
        return (src, axis % rank), (index % size if size else index)
    start, end = [*node.args[2:4], None, None][:2]
    step = node.args[4] if len(node.args) > 4 else 1
    if not (isinstance(start, int) and isinstance(end, int) and step == 1) or start < 0 \
            or start % block or min(end, size or end) - start != block:
        return None
    return (src, axis % rank), start // block


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


def _steps(n: int, order: dict[fx.Node, int], region: set[fx.Node],
           positions: dict[fx.Node, tuple[tuple[fx.Node, int], int]]) -> list[list[fx.Node]]:
    """Each region node in the step of the latest position it reads (as soon as its inputs
    are there: an op on the carry alone ends the step before), in graph order."""
    step: dict[fx.Node, int] = {}
    for node in sorted(region, key=order.__getitem__):
        if node in positions:
            step[node] = positions[node][1]
        else:
            step[node] = max(step[a] for a in node.all_input_nodes if a in region)
    steps: list[list[fx.Node]] = [[] for _ in range(n)]
    for node in sorted(region, key=order.__getitem__):
        steps[step[node]].append(node)
    return steps


def _reroll(gm: fx.GraphModule, collector: fx.Node, source: str, block: int) -> int:
    """Re-roll the loop ``collector`` collects; 0 when it reads no position per step."""
    outputs = list(collector.args[0])
    n = len(outputs)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    nodes = sorted(ancestors(outputs), key=order.__getitem__)
    groups = _position_groups(nodes, n, block)
    region, groups = _region(nodes, groups)
    if not groups:
        return 0  # no loop: a stack or cat of values read from no position per step
    positions = {s: (key, t) for key, g in groups.items() for t, at in enumerate(g)
                 for s in at}
    steps = _steps(n, order, region, positions)
    for t, step in enumerate(steps):
        if outputs[t] not in step:
            raise RerollError(f"output {t} ({outputs[t].name}) reads no position of the loop")
    canonical = Canonical(region)
    keys = {s: k for s, (k, _) in positions.items()}
    template = signature(steps[1], steps[0], keys, region, canonical)
    if len(steps[0]) != len(steps[1]):
        raise RerollError(f"the first step has {len(steps[0])} ops and the second "
                          f"{len(steps[1])} (a first step unlike the others, or a loop of {n} "
                          "steps too short to show a whole one)")
    live = live_ops(steps[1], outputs[1], template, n)
    for t in range(2, n):
        at = (live[n - 1 - t], live[n - t])
        sig = signature(steps[t], steps[t - 1], keys, region, canonical, at)
        want = [template[i] for i in at[0]]
        if sig != want:
            raise RerollError(f"step {t} is not the same computation as step 1"
                              f"{first_difference(steps[t], steps[1], sig, want)}")
    inits = initial_carries(template, signature(steps[0], [], keys, region, canonical), canonical)
    out_index = steps[1].index(outputs[1])
    if any(live[n - 1 - t][steps[t].index(outputs[t])] != out_index for t in range(1, n)) \
            or steps[0].index(outputs[0]) != out_index:
        raise RerollError("the collected output is not the same value of every step")
    carries = sorted(inits)
    _check_escapes(steps, carries, collector)
    loop = _loop_node(gm, collector, steps, groups, carries, inits, out_index,
                      (source, block))
    collector.replace_all_uses_with(loop)
    gm.graph.erase_node(collector)
    for step in reversed(steps):
        for node in reversed(step):
            for user in list(node.users):
                if user.target in _ASSERTS:
                    gm.graph.erase_node(user)
            gm.graph.erase_node(node)
    return 1


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
               inits: dict[int, fx.Node], out_index: int, where: tuple[str, int]) -> fx.Node:
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
                    source=where[0], block=where[1])
    args = (*(inits[j] for j in carries), *(src for src, _ in groups), *invariants)
    with gm.graph.inserting_before(collector):
        node = gm.graph.call_function(loop, args)
    node.meta.update(collector.meta)
    return node
