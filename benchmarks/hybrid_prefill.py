"""Prefill on the 2-core machine: tensor parallelism, the token pipeline, and tppc's own choice.

Models (random weights, fp32, SDPA, one sequence of ``--seq`` tokens):
    qwen2: the Qwen2-shaped model of ``benchmarks/qwen2_prefill.py`` (8 layers, hidden 512,
        8 / 2 K/V heads, vocab 32000, 55 M parameters).
    llama: the ~200 M Llama of ``benchmarks/pipeline_speed.py`` (hidden 768, 24 layers,
        12 / 4 K/V heads, MLP 2048, vocab 32000).

Measured side by side in one process, repetitions interleaved (so every row sees the same
noise), the median of ``--reps`` reported as a ratio to eager on one thread:
    eager-1t:   ``model(ids)`` with ``torch.set_num_threads(1)``.
    eager-2t:   ``model(ids)`` with 2 intra-op threads (PyTorch's own parallelism: the CPU
                analogue of tensor parallelism, the strongest peer on this machine).
    pp2:        ``tppc.compile(..., cluster="2xcpu", num_stages=2, tensor_parallel=1)``:
                two stages of one thread, the planner's chunks.
    tp2:        ``tppc.compile(..., cluster="2xcpu", num_stages=1, tensor_parallel=2)``: one
                stage sharded over two worker threads (Megatron pairs, an all-reduce after
                each row-parallel projection, the LM head cut by vocabulary).
    intra2:     ``tppc.compile(..., cluster="2xcpu", num_stages=1, intra_op=2)``: one stage,
                one worker running both CPU devices' cores as its intra-op threads (torch
                splits each op, as eager-2t), the planner's chunks.
    default:    ``tppc.compile(..., cluster="2xcpu")``: what a user gets (the planner picks
                the degrees, PP2, TP2 or intra-op 2, and the chunks).
Every tppc row runs the threads executor, each worker with its plan devices' share of the
cores (``threads_per_stage`` left None: on 2 cores one thread per worker of a one-device
stage, two for the intra-op worker), and each result is checked against eager (max |diff|
printed).

``--breakdown`` then times one more ``tp2`` call and splits each worker's wall time by its
trace (``cp.last_trace``: one entry per compute part): its compute (the parts between
collectives; the last computing part is the LM head's vocabulary slice) and the rest, the
time in the group's meetings (waiting for the other worker, the last one's serial sum, the
hand-offs), next to half of eager on one thread (the ideal share of each worker).

Run:  flock -x /tmp/tppc_cpu.lock .venv/bin/python benchmarks/hybrid_prefill.py --model qwen2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import tppc
from tppc.cost_models.cluster import Cluster
from tppc.cost_models.intra_op import intra_op_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_speed import llama
from qwen2_prefill import qwen2


def build(name: str) -> torch.nn.Module:
    if name == "qwen2":
        return qwen2()
    args = argparse.Namespace(hidden=768, mlp=2048, layers=24, heads=12, kv_heads=4)
    return llama(args)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("qwen2", "llama"), default="qwen2")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--breakdown", action="store_true",
                   help="split one tp2 call's time per worker: compute, meetings")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build(args.model)
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    common = {"cluster": "2xcpu", "executor": "threads"}
    compiled = {
        "pp2": tppc.compile(model, (ids,), num_stages=2, tensor_parallel=1, intra_op=1,
                            **common),
        "tp2": tppc.compile(model, (ids,), num_stages=1, tensor_parallel=2, **common),
        "intra2": tppc.compile(model, (ids,), num_stages=1, intra_op=2, **common),
        "default": tppc.compile(model, (ids,), **common),
    }
    print(compiled["default"].plan.summary())
    group = Cluster.parse("2xcpu").devices[0].thread_group
    print(f"thread group (calibrated): {group}")
    for label, spec in (("1 thread, 2 at once", Cluster.parse("2xcpu").devices[0]),
                        ("2 threads (intra-op)", intra_op_spec(2))):
        print(f"cpu {label}: fp32 {spec.matrix.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, "
              f"half rows {spec.matrix.half_rows:.1f}, vector {spec.vector.peak_flops / 1e9:.1f}"
              f" G/s, bandwidth {spec.memory.bandwidth / 1e9:.1f} GB/s, op overhead "
              f"{spec.op_overhead * 1e6:.1f} us")
    for name, cp in compiled.items():
        diff = (cp(ids).logits - want).abs().max().item()
        threads = [w.threads for w in cp.program(args.seq).runners]
        print(f"{name}: degrees {dict(cp.plan.degrees)}, chunks {len(cp.plan.chunks)}, "
              f"worker threads {threads}, predicted {cp.plan.latency:.3f} s, max |diff| vs "
              f"eager {diff:.2e}")

    def eager(threads: int):
        def run() -> None:
            torch.set_num_threads(threads)
            with torch.no_grad():
                model(ids)
            torch.set_num_threads(1)
        return run

    rows = {"eager-1t": eager(1), "eager-2t": eager(2),
            **{k: (lambda cp=cp: cp(ids)) for k, cp in compiled.items()}}
    for fn in rows.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.reps):
        for k, fn in rows.items():
            times[k].append(timed(fn))
    base = statistics.median(times["eager-1t"])
    print(f"\n{args.model}, {args.seq} tokens, median of {args.reps} interleaved repetitions")
    print(f"{'row':10s} {'median s':>9s} {'min s':>7s} {'x eager-1t':>10s}")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"{k:10s} {med:9.3f} {min(v):7.3f} {base / med:10.2f}")
    if args.breakdown:
        breakdown(compiled["tp2"], ids, base)


def breakdown(cp, ids: torch.Tensor, eager_1t: float) -> None:
    """Each tp2 worker's wall time split by its trace (the module docstring)."""
    t0 = time.perf_counter()
    cp(ids)
    wall = time.perf_counter() - t0
    print(f"\ntp2 breakdown, one call: wall {wall:.3f} s, eager-1t / 2 = {eager_1t / 2:.3f} s")
    for w in sorted({job[0] for job in cp.last_trace}):
        parts = [end - start for s, _, start, end in cp.last_trace if s == w]
        computing = [p for p in parts if p > 1e-3]
        compute = sum(parts)
        print(f"worker {w}: compute {compute:.3f} s in {len(parts)} parts "
              f"({compute / (eager_1t / 2):.3f}x eager-1t / 2; last part, the LM head slice, "
              f"{computing[-1] if computing else 0.0:.3f} s), outside compute "
              f"{wall - compute:.3f} s ({(wall - compute) / wall:.1%} of wall)")


if __name__ == "__main__":
    main()
