"""What translation validation costs: ``cp.validation.seconds`` against the whole compile.

``tppc.compile`` replays the emitted program against the captured graph before returning it
(:mod:`tppc.validation.validate`): the compiled program on the example, a two-stage program in
2-3 chunks on the example and on a probe length. Models: the project's GPT, transformers'
Llama (``tppc.examples.hf_llama``) and the project's DiT, each compiled ``--repeat`` times
on ``2xcpu`` with the ``local`` executor. Reported per model: median compile seconds
(validation included), median validation seconds, their ratio, and what was checked.

Run:  .venv/bin/python benchmarks/validation_cost.py [--repeat 3] [--tokens 256]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import tppc
from tppc import examples

__all__ = ["main"]


def _models(tokens: int) -> dict[str, tuple]:
    side = 2 * int(tokens**0.5)  # a latent of side s has (s/2)^2 patches of 2x2
    return {
        f"GPT (4 blocks, hidden 64), {tokens} tokens": examples.gpt(seq_len=tokens, n_layer=4),
        f"HF Llama (4 layers, hidden 64), {tokens} tokens": examples.hf_llama(seq_len=tokens,
                                                                             layers=4),
        f"DiT (4 blocks, hidden 64), {(side // 2) ** 2} patches": examples.dit(size=side,
                                                                                 depth=4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    ns = parser.parse_args()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.2f}; median of {ns.repeat}")
    print("| model | compile s (validation included) | validation s | share | checked |")
    print("|---|---|---|---|---|")
    for name, (model, args, kwargs) in _models(ns.tokens).items():
        totals, checks = [], []
        validation = None
        for _ in range(ns.repeat):
            t0 = time.perf_counter()
            cp = tppc.compile(model, args, kwargs, cluster="2xcpu", executor="local")
            totals.append(time.perf_counter() - t0)
            validation = cp.validation
            checks.append(validation.seconds)
        total, check = statistics.median(totals), statistics.median(checks)
        runs = ", ".join(f"L={r.length} {len(r.chunks)}ch/{len(r.stages)}st"
                         for r in validation.runs)
        print(f"| {name} | {total:.2f} | {check:.2f} | {check / total:.0%} | {runs}; "
              f"max diff {validation.max_diff:.1e} |")


if __name__ == "__main__":
    main()
