"""Memory of a stage: the one rule every part of the planner uses (placement, split masks,
infeasibility errors, the plan's report).

A stage holding layers ``[lo, hi)`` with chunks of at most ``c`` tokens allocates::

    Σ weights + Σ K/V bytes per token · L          (buffers at the full buffer length L)
    + outputs of the model's last layer · L         (only the stage that holds that layer)
    + c · max_j (IN_FLIGHT · boundary bytes_j + peak bytes_j)

``IN_FLIGHT = QUEUE_DEPTH + 1``: the chunks that may wait in the stage's input queue plus
the one it runs; ``peak bytes`` is the largest single value inside a layer per token (the
MLP intermediate of a transformer block). Not counted yet: positional tables (O(L) per stage
after the runtime rewrite; small next to the K/V buffers) and allocator fragmentation.
"""

from __future__ import annotations

import numpy as np

from tppc.cost_models.table import CostTable

__all__ = ["IN_FLIGHT", "QUEUE_DEPTH", "memory_parts", "smallest_fit", "stage_memory"]

QUEUE_DEPTH = 2
"""Chunks that may wait between two stages (the threaded runtime's default ``queue_depth``)."""

IN_FLIGHT = QUEUE_DEPTH + 1
"""Chunk activations a stage holds at once: its queue and the chunk it runs."""


def memory_parts(table: CostTable, device: int) -> tuple[np.ndarray, np.ndarray]:
    """``(static bytes, transient bytes per chunk token)`` of every layer on ``device``.

    A stage needs ``static[lo:hi].sum() + max_chunk · transient[lo:hi].max()`` (the module
    docstring's rule); every caller combines the two parts that way.
    """
    layers = table.layers[device]
    static = np.array(
        [lc.weight_bytes + lc.kv_bytes_per_token * table.seq_len for lc in layers], float
    )
    if layers:
        static[-1] += layers[-1].act_bytes_per_token * table.seq_len  # outputs kept
    transient = np.array(
        [IN_FLIGHT * lc.act_bytes_per_token + lc.peak_bytes_per_token for lc in layers], float
    )
    return static, transient


def stage_memory(table: CostTable, device: int, lo: int, hi: int, max_chunk: int) -> int:
    """Predicted peak bytes of layers ``[lo, hi)`` on ``device`` with chunks ≤ ``max_chunk``."""
    static, transient = memory_parts(table, device)
    return int(static[lo:hi].sum() + max_chunk * transient[lo:hi].max())


def smallest_fit(table: CostTable, capacity: int, max_chunk: int) -> int | None:
    """Fewest devices of ``capacity`` (priced as device 0) holding all layers, greedily."""
    static, transient = memory_parts(table, 0)
    count, used, widest = 1, 0.0, 0.0
    for j in range(table.num_layers):
        if static[j] + max_chunk * transient[j] > capacity:
            return None
        w = max(widest, transient[j])
        if used + static[j] + max_chunk * w > capacity:
            count, used, w = count + 1, 0.0, transient[j]
        used, widest = used + static[j], w
    return count
