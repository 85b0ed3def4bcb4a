"""Hand-built cost tables for planner tests (no dependency on tppc.cost_models' builders)."""

from __future__ import annotations

import numpy as np

from tppc.cost_models.table import CostTable, LayerCost, LinkCost


def causal_time(scale: float = 1e-6, fixed: float = 1e-4, span: float = 2048.0):
    """A causal layer: fixed overhead + work growing with the chunk and its prefix."""

    def time(c: np.ndarray, p: np.ndarray) -> np.ndarray:
        c = np.asarray(c, dtype=float)
        return fixed + scale * c * (1.0 + (np.asarray(p, dtype=float) + c / 2) / span)

    return time


def table(
    num_layers: int = 4,
    speeds: tuple[float, ...] = (1.0, 1.0),
    *,
    seq_len: int = 1024,
    capacity: int = 10**12,
    weight_bytes: int = 10**6,
    kv_per_token: int = 100,
    act_per_token: int = 1000,
    link_bw: float = 1e12,
    layer_scales: tuple[float, ...] | None = None,
) -> CostTable:
    """A chain of ``len(speeds)`` devices; device ``d`` runs ``speeds[d]`` times faster."""
    scales = layer_scales or (1.0,) * num_layers
    layers = tuple(
        tuple(
            LayerCost(
                name=f"layer{j}",
                time=causal_time(scale=1e-6 * scales[j] / sp, fixed=1e-4 / sp),
                weight_bytes=weight_bytes,
                kv_bytes_per_token=kv_per_token,
                act_bytes_per_token=act_per_token,
            )
            for j in range(num_layers)
        )
        for sp in speeds
    )
    return CostTable(
        device_names=tuple(f"dev{d}" for d in range(len(speeds))),
        capacities=(capacity,) * len(speeds),
        layers=layers,
        links=(LinkCost(latency=1e-6, bandwidth=link_bw),) * (len(speeds) - 1),
        seq_len=seq_len,
        causal=True,
    )
