"""Prefill speed of one sequence: a 2-stage token pipeline on 2 cores vs eager on 1 core.

Model: a Llama-shaped ``LlamaForCausalLM`` (random weights, fp32, SDPA) of ~200 M parameters
(hidden 768, 24 layers, 12 heads / 4 K/V heads, MLP 2048, vocab 32000) at 2048 tokens. 24
layers rather than 12 because stages are cut between layers and the LM head (768 x 32000)
costs about 4 blocks: with 12 blocks the best cut leaves one stage ~6 % above the mean, with
24 blocks ~4 %. ``--layers 12`` gives the 125 M model.

Measured side by side in one process, alternating repetitions so both see the same noise:
    eager:    ``model(ids)`` with ``torch.set_num_threads(1)``.
    tppc:     ``tppc.compile(..., cluster="2xcpu", executor="threads", threads_per_stage=1)``;
              two workers, one intra-op thread each, chunk plan from the planner (or --chunks).
    gpipe:    (``--gpipe``) ``torch.distributed.pipelining`` ScheduleGPipe, 2 ranks (gloo, one
              thread each), batch 1 = one microbatch: it cannot split one sequence.

Reported: min and median seconds, the speed-up (eager / tppc), the measured bubble
``1 - Σ_s busy_s / (S · makespan)`` of the threads executor, and the load average before and
after (the two cores are shared: compare runs started at a load below 1).

Run:  .venv/bin/python benchmarks/pipeline_speed.py [--seq 2048] [--reps 5] [--chunks 8]
          [--cut 9] [--gpipe]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tppc.dispatch.compile import compile_pipeline
from tppc.planner.manual import manual_plan


def llama(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.mlp,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=8192,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bubble(trace: list[tuple[int, int, float, float]], stages: int) -> tuple[float, list[float]]:
    start = min(t[2] for t in trace)
    makespan = max(t[3] for t in trace) - start
    busy = [sum(t[3] - t[2] for t in trace if t[0] == s) for s in range(stages)]
    return 1.0 - sum(busy) / (stages * makespan), busy


def gpipe_time(args: argparse.Namespace, reps: int) -> list[float]:
    """GPipe on 2 ranks (spawned processes), batch 1; returns rank 0's times."""
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_gpipe_rank, args=(args, reps, queue), nprocs=2, join=True)
    return queue.get()


def _gpipe_rank(rank: int, args: argparse.Namespace, reps: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = llama(args)
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1))

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids, use_cache=False).logits

    cut = f"inner.model.layers.{args.layers // 2}"
    pipe = pipeline(Logits(model), mb_args=(ids,), split_spec={cut: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=1)
    times = []
    with torch.no_grad():
        for _ in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            schedule.step(ids) if rank == 0 else schedule.step()
            dist.barrier()
            times.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put(times[1:])
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--mlp", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunks", type=int, default=None, help="equal chunks (default: planner)")
    p.add_argument("--cut", type=int, default=None,
                   help="stage 1 starts at this layer (prologue = layer 0); with --chunks, "
                        "skips the planner")
    p.add_argument("--cluster", default="2xcpu")
    p.add_argument("--gpipe", action="store_true")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    load_before = os.getloadavg()[0]
    torch.set_num_threads(1)
    model = llama(args)
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1))
    params = sum(t.numel() for t in model.parameters())
    t0 = time.perf_counter()
    plan = None
    if args.cut is not None:
        chunks = args.chunks or 8
        bounds = tuple(round(i * args.seq / chunks) for i in range(chunks + 1))
        plan = manual_plan(args.layers + 2, args.seq, cuts=(0, args.cut, args.layers + 2),
                           boundaries=bounds)
    cp = compile_pipeline(model, (ids,), cluster=args.cluster, executor="threads",
                          num_stages=2, threads_per_stage=1, chunks=args.chunks, plan=plan)
    compile_s = time.perf_counter() - t0
    print(cp.plan.summary())
    with torch.no_grad():
        expected = model(ids).logits
        diff = (cp(ids).logits - expected).abs().max().item()
        eager, piped, bubbles, busy = [], [], [], []
        for _ in range(args.reps):
            eager.append(timed(lambda: model(ids)))
            piped.append(timed(lambda: cp(ids)))
            b, per_stage = bubble(cp._executors["threads"].last_trace, 2)
            bubbles.append(b)
            busy.append(per_stage)
    gpipe = gpipe_time(args, args.reps) if args.gpipe else []
    rows = [("eager, 1 core", eager), ("tppc threads, 2 stages x 1 core", piped)]
    rows += [("GPipe (torch.distributed.pipelining), 2 ranks, batch 1", gpipe)] if gpipe else []
    print(f"\nLlama-shaped, {params / 1e6:.0f} M params, {args.seq} tokens, fp32, "
          f"compile {compile_s:.1f} s, max |logits - eager| = {diff:.2e}")
    for name, ts in rows:
        print(f"{name:<56} min {min(ts):7.3f} s   median {statistics.median(ts):7.3f} s")
    print(f"speed-up eager/tppc: min {min(eager) / min(piped):.2f}x, "
          f"median {statistics.median(eager) / statistics.median(piped):.2f}x")
    print(f"measured bubble: median {statistics.median(bubbles):.3f} "
          f"(stage busy s: {[round(x, 3) for x in busy[bubbles.index(min(bubbles))]]})")
    print(f"chunks: {cp.plan.chunk_sizes}; stages: "
          f"{[(s.layer_start, s.layer_end) for s in cp.plan.stages]}; "
          f"predicted latency {cp.plan.latency:.3f} s")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}; load average (1 min) {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"eager": eager, "tppc": piped, "gpipe": gpipe, "bubble": bubbles,
                       "chunks": cp.plan.chunk_sizes, "diff": diff}, f, indent=1)


if __name__ == "__main__":
    main()
