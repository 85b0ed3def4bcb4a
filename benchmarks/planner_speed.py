"""Planner speed and quality on Llama-shaped models (analytic roofline costs).

Run: .venv/bin/python benchmarks/planner_speed.py [--quick]

The real cost model (tppc.cost_models) lands separately; this script prices a Llama block
with a small roofline of its own so that the planner can be measured now:
    t = max(padded matmul FLOPs / peak, bytes / HBM bandwidth) + 20 µs per layer,
    matmul rows padded to 64, causal attention FLOPs 4·c·(p + c/2)·hidden, bytes = weights +
    K/V read (p + c tokens) + activations. Embedding and LM head are left out.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from tppc.cost_models.table import CostTable, LayerCost, LinkCost
from tppc.planner import Workload, plan_for, plan_from_costs, terapipe_dp
from tppc.planner.dp import chunk_matrix


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int


@dataclass(frozen=True)
class Device:
    name: str
    flops: float
    hbm_bw: float
    capacity: int


LLAMA = {
    "7b": Shape("llama-7b", 32, 4096, 11008, 32, 32),
    "13b": Shape("llama-13b", 40, 5120, 13824, 40, 40),
    "70b": Shape("llama-70b", 80, 8192, 28672, 64, 8),
}
H100 = Device("h100-sxm", 989e12, 3.35e12, 80 * 10**9)
A100 = Device("a100-sxm", 312e12, 2.04e12, 80 * 10**9)
NVLINK = LinkCost(latency=1e-5, bandwidth=450e9)


def block_cost(shape: Shape, dev: Device) -> LayerCost:
    h, kv_dim = shape.hidden, shape.hidden // shape.heads * shape.kv_heads
    params = 2 * h * h + 2 * h * kv_dim + 3 * h * shape.ffn
    weight_bytes = 2 * params

    def time(c: np.ndarray, p: np.ndarray) -> np.ndarray:
        c, p = np.asarray(c, float), np.asarray(p, float)
        rows = np.ceil(c / 64) * 64
        flops = 2 * rows * params + 4 * c * (p + c / 2) * h
        nbytes = weight_bytes + 2 * 2 * kv_dim * (p + c) + 2 * c * (6 * h + 2 * shape.ffn)
        return np.maximum(flops / dev.flops, nbytes / dev.hbm_bw) + 20e-6

    return LayerCost(shape.name + ".block", time, weight_bytes, 2 * 2 * kv_dim, 2 * h)


def cost_table(shape: Shape, devices: list[Device], seq_len: int) -> CostTable:
    return CostTable(
        device_names=tuple(d.name for d in devices),
        capacities=tuple(d.capacity for d in devices),
        layers=tuple((block_cost(shape, d),) * shape.layers for d in devices),
        links=(NVLINK,) * (len(devices) - 1),
        seq_len=seq_len,
        causal=True,
    )


def even_cuts(n_layers: int, stages: int) -> tuple[int, ...]:
    return tuple(round(i * n_layers / stages) for i in range(stages + 1))


def baselines(table: CostTable, g: int) -> dict[str, float]:
    """Latency / lower bound of no split, best uniform split, TeraPipe DP, tppc."""
    S, L = table.num_devices, table.seq_len
    cuts = even_cuts(table.num_layers, S)
    out: dict[str, float] = {}
    nosplit = plan_for(table, cuts, (0, L), granularity=g)
    out["no split"] = nosplit.ratio_to_bound
    best = math.inf
    for k in range(1, L // g + 1):
        bounds = tuple(sorted({round(i * (L // g) / k) * g for i in range(k + 1)}))
        best = min(best, plan_for(table, cuts, bounds, granularity=g).latency)
    out["uniform"] = best / nosplit.lower_bound
    slowest = max(
        range(S), key=lambda s: table.layers[s][0].time(np.array([1.0 * L]), np.zeros(1))[0]
    )
    fn = table.layers[slowest][0].time
    per_stage = max(b - a for a, b in itertools.pairwise(cuts))
    m = chunk_matrix(lambda c, p: per_stage * fn(c, p), L // g, g)
    dp = terapipe_dp(m, num_stages=S)
    out["terapipe"] = (
        plan_for(table, cuts, tuple(b * g for b in dp.bounds), granularity=g).latency
        / nosplit.lower_bound
    )
    t0 = time.perf_counter()
    plan = plan_from_costs(table, granularity=g, time_limit=20)
    out["tppc"] = plan.latency / nosplit.lower_bound
    out["tppc_s"] = time.perf_counter() - t0
    out["lower_bound_ms"] = nosplit.lower_bound * 1e3
    out["tppc_ms"] = plan.latency * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the 70B speed measurement")
    args = ap.parse_args()
    t0 = time.perf_counter()
    table = cost_table(LLAMA["70b"], [H100] * 8, 32768)
    t1 = time.perf_counter()
    plan = plan_from_costs(table, granularity=128, time_limit=20)
    t2 = time.perf_counter()
    print(f"70B, 8xH100, L=32768, g=128: table {t1 - t0:.2f} s, plan {t2 - t1:.2f} s")
    print(plan.summary())
    if args.quick:
        return
    print("\nlatency / lower bound (8xH100, even layers for the baselines)")
    print(
        f"{'model':<10}{'L':>7}  {'no split':>9}{'uniform':>9}{'terapipe':>9}{'tppc':>9}"
        f"{'tppc ms':>10}{'plan s':>8}"
    )
    for (key, shape), L in itertools.product(LLAMA.items(), (4096, 16384, 32768)):
        r = baselines(cost_table(shape, [H100] * 8, L), 128)
        print(
            f"{key:<10}{L:>7}  {r['no split']:>9.3f}{r['uniform']:>9.3f}{r['terapipe']:>9.3f}"
            f"{r['tppc']:>9.3f}{r['tppc_ms']:>10.2f}{r['tppc_s']:>8.2f}"
        )
    print("\nheterogeneous 4xH100 + 4xA100, llama-70b: tppc placement vs even layer split")
    for L in (4096, 16384, 32768):
        table = cost_table(LLAMA["70b"], [H100] * 4 + [A100] * 4, L)
        even = even_cuts(80, 8)
        from tppc.planner.split_matrices import SplitContext, split_matrices

        ctx = SplitContext(table, Workload(), 128, 8, None, math.inf)
        m, f, _ = split_matrices(ctx, even)
        dp = terapipe_dp(m, f, 8)
        even_plan = plan_for(table, even, tuple(b * 128 for b in dp.bounds), granularity=128)
        t0 = time.perf_counter()
        plan = plan_from_costs(table, granularity=128, time_limit=20)
        dt = time.perf_counter() - t0
        layers = [st.num_layers for st in plan.stages]
        print(
            f"L={L:>6}: even {even_plan.latency * 1e3:8.2f} ms, tppc {plan.latency * 1e3:8.2f} "
            f"ms ({even_plan.latency / plan.latency:.3f}x), layers {layers}, {dt:.2f} s"
        )


if __name__ == "__main__":
    main()
