"""Hand-built cost tables for planner tests (no dependency on tppc.cost_models' builders)."""

from __future__ import annotations

import itertools

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


def hand_makespan(t: CostTable, cuts, bounds, steps: int = 1, devices=None) -> float:
    """Flow-shop makespan written out by hand from the layer prices (an independent oracle).

    Chunk ``i`` of step ``d`` starts on stage ``s`` when stage ``s`` finished the previous job
    and the chunk arrived over the link; on stage 0 in steps after the first it also waits
    for the same chunk of the previous step to come back from the last stage (PipeFusion).
    Stage ``s`` runs on device ``devices[s]`` (default ``s``); a message between two devices
    crosses every link between them (latencies add, the slowest bandwidth counts).
    """
    devices = list(range(len(cuts) - 1)) if devices is None else list(devices)
    num_stages, chunks = len(cuts) - 1, list(itertools.pairwise(bounds))

    def work(s: int, a: int, b: int) -> float:
        c, p = np.array([float(b - a)]), np.array([float(a)])
        layers = t.layers[devices[s]]
        return sum(float(layers[j].time(c, p)[0]) for j in range(cuts[s], cuts[s + 1]))

    def send(s: int, a: int, b: int) -> float:
        hops = t.links[devices[s]:devices[s + 1]]
        act = t.layers[devices[s]][cuts[s + 1] - 1].act_bytes_per_token
        return sum(h.latency for h in hops) + (b - a) * act / min(h.bandwidth for h in hops)

    end: dict[tuple[int, int], float] = {}
    jobs = [(d, i) for d in range(steps) for i in range(len(chunks))]
    for k, (d, i) in enumerate(jobs):
        a, b = chunks[i]
        for s in range(num_stages):
            ready = end.get((s, k - 1), 0.0)
            if s > 0:
                ready = max(ready, end[s - 1, k] + send(s - 1, a, b))
            elif d > 0:
                act = t.layers[devices[-1]][cuts[-1] - 1].act_bytes_per_token
                back = t.links[0].latency + (b - a) * act / t.links[0].bandwidth \
                    if num_stages > 1 else 0.0
                ready = max(ready, end[num_stages - 1, k - len(chunks)] + back)
            end[s, k] = ready + work(s, a, b)
    return end[num_stages - 1, len(jobs) - 1]
