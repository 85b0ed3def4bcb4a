"""Memory of a stage: the one rule every part of the planner uses (placement, split masks,
infeasibility errors, the plan's report).

A stage holding layers ``[lo, hi)`` with chunks of at most ``c`` tokens allocates::

    Σ weights + Σ K/V bytes per token · L          (buffers at the full buffer length L)
    + outputs of the model's last layer · L         (only the stage that holds that layer)
    + max_j positional bytes_j · L                   (rope tables: once per stage)
    + c · max_j ((q + 1) · boundary bytes_j + peak bytes_j    (last layer: its input's)
                 + workspace_j · min(L, MASK_ELEMENTS / c))   (attention mask of one block)

``q + 1``, ``q = CostTable.queue_depth`` (the runtime's ``queue_depth``): the chunks that may
wait in the stage's input queue plus the one it runs; ``peak bytes`` is the largest sum of values live at once inside a layer per
token (the MLP intermediates of a transformer block:
:func:`tppc.cost_models.layer_memory.peak_live_bytes`). Positional values are counted once
per stage at the largest layer's size: the runtime evaluates one positional program per
stage, and the layers of a stage read the same tables. ``workspace`` is the causal chunk
attention's mask per (query row, key) (:func:`tppc.cost_models.layer_memory.
attention_workspace`), for a block of at most ``MASK_ELEMENTS`` rows × keys; callers that do
not say ``max_chunk`` get the uncapped (larger) value. Not counted: allocator slack.
``benchmarks/stage_memory.py`` measures each stage against this rule on CPU.

A stage is charged against its device's capacity, and the stages whose devices share a
memory pool (``CostTable.pools``: the ``cpu`` devices of one node share its RAM) are charged
together against the pool's (the least capacity of its devices): :func:`over_capacity`,
the one check of the placement, the split, the plan's notes and the infeasibility error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tppc.cost_models.table import CostTable
from tppc.ir.ops import MASK_ELEMENTS

__all__ = ["memory_parts", "over_capacity", "pool_of", "positional_part", "smallest_fit",
           "stage_memory"]


def memory_parts(table: CostTable, device: int, max_chunk: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(static bytes, transient bytes per chunk token)`` of every layer on ``device``.

    A stage needs ``static[lo:hi].sum() + positional_part[lo:hi].max() + max_chunk ·
    transient[lo:hi].max()`` (the module docstring's rule); every caller combines the parts
    that way. ``max_chunk`` caps the attention mask's keys at ``MASK_ELEMENTS / max_chunk``.
    """
    layers = table.layers[device]
    static = np.array(
        [lc.weight_bytes + lc.kv_bytes_per_token * table.seq_len for lc in layers], float
    )
    if layers:
        static[-1] += layers[-1].act_bytes_per_token * table.seq_len  # outputs kept
    keys = table.seq_len if not max_chunk else min(table.seq_len,
                                                   max(1, MASK_ELEMENTS // max_chunk))
    queued = [lc.act_bytes_per_token for lc in layers]
    if len(layers) > 1:  # the model's outputs are written in place (kept, counted above):
        queued[-1] = queued[-2]  # the last layer's stage queues its input chunks, not them
    transient = np.array(
        [(table.queue_depth + 1) * q + lc.peak_bytes_per_token
         + lc.workspace_bytes_per_key * keys for q, lc in zip(queued, layers)], float
    )
    return static, transient


def positional_part(table: CostTable, device: int) -> np.ndarray:
    """Bytes of positional values each layer on ``device`` reads at the full length; a stage
    holds the largest of its layers' (the module docstring's rule)."""
    return np.array([lc.positional_bytes_per_token * table.seq_len
                     for lc in table.layers[device]], float)


def stage_memory(table: CostTable, device: int, lo: int, hi: int, max_chunk: int) -> int:
    """Predicted peak bytes of layers ``[lo, hi)`` on ``device`` with chunks ≤ ``max_chunk``."""
    static, transient = memory_parts(table, device, max_chunk)
    positional = positional_part(table, device)
    return int(static[lo:hi].sum() + positional[lo:hi].max()
               + max_chunk * transient[lo:hi].max())


def pool_of(table: CostTable, device: int) -> int:
    """The memory pool of ``device`` (its own index when the table has no pools)."""
    return table.pools[device] if table.pools else device


def over_capacity(table: CostTable, needs: Sequence[tuple[int, float]]
                  ) -> list[tuple[tuple[int, ...], float, int]]:
    """The pools that ``needs`` (``(device, bytes)`` of each stage) overfill, as ``(stages,
    need, capacity)``: the indices into ``needs`` of the pool's stages, their summed need,
    and the pool's capacity (the least of its devices'); empty when everything fits."""
    pools: dict[int, tuple[list[int], float, int]] = {}
    for index, (device, need) in enumerate(needs):
        stages, total, cap = pools.get(pool_of(table, device), ([], 0.0, table.capacities[device]))
        pools[pool_of(table, device)] = ([*stages, index], total + need,
                                         min(cap, table.capacities[device]))
    return [(tuple(stages), total, cap) for stages, total, cap in pools.values()
            if total > cap]


def smallest_fit(table: CostTable, capacity: int, max_chunk: int) -> int | None:
    """Fewest devices of ``capacity`` (priced as device 0) holding all layers, greedily."""
    static, transient = memory_parts(table, 0, max_chunk)
    positional = positional_part(table, 0)
    count, used, widest, pos = 1, 0.0, 0.0, 0.0
    for j in range(table.num_layers):
        if static[j] + positional[j] + max_chunk * transient[j] > capacity:
            return None
        w, q = max(widest, transient[j]), max(pos, positional[j])
        if used + static[j] + q + max_chunk * w > capacity:
            count, used, w, q = count + 1, 0.0, transient[j], positional[j]
        used, widest, pos = used + static[j], w, q
    return count
