"""Memory of a stage: weights + K/V buffers of the full sequence + in-flight activations."""

from __future__ import annotations

import numpy as np

from tppc.cost_models.table import CostTable

__all__ = ["IN_FLIGHT", "memory_parts", "smallest_fit", "stage_memory"]

IN_FLIGHT = 2
"""Chunks whose activations a stage holds at once (the one it runs and the one it sends)."""


def memory_parts(table: CostTable, device: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer static bytes (weights + full K/V) and act bytes per token on ``device``."""
    layers = table.layers[device]
    static = np.array(
        [lc.weight_bytes + lc.kv_bytes_per_token * table.seq_len for lc in layers], float
    )
    act = np.array([lc.act_bytes_per_token for lc in layers], float)
    return static, act


def stage_memory(table: CostTable, device: int, lo: int, hi: int, max_chunk: int) -> int:
    """Predicted peak bytes of layers ``[lo, hi)`` on ``device`` with chunks ≤ ``max_chunk``."""
    static, act = memory_parts(table, device)
    return int(static[lo:hi].sum() + IN_FLIGHT * max_chunk * act[lo:hi].max())


def smallest_fit(table: CostTable, capacity: int, max_chunk: int) -> int | None:
    """Fewest devices of ``capacity`` (priced as device 0) holding all layers, greedily."""
    static, act = memory_parts(table, 0)
    count, used, widest = 1, 0.0, 0.0
    for j in range(table.num_layers):
        alone = static[j] + IN_FLIGHT * max_chunk * act[j]
        if alone > capacity:
            return None
        w = max(widest, act[j])
        if used + static[j] + IN_FLIGHT * max_chunk * w > capacity:
            count, used, w = count + 1, 0.0, act[j]
        used, widest = used + static[j], w
    return count
