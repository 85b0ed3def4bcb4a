"""Re-planning time for new sequence lengths: ``cp.program(L)`` for 100 random lengths.

A pipeline compiled by tppc re-plans every length it has not seen (cost table at that
length, split and placement, partition into stages). Model: transformers' Llama from
``tppc.examples.hf_llama`` (4 layers) on ``2xcpu``; lengths: 100 random integers in
[16, 32768] (seeded), a quarter of them primes. Reported: min / median / max seconds and
the grid (granularity) used for the slowest length. Goal (issue 8): ≤ 2 s each.

Run:  .venv/bin/python benchmarks/replan.py [--count 100] [--max-len 32768]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import tppc
from tppc import examples

__all__ = ["main"]


def _primes_below(n: int) -> list[int]:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(sieve[i * i::i]))
    return [i for i, p in enumerate(sieve) if p]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=32768)
    ns = parser.parse_args()
    rng = random.Random(0)
    primes = [p for p in _primes_below(ns.max_len) if p >= 16]
    lengths = [rng.randint(16, ns.max_len) for _ in range(ns.count - ns.count // 4)]
    lengths += rng.sample(primes, ns.count // 4)
    model, args, kwargs = examples.hf_llama(seq_len=64, layers=4)
    cp = tppc.compile(model, args, kwargs, cluster="2xcpu", executor="local",
                      program_cache=ns.count + 1)
    times = []
    for length in lengths:
        t0 = time.perf_counter()
        cp.program(length)
        times.append((time.perf_counter() - t0, length))
    worst, at = max(times)
    plan = cp.program(at).plan
    print(f"# {platform.machine()}, Python {platform.python_version()}; {ns.count} lengths in "
          f"[16, {ns.max_len}], {ns.count // 4} primes")
    print(f"re-plan seconds: min {min(times)[0]:.3f}  median "
          f"{statistics.median(t for t, _ in times):.3f}  max {worst:.3f} (L={at}, granularity "
          f"{plan.granularity}, {len(plan.boundaries) - 1} chunks, {plan.num_stages} stages)")


if __name__ == "__main__":
    main()
