"""Prefill speed with a padded batch and with a mixture-of-experts model (issue 9).

Two workloads, each measured side by side in one process with alternating repetitions:
    padded: a Llama-shaped model (hidden 512, 8 layers, MLP 1536, vocab 32000) on a batch of
        4 prompts of different lengths, left-padded to ``--seq`` tokens (``attention_mask``).
    moe: a Mixtral-shaped model (hidden 512, 4 layers, 8 experts of MLP 1024, top-2,
        transformers' default ``grouped_mm`` experts) on one sequence of ``--seq`` tokens.
eager: ``model(...)`` with ``torch.set_num_threads(1)``; tppc: ``cluster="2xcpu"``, threads
executor, one intra-op thread per stage, the planner's chunks; with ``--granularity G`` a
third run uses chunks that are multiples of G tokens (same cut rule), alternating with both.

Run:  .venv/bin/python benchmarks/masks_moe_speed.py [--seq 512] [--reps 5] [--granularity 128]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from tppc.dispatch.compile import compile_pipeline


def padded(seq: int) -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=8192, attn_implementation="sdpa")
    ids = torch.randint(0, 32000, (4, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, seq, dtype=torch.long)
    for row, pad in enumerate((0, seq // 8, seq // 4, seq // 2)):
        mask[row, :pad] = 0
    return LlamaForCausalLM(cfg).eval(), (ids,), {"attention_mask": mask}


def moe(seq: int) -> tuple[torch.nn.Module, tuple, dict]:
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                        num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=8192, attn_implementation="sdpa")
    ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(1))
    return MixtralForCausalLM(cfg).eval(), (ids,), {}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench(name: str, model: torch.nn.Module, args: tuple, kwargs: dict, reps: int,
          granularity: int | None = None) -> None:
    t0 = time.perf_counter()
    cps = {"planner's chunks": compile_pipeline(model, args, kwargs, cluster="2xcpu",
                                                executor="threads", num_stages=2,
                                                threads_per_stage=1)}
    compile_s = time.perf_counter() - t0
    if granularity:
        cps[f"granularity {granularity}"] = compile_pipeline(
            model, args, kwargs, cluster="2xcpu", executor="threads", num_stages=2,
            threads_per_stage=1, granularity=granularity)
    with torch.no_grad():
        want = model(*args, **kwargs).logits
        diff = max((cp(*args, **kwargs).logits - want).abs().max().item() for cp in cps.values())
        eager, piped = [], {label: [] for label in cps}
        for _ in range(reps):
            eager.append(timed(lambda: model(*args, **kwargs)))
            for label, cp in cps.items():
                piped[label].append(timed(lambda cp=cp: cp(*args, **kwargs)))
    params = sum(t.numel() for t in model.parameters()) / 1e6
    print(f"\n{name}: {params:.0f} M params, input {tuple(args[0].shape)}, compile "
          f"{compile_s:.1f} s, max |logits - eager| = {diff:.2e}")
    print(f"  {'eager, 1 core':<44} min {min(eager):7.3f} s   median "
          f"{statistics.median(eager):7.3f} s")
    for label, cp in cps.items():
        ts = piped[label]
        print(f"  tppc 2x1 core, {label:<29} min {min(ts):7.3f} s   median "
              f"{statistics.median(ts):7.3f} s   eager/tppc median "
              f"{statistics.median(eager) / statistics.median(ts):.2f}x (min "
              f"{min(eager) / min(ts):.2f}x); predicted {cp.plan.latency:.3f} s; chunks "
              f"{cp.plan.chunk_sizes}, stages "
              f"{[(s.layer_start, s.layer_end) for s in cp.plan.stages]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--granularity", type=int, default=None,
                   help="also run a pipeline whose chunks are multiples of this many tokens")
    args = p.parse_args()
    load = os.getloadavg()[0]
    torch.set_num_threads(1)
    bench("padded batch of 4 prompts (Llama-shaped)", *padded(args.seq), args.reps, args.granularity)
    bench("Mixtral-shaped MoE (grouped_mm experts)", *moe(args.seq), args.reps, args.granularity)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}; load average (1 min) {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
