"""Prefill latency and memory of the distributed backend vs the threads backend vs eager.

Model: the Llama-shaped ``LlamaForCausalLM`` of ``benchmarks/pipeline_speed.py`` (random
weights, fp32, SDPA; default 12 layers, hidden 768, vocab 32000: ~125 M parameters) at 1024
tokens, written once to a safetensors checkpoint.

Measured in one run (repetitions alternate eager / threads; the distributed job follows):
    eager:        ``model(ids)``, ``torch.set_num_threads(1)``, in this process.
    threads:      ``tppc.compile(..., executor="threads", threads_per_stage=1)``, 2 stages.
    distributed:  ``tppc.launch(FACTORY, 2, checkpoint=..., repeat=R)``: 2 processes x 1
                  thread (gloo), each holding only its stage; times are rank 0's per call
                  (input broadcast and the logits' transfer to rank 0 included).
    memory:       peak RSS of each rank of the 2-rank job vs a 1-rank job of the same code
                  (one process holding the whole model), and the bytes of weights each holds.

Run:  PYTHONPATH=. .venv/bin/python benchmarks/distributed_speed.py [--seq 1024] [--reps 3]
          [--layers 12] [--chunks 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

FACTORY = "benchmarks.distributed_speed:llama_shaped"


def llama_shaped(seq: int = 1024, layers: int = 12, hidden: int = 768, mlp: int = 2048,
                 heads: int = 12, kv_heads: int = 4) -> tuple:
    """The benchmark model and its example input (a ``MODULE:FACTORY`` for ``tppc.run``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=mlp,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=8192,
                      attn_implementation="sdpa")
    ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(1))
    return LlamaForCausalLM(cfg).eval(), (ids,), {}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    import tppc
    from tppc.distributed.checkpoint import save_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    torch.set_num_threads(1)
    fkw = {"seq": args.seq, "layers": args.layers}
    model, (ids,), _ = llama_shaped(**fkw)
    work = Path(tempfile.mkdtemp(prefix="tppc-bench-"))
    ckpt = save_checkpoint(model, work / "model.safetensors")
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    cp = tppc.compile(model, (ids,), executor="threads", num_stages=2, threads_per_stage=1,
                      chunks=args.chunks)
    with torch.no_grad():
        expected = model(ids).logits
        eager, threads = [], []
        for _ in range(args.reps):
            eager.append(timed(lambda: model(ids)))
            threads.append(timed(lambda: cp(ids)))
    cuts = [(s.layer_start, s.layer_end) for s in cp.plan.stages]
    busy_threads = [sum(b - a for st, _, a, b in cp.last_trace if st == s) for s in range(2)]
    cp = None  # frees the threads pipeline before the jobs start
    common = dict(checkpoint=ckpt, inputs={"args.0": ids}, factory_kwargs=json.dumps(fkw),
                  chunks=args.chunks, threads=1, timeout=900)
    job = tppc.launch(FACTORY, 2, repeat=args.reps + 1, **common)
    dist_times = job.reports[0]["times"][1:]  # the first call warms up
    diff = (job.outputs["out.0"] - expected).abs().max().item()
    single = tppc.launch(FACTORY, 1, repeat=1, **common)
    rows = [("eager, 1 process x 1 thread", eager),
            ("tppc threads, 2 stages x 1 thread (1 process)", threads),
            ("tppc distributed, 2 ranks x 1 thread (gloo)", dist_times)]
    print(f"Llama-shaped {args.layers} layers, {weights / 2**20:.0f} MiB fp32 weights, "
          f"{args.seq} tokens, {args.chunks} chunks; max |logits - eager| = {diff:.2e}")
    med_eager = statistics.median(eager)
    for name, ts in rows:
        print(f"{name:<48} min {min(ts):7.3f} s  median {statistics.median(ts):7.3f} s  "
              f"eager/this {med_eager / statistics.median(ts):.2f}x")
    whole = single.reports[0]
    grown = whole["rss_peak_mib"] - whole["rss_start_mib"]
    print(f"1-rank job (whole model): weights {whole['weights_bytes'] / 2**20:.0f} MiB, peak "
          f"RSS {whole['rss_peak_mib']:.0f} MiB, of which {grown:.0f} MiB after start-up")
    for r in job.reports:
        mine = r["rss_peak_mib"] - r["rss_start_mib"]
        print(f"rank {r['rank']}: layers {r['layers'][0]}..{r['layers'][-1]}, weights "
              f"{r['weights_bytes'] / 2**20:.0f} MiB, peak RSS {r['rss_peak_mib']:.0f} MiB "
              f"({r['rss_peak_mib'] / whole['rss_peak_mib']:.2f}x the 1-rank job), "
              f"{mine:.0f} MiB after start-up ({mine / grown:.2f}x)")
    busy = [sum(b - a for _, _, a, b in r["trace"]) for r in job.reports]
    start, end = job.reports[0]["calls"][-1]
    tail = end - max(b for _, _, _, b in job.reports[-1]["trace"])
    print(f"last call: stage busy threads {busy_threads[0]:.2f} / {busy_threads[1]:.2f} s, "
          f"distributed {busy[0]:.2f} / {busy[1]:.2f} s of {end - start:.2f} s; rank 0 had "
          f"the outputs {tail * 1e3:.0f} ms after the last rank's last chunk")
    print(f"threads-backend cuts {cuts}; distributed compile {job.reports[0]['compile_s']:.1f} s")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}; load average (1 min) {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"eager": eager, "threads": threads, "distributed": dist_times, "diff": diff,
             "ranks": job.reports, "single": whole}, indent=1))


if __name__ == "__main__":
    main()
