"""Prefill of a recurrent model through the token pipeline: tppc (2 stages) vs eager on 1 and 2 threads.

Model (our own, random weights, fp32): 8 blocks of a gated linear recurrence in log space
(minGRU's parallel form: ``cumsum`` + ``logcumsumexp`` over the tokens, one state row per
scan) after a causal depthwise short convolution (kernel 4, Mamba's), hidden 512, expanded
channels 1024, an MLP of 2048, vocab 32000: a Mamba2-shaped block without the block scan
transformers writes (which tppc refuses, docs/refusals.md). One sequence of 8192 tokens.

Measured side by side in one process, repetitions interleaved:
    eager-1t / eager-2t: ``model(ids)`` with ``torch.set_num_threads(1)`` / ``(2)``.
    tppc:    ``tppc.compile(model, (ids,), cluster="2xcpu", executor="threads",
             threads_per_stage=1)``: default planning (stages and chunks from the planner),
             each stage carrying its layers' states from chunk to chunk.

Run:  flock -x /tmp/tppc_cpu.lock .venv/bin/python benchmarks/recurrent_prefill.py [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import tppc
from tppc.examples.models.scan import ScanBlock

D, E, FF, K, VOCAB = 512, 1024, 2048, 4, 32000


class ScanLM(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList(ScanBlock(D, E, FF, K) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    model = ScanLM(args.layers).eval()
    ids = torch.randint(0, VOCAB, (1, args.seq))
    t0 = time.perf_counter()
    cp = tppc.compile(model, (ids,), cluster="2xcpu", executor="threads", threads_per_stage=1)
    print(f"compile {time.perf_counter() - t0:.1f} s")
    print(cp.plan.summary())
    results: dict[str, list[float]] = {"eager-1t": [], "eager-2t": [], "tppc": []}
    with torch.inference_mode():
        want = model(ids)
        got = cp(ids)
        print(f"max |tppc - eager| = {(got - want).abs().max().item():.3g}")
        for _ in range(args.reps):
            for name in results:
                torch.set_num_threads(2 if name == "eager-2t" else 1)
                results[name].append(timed(lambda n=name: model(ids) if n != "tppc"
                                           else cp(ids)))
    for name, times in results.items():
        print(f"{name:9s} median {statistics.median(times):.3f} s  "
              f"(runs {', '.join(f'{t:.3f}' for t in times)})")
    base = statistics.median(results["eager-1t"])
    print(f"speed-up vs eager-1t: eager-2t {base / statistics.median(results['eager-2t']):.2f}x,"
          f" tppc {base / statistics.median(results['tppc']):.2f}x")


if __name__ == "__main__":
    main()
