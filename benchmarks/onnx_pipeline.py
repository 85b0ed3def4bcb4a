"""ONNX Runtime backend speed: per-stage time vs torch, 2-stage ORT pipeline vs unsplit ORT.

Model: the Llama-shaped ``LlamaForCausalLM`` of ``pipeline_speed.py`` (random weights, fp32;
default 12 layers, hidden 768, 12 heads / 4 K/V heads, MLP 2048, vocab 32000: ~125 M
parameters) at ``--seq`` tokens, kept small so the run takes a few minutes on 2 cores.

Measured side by side in one process, alternating repetitions (median reported):
    ort pipeline:  ``tppc.load(artifact, threads_per_stage=1)`` of a 2-stage export: two
                   ORT sessions, one intra-op thread each, pipelined in two threads.
    ort unsplit:   the same model exported as 1 stage, 1 chunk, on one ORT thread.
    torch threads: the compiled pipeline (executor="threads", 1 thread per stage).
    torch eager:   ``model(ids)`` on one torch thread.
Per stage: busy seconds of each stage in the ORT and the torch pipelines (from their traces).
K/V interface: time of one ``--probe``-token chunk of stage 0 at a fixed start, with the
K/V buffers allocated for growing capacities (flat: a chunk never copies a whole buffer),
and at growing starts (grows with the keys attention reads).
Export: seconds and bytes of the artifact against the model's weight bytes.

Run:  .venv/bin/python benchmarks/onnx_pipeline.py [--seq 1024] [--reps 5] [--chunks 8]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tppc
from tppc.backends.onnxruntime import OrtCall


def llama(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.mlp,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=32768,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def busy(trace, stages: int) -> list[float]:
    return [sum(t[3] - t[2] for t in trace if t[0] == s) for s in range(stages)]


def export_timed(cp, path: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    tppc.export(cp, path)
    return time.perf_counter() - t0, sum(f.stat().st_size for f in path.iterdir())


def chunk_time(runner, start: int, size: int, capacity: int, reps: int) -> float:
    """Median seconds of one chunk [start, start+size) of stage 0, buffers of ``capacity``."""
    stage = runner.stages[0]
    ids = np.zeros((1, capacity), dtype=np.int64)
    call = OrtCall(flat=[ids, False], chunks=(), seq_len=capacity, pos_len=capacity)
    stage.allocate(call, capacity)
    stage.prepare(call)
    stage.step(call, start, start + size, [])  # warm-up
    return statistics.median(timed(lambda: stage.step(call, start, start + size, []))
                             for _ in range(reps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--mlp", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--probe", type=int, default=64, help="tokens of the K/V probe chunk")
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(1)
    model = llama(args)
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1))
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    cp = tppc.compile(model, (ids,), cluster="2xcpu", executor="threads", num_stages=2,
                      threads_per_stage=1, chunks=args.chunks)
    one = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=1, chunks=1)
    with tempfile.TemporaryDirectory() as tmp:
        split_s, split_bytes = export_timed(cp, Path(tmp) / "split")
        whole_s, whole_bytes = export_timed(one, Path(tmp) / "whole")
        piped = tppc.load(Path(tmp) / "split", threads_per_stage=1)
        unsplit = tppc.load(Path(tmp) / "whole", threads_per_stage=1)
        x = ids.numpy()
        with torch.no_grad():
            expected = model(ids).logits.numpy()
        diff = max(float(np.abs(piped(x).logits - expected).max()),
                   float(np.abs(unsplit(x).logits - expected).max()))
        rows: dict[str, list[float]] = {"ort pipeline, 2 stages x 1 thread": [],
                                        "ort unsplit, 1 thread": [],
                                        "torch threads, 2 stages x 1 thread": [],
                                        "torch eager, 1 thread": []}
        ort_busy, torch_busy = [], []
        with torch.no_grad():
            for _ in range(args.reps):
                rows["ort pipeline, 2 stages x 1 thread"].append(timed(lambda: piped(x)))
                ort_busy.append(busy(piped.last_trace, 2))
                rows["ort unsplit, 1 thread"].append(timed(lambda: unsplit(x)))
                rows["torch threads, 2 stages x 1 thread"].append(timed(lambda: cp(ids)))
                torch_busy.append(busy(cp.last_trace, 2))
                rows["torch eager, 1 thread"].append(timed(lambda: model(ids)))
        caps = [args.seq, 4 * args.seq, 16 * args.seq]
        at_capacity = [chunk_time(piped, args.seq // 2, args.probe, c, args.reps) for c in caps]
        starts = [0, args.seq // 2, args.seq - args.probe]
        at_start = [chunk_time(piped, s, args.probe, args.seq, args.reps) for s in starts]
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"Llama-shaped, {weights / 4e6:.0f} M params, {args.seq} tokens, fp32, chunks "
          f"{[b - a for a, b in cp.program(args.seq).chunks]}, stages "
          f"{[(s.layer_start, s.layer_end) for s in cp.plan.stages]}; max |logits - eager| "
          f"= {diff:.1e}")
    for name, ts in rows.items():
        print(f"{name:<38} median {med[name]:7.3f} s   min {min(ts):7.3f} s")
    split, whole = "ort pipeline, 2 stages x 1 thread", "ort unsplit, 1 thread"
    threads, eager = "torch threads, 2 stages x 1 thread", "torch eager, 1 thread"
    print(f"ort unsplit / ort pipeline: median {med[whole] / med[split]:.2f}x, min "
          f"{min(rows[whole]) / min(rows[split]):.2f}x;   torch eager / torch threads: median "
          f"{med[eager] / med[threads]:.2f}x;   torch eager / ort unsplit: median "
          f"{med[eager] / med[whole]:.2f}x")
    ob = [statistics.median(b[s] for b in ort_busy) for s in range(2)]
    tb = [statistics.median(b[s] for b in torch_busy) for s in range(2)]
    for s in range(2):
        print(f"stage {s} busy: ort {ob[s]:.3f} s, torch {tb[s]:.3f} s, torch/ort "
              f"{tb[s] / ob[s]:.2f}x")
    print(f"one {args.probe}-token chunk at start {args.seq // 2}, buffer capacity "
          + ", ".join(f"{c}: {t * 1e3:.1f} ms" for c, t in zip(caps, at_capacity)))
    print(f"one {args.probe}-token chunk, capacity {args.seq}, start "
          + ", ".join(f"{s}: {t * 1e3:.1f} ms" for s, t in zip(starts, at_start)))
    print(f"export: 2 stages {split_s:.1f} s, {split_bytes / 1e6:.0f} MB; 1 stage "
          f"{whole_s:.1f} s, {whole_bytes / 1e6:.0f} MB; model weights {weights / 1e6:.0f} MB")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}, onnxruntime {ort.__version__}; load average (1 min) "
          f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
