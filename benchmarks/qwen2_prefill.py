"""Prefill of a model tppc was not tuned to: a Qwen2-shaped model, 2 stages x 1 thread vs eager.

Model: transformers ``Qwen2ForCausalLM`` from a config (random weights, fp32, SDPA): 8 layers,
hidden 512, vocab 32000, and the other fields like Qwen2-0.5B scaled down: 8 heads / 2 K/V
heads (head dim 64, GQA 4:1), intermediate 1408 (2.75 x hidden; Qwen2-0.5B has 4864 / 896 =
5.4), q/k/v biases (Qwen2's), untied embeddings, rope theta 1e6, RMSNorm eps 1e-6: 55.3 M
parameters (the embedding and the 512 x 32000 LM head 16.4 M each). One sequence of 2048 tokens.

Measured side by side in one process, repetitions interleaved so all three see the same noise:
    eager:    ``model(ids)`` with ``torch.set_num_threads(1)``.
    tppc:     ``tppc.compile(model, (ids,), cluster="2xcpu", executor="threads",
              threads_per_stage=1)``: default planning (stages and chunks from the planner).
    serial:   the same compiled program run on the calling thread (``executor="local"``):
              the chunked work without any overlap; ``serial / eager`` is what chunking costs.

Also printed: the plan summary, ``cp.profile`` per stage (busy, predicted), per-chunk busy
times, and the ideal pipeline time ``serial / 2`` (what 2 stages could reach with no fill,
drain nor imbalance), so the gap to 2.0x splits into chunking, balance and fill/drain.

Run:  flock -x /tmp/tppc_cpu.lock .venv/bin/python benchmarks/qwen2_prefill.py [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import tppc


def qwen2(layers: int = 8) -> Qwen2ForCausalLM:
    """The Qwen2-shaped model of this benchmark (random weights, seed 0)."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).eval()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def per_stage(trace: list[tuple[int, int, float, float]], stages: int) -> list[float]:
    return [sum(t[3] - t[2] for t in trace if t[0] == s) for s in range(stages)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--verify", action="store_true", help="translation validation at compile")
    args = p.parse_args()

    load_before = os.getloadavg()
    torch.set_num_threads(1)
    model = qwen2(args.layers)
    ids = torch.randint(0, 32000, (1, args.seq), generator=torch.Generator().manual_seed(1))
    params = sum(t.numel() for t in model.parameters())
    t0 = time.perf_counter()
    cp = tppc.compile(model, (ids,), cluster="2xcpu", executor="threads",
                      threads_per_stage=1, verify=args.verify)
    compile_s = time.perf_counter() - t0
    print(cp.plan.summary())
    with torch.no_grad():
        expected = model(ids).logits
        diff = (cp(ids).logits - expected).abs().max().item()
        diff_local = (cp.run((ids,), executor="local").logits - expected).abs().max().item()
        prof = cp.profile(ids)
        eager, piped, serial, busy = [], [], [], []
        for _ in range(args.reps):
            eager.append(timed(lambda: model(ids)))
            piped.append(timed(lambda: cp(ids)))
            busy.append(per_stage(cp.last_trace, cp.plan.num_stages))
            serial.append(timed(lambda: cp.run((ids,), executor="local")))
    print(f"\nQwen2-shaped, {params / 1e6:.1f} M params, {args.seq} tokens, fp32, compile "
          f"{compile_s:.1f} s, max |logits - eager| = {diff:.2e} (threads), {diff_local:.2e} "
          "(local)")
    print("\ncp.profile (one call):")
    print(prof.table())
    for s in range(cp.plan.num_stages):
        jobs = [j for j in prof.jobs if j.stage == s]
        print(f"stage {s} chunks (tokens: measured / predicted ms): " + ", ".join(
            f"{j.tokens[1] - j.tokens[0]}@{j.tokens[0]}: "
            f"{(j.measured_end - j.measured_start) * 1e3:.0f}/"
            f"{(j.predicted_end - j.predicted_start) * 1e3:.0f}" for j in jobs))
    med = statistics.median
    e, t, s = med(eager), med(piped), med(serial)
    busy_med = [med(b[i] for b in busy) for i in range(cp.plan.num_stages)]
    print(f"\n{'eager, 1 thread':<44} min {min(eager):7.3f} s   median {e:7.3f} s")
    print(f"{'tppc threads, 2 stages x 1 thread':<44} min {min(piped):7.3f} s   median {t:7.3f} s")
    print(f"{'chunked program serial (executor=local)':<44} min {min(serial):7.3f} s   "
          f"median {s:7.3f} s")
    print(f"speed-up eager/tppc: median {e / t:.3f}x (min {min(eager) / min(piped):.3f}x)")
    print(f"chunking cost serial/eager: {s / e:.3f}; concurrent stage busy (median) "
          f"{[round(b, 3) for b in busy_med]} s, sum / eager {sum(busy_med) / e:.3f}")
    print(f"ideal 2-stage time serial/2 = {s / 2:.3f} s -> {2 * e / s:.3f}x; "
          f"pipeline / (serial/2) = {t / (s / 2):.3f} (fill, drain, imbalance, concurrency)")
    print(f"chunks: {cp.plan.chunk_sizes}; predicted latency {cp.plan.latency:.3f} s")
    print(f"load average (1/5/15 min) before {tuple(round(x, 2) for x in load_before)}, "
          f"after {tuple(round(x, 2) for x in os.getloadavg())}; {os.cpu_count()} cpus, "
          f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
