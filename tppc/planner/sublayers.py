"""Stage boundaries inside a block: move a cut to the waist of the block beside it.

Terms:
    part: one of a block's two sub-layers (``LayerCost.parts``: ``<block>.attn`` and
        ``<block>.mlp``, cut where one value, the residual stream, is live); a plan that cuts
        a block there names its parts as two layers (``CostTable.with_layers``).

Placement searches whole layers (the search space, and planning time, stay those of the
blocks). Then, one stage boundary at a time, the refinement tries the boundary at the waist
of the block before it (that block's second part moves to the next stage) and of the block
after it (its first part moves back), each with its own exact split (TeraPipe's DP, as the
whole-layer search prices a placement), and keeps the fastest by simulated latency; the
chosen placement's chunks are then improved on the simulated makespan (the local search of
:func:`tppc.planner.refine.improve_split`) and it replaces the plan only when that beats the
whole-layer plan so improved. On a CPU whose LM head costs about three blocks, half a
block is what balances the stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tppc.cost_models.table import CostTable
from tppc.planner.memory import over_capacity
from tppc.planner.plan import Plan

__all__ = ["cut_inside_blocks"]


def cut_inside_blocks(table: CostTable, best: Plan, reference: float,
                      price: Callable[[CostTable, tuple[int, ...]], Plan],
                      polish: Callable[[CostTable, tuple[int, ...], Plan], Plan],
                      *, out_of_time: Callable[[], bool] = lambda: False) -> Plan:
    """``best`` (a plan on ``table``'s whole layers) with stage boundaries moved to block
    waists where that simulates faster.

    Args:
        table: the cost table ``best`` was planned on (whole layers).
        best: the plan (its chunks improved by ``polish``'s local search); its cuts index
            ``table``'s layers.
        reference: the simulated latency of ``best``'s placement with the split ``price``
            would give it (before the local search): candidates are compared on that footing.
        price: the plan of a placement ``cuts`` on a table with some blocks split, with the
            split the whole-layer search gives a placement (TeraPipe's exact DP).
        polish: that plan with its chunks improved on the simulated makespan.
        out_of_time: stops the search (the best plan so far is returned).
    """
    if best.num_stages < 2 or not any(lc.parts for lc in table.layers[0]):
        return best
    cuts = [0, *(st.layer_end for st in best.stages)]
    if table.layer_names != tuple(n for st in best.stages for n in st.layer_names):
        return best  # already refined, or planned on other layers
    split: dict[int, int] = {}  # boundary k -> the block it cuts
    chosen: Plan | None = None
    tried = 0
    for k in range(1, len(cuts) - 1):
        for layer in (cuts[k] - 1, cuts[k]):
            if out_of_time():
                break
            if not table.layers[0][layer].parts or layer in split.values():
                continue
            names, fine = _refined(table, cuts, {**split, k: layer})
            plan = price(table.with_layers(names), fine)
            tried += 1
            fits = not over_capacity(table, [(st.device_index, st.memory_bytes)
                                             for st in plan.stages])
            if fits and plan.latency < reference * (1 - 1e-9):
                reference, chosen = plan.latency, plan
                split = {**{b: j for b, j in split.items() if b != k}, k: layer}
    if chosen is None:
        return best
    names, fine = _refined(table, cuts, split)
    polished = polish(table.with_layers(names), fine, chosen)
    if polished.latency >= best.latency * (1 - 1e-9):
        return best
    cut = ", ".join(table.layers[0][j].name for j in split.values())
    gain = 100 * (1 - polished.latency / best.latency)
    detail = (f"{best.solver.detail}; then stage boundaries at the waist of {cut}, "
              f"{gain:.2f}% faster ({tried} in-block cuts tried)")
    return dataclasses.replace(polished, solver=dataclasses.replace(best.solver, detail=detail))


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

