"""Steps of an unrolled loop written as signatures, compared op by op (:mod:`.reroll`).

Terms as in :mod:`tppc.frontend.reroll` (step, carry, invariant, position). A step's
*signature* lists its ops with their reads encoded as ``("l", j)`` (its own ``j``-th op),
``("c", j)`` (the previous step's ``j``-th op: a carry), ``("i", key)`` (an invariant, by
:class:`Canonical` key) and its position reads as ``("pos", input)``.
"""

from __future__ import annotations

from typing import Any

from torch import fx

__all__ = ["Canonical", "RerollError", "first_difference", "initial_carries", "live_ops",
           "signature"]


class RerollError(Exception):
    """The unrolled loop is not a recurrence the re-roller can prove (the reason)."""


class Canonical:
    """An invariant's key: itself, or for an op outside the loop region its op and its
    arguments' keys, so that a value each step recomputes alike (MiniMax's
    ``query_decay[:, :block]``, one copy per step) is one invariant."""

    def __init__(self, region: set[fx.Node]) -> None:
        self.region, self.memo = region, {}
        self.nodes: dict[Any, fx.Node] = {}  # a key -> its first node

    def __call__(self, node: fx.Node) -> Any:
        if node not in self.memo:
            if node.op != "call_function" or node in self.region:
                self.memo[node] = node
            else:
                self.memo[node] = (node.target, self._enc(node.args), self._enc(node.kwargs))
            self.nodes.setdefault(self.memo[node], node)
        return self.memo[node]

    def _enc(self, value: Any) -> Any:
        if isinstance(value, fx.Node):
            return self(value)
        if isinstance(value, list | tuple):
            return (type(value).__name__, *(self._enc(v) for v in value))
        if isinstance(value, dict):
            return ("dict", *((k, self._enc(v)) for k, v in sorted(value.items())))
        return ("lit", type(value).__name__, value)


def signature(step: list[fx.Node], before: list[fx.Node],
               positions: dict[fx.Node, tuple[fx.Node, int]], region: set[fx.Node],
               canonical: Canonical, at: tuple[list[int], list[int]] | None = None
               ) -> list[tuple[Any, ...]]:
    """The step's signature; ``at``: the template's index of each op of the step and of
    the step before (for steps missing the ops of a dead final carry)."""
    mine, theirs = at or (list(range(len(step))), list(range(len(before))))
    local = {n: mine[j] for j, n in enumerate(step)}
    previous = {n: theirs[j] for j, n in enumerate(before)}

    def enc(value: Any) -> Any:
        if isinstance(value, fx.Node):
            if value in local:
                return ("l", local[value])
            if value in previous:
                return ("c", previous[value])
            if value in region:
                raise RerollError(f"{value.name} of an earlier step is read two steps later")
            return ("i", canonical(value))
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


def first_difference(step: list[fx.Node], template: list[fx.Node], sig: list[Any],
                      want: list[Any]) -> str:
    """Where a step's signature first differs from the template's (for the message)."""
    if len(sig) != len(want):
        return f" ({len(step)} ops, not {len(template)})"
    for node, mine, theirs in zip(step, sig, want, strict=True):
        if mine != theirs:
            return f": {node.name} ({node.format_node()}) is not {theirs}"
    return ""


def initial_carries(template: list[Any], first: list[Any], canonical: Canonical
                    ) -> dict[int, fx.Node]:
    """carry ``j`` -> its initial value, matching step 0's signature to the template's: step
    0 reads an invariant (the initial value) wherever the template reads carry ``j``."""
    inits: dict[int, Any] = {}

    def match(t: Any, f: Any) -> bool:
        if isinstance(t, tuple) and len(t) == 2 and t[0] == "c" and isinstance(t[1], int):
            if not (isinstance(f, tuple) and len(f) == 2 and f[0] == "i"):
                return False
            return inits.setdefault(t[1], f[1]) == f[1]
        if isinstance(t, tuple) and isinstance(f, tuple):
            return len(t) == len(f) and all(match(a, b) for a, b in zip(t, f, strict=True))
        return t == f

    if len(template) != len(first) or not all(match(t, f) for t, f in zip(template, first,
                                                                          strict=True)):
        raise RerollError(f"the first step differs from the others beyond its carries' "
                          f"initial values{first_difference(first, template, first, template)}"
                          if len(template) != len(first) else
                          "the first step differs from the others beyond its carries' "
                          "initial values")
    return {j: canonical.nodes[key] for j, key in inits.items()}


def live_ops(template: list[fx.Node], output: fx.Node, sig: list[Any], n: int
              ) -> list[list[int]]:
    """``[k]``: the template's ops (indices) that outputs at most ``k`` steps later read: a
    step ``k`` steps before the last holds only those (the graph dropped the rest, the
    carries no later step reads)."""
    index = {node: i for i, node in enumerate(template)}
    carried_by: dict[int, set[int]] = {}  # op i reads carry j (op j of the step before)
    for i, entry in enumerate(sig):
        for j in _carry_reads(entry):
            carried_by.setdefault(i, set()).add(j)

    def closure(roots: set[int]) -> set[int]:
        found, todo = set(), list(roots)
        while todo:
            i = todo.pop()
            if i not in found:
                found.add(i)
                todo.extend(index[a] for a in template[i].all_input_nodes if a in index)
        return found

    live = [closure({index[output]})]
    for _ in range(1, n):
        live.append(closure({index[output]} | {j for i in live[-1]
                                               for j in carried_by.get(i, ())}))
    return [sorted(ops) for ops in live]


def _carry_reads(entry: Any) -> list[int]:
    if isinstance(entry, tuple) and len(entry) == 2 and entry[0] == "c" \
            and isinstance(entry[1], int):
        return [entry[1]]
    if isinstance(entry, tuple):
        return [j for e in entry for j in _carry_reads(e)]
    return []
