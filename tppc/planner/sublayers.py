"""Stage boundaries inside a block: move a cut to the waist of the block beside it.

Terms:
    part: one of a block's two sub-layers (``LayerCost.parts``: ``<block>.attn`` and
        ``<block>.mlp``, cut where one value, the residual stream, is live); a plan that cuts
        a block there names its parts as two layers (``CostTable.with_layers``).

Placement searches whole layers (the search space, and planning time, stay those of the
blocks). Then, one stage boundary at a time, the refinement tries the boundary at the waist
of the block before it (that block's second part moves to the next stage) and of the block
after it (its first part moves back), each simulated on the plan's chunks, and keeps the
fastest; the chunks of the chosen placement are then improved on the simulated makespan
(the local search of :func:`tppc.planner.refine.improve_split`). On a CPU whose LM head
costs about three blocks, half a block is what balances the stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tppc.cost_models.table import CostTable
from tppc.planner.plan import Plan

__all__ = ["cut_inside_blocks"]


def cut_inside_blocks(table: CostTable, best: Plan,
                      price: Callable[[CostTable, tuple[int, ...]], Plan],
                      polish: Callable[[CostTable, tuple[int, ...], Plan], Plan],
                      *, out_of_time: Callable[[], bool] = lambda: False) -> Plan:
    """``best`` (a plan on ``table``'s whole layers) with stage boundaries moved to block
    waists where that simulates faster.

    Args:
        table: the cost table ``best`` was planned on (whole layers).
        best: the plan; its cuts index ``table``'s layers.
        price: the plan of a placement ``cuts`` on a table with some blocks split, on
            ``best``'s chunks (one simulation; candidates are compared on it).
        polish: the chosen placement's plan with its split improved (from its chunks).
        out_of_time: stops the search (the best plan so far is returned).
    """
    if best.num_stages < 2 or not any(lc.parts for lc in table.layers[0]):
        return best
    cuts = [0, *(st.layer_end for st in best.stages)]
    if table.layer_names != tuple(n for st in best.stages for n in st.layer_names):
        return best  # already refined, or planned on other layers
    base = best
    split: dict[int, int] = {}  # boundary k -> the block it cuts
    tried = 0
    for k in range(1, len(cuts) - 1):
        choice = None
        for layer in (cuts[k] - 1, cuts[k]):
            if out_of_time():
                break
            if not table.layers[0][layer].parts or layer in split.values():
                continue
            names, fine = _refined(table, cuts, {**split, k: layer})
            plan = price(table.with_layers(names), fine)
            tried += 1
            fits = all(st.memory_bytes <= st.capacity_bytes for st in plan.stages)
            if fits and plan.latency < best.latency * (1 - 1e-9):
                best, choice = plan, layer
        if choice is not None:
            split[k] = choice
    if not split:
        return best
    names, fine = _refined(table, cuts, split)
    best = polish(table.with_layers(names), fine, best)
    cut = ", ".join(table.layers[0][j].name for j in split.values())
    gain = 100 * (1 - best.latency / base.latency)
    detail = (f"{base.solver.detail}; then stage boundaries at the waist of {cut}, "
              f"{gain:.2f}% faster ({tried} in-block cuts tried)")
    return dataclasses.replace(best, solver=dataclasses.replace(base.solver, detail=detail))


def _refined(table: CostTable, cuts: list[int], split: dict[int, int]
             ) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Layer names and cuts when boundary ``k`` cuts block ``split[k]`` at its waist."""
    names: list[str] = []
    fine_index: dict[int, int] = {}
    blocks = set(split.values())
    for j, lc in enumerate(table.layers[0]):
        fine_index[j] = len(names)
        if j in blocks:
            names.extend(p.name for p in lc.parts)
        else:
            names.append(lc.name)
    fine_index[len(table.layers[0])] = len(names)
    fine = [fine_index[c] for c in cuts]
    for k, j in split.items():
        fine[k] = fine_index[j] + 1  # between the block's two parts
    return tuple(names), tuple(fine)

