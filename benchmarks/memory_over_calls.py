"""Resident memory over many calls whose length changes every few hundred calls (issue 30).

Model: the own GPT (``tppc.examples.gpt``: 4 blocks, hidden 64, vocab 256), compiled with
two stages on the ``local`` executor and the default ``program_cache`` (8 programs). The
calls cycle through ``--lengths`` distinct lengths, a new one every ``--every`` calls, so the
program cache evicts and re-plans all along (``--lengths`` > 8). Every ``--report`` calls
the script prints the call count, the resident set (``/proc/self/statm``) and the records
held in the capture's ``ctx.history``. The first new length after the warm-up is the
baseline; the growth from there to the end is what the bound is about.

Run:  .venv/bin/python benchmarks/memory_over_calls.py [--calls 10000] [--every 200]
"""

from __future__ import annotations

import argparse
import gc
import resource

__all__ = ["run"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run(calls: int, every: int, lengths: int, report: int) -> list[tuple[int, float, int]]:
    """The curve: ``(calls done, RSS MB, history records)`` every ``report`` calls."""
    import torch

    import tppc
    from tppc import examples

    torch.set_num_threads(1)
    model, (ids,), _ = examples.gpt(seq_len=32)
    cp = tppc.compile(model, (ids,), num_stages=2, executor="local")
    sizes = [16 + 3 * i for i in range(lengths)]
    inputs = {n: torch.randint(0, 256, (1, n)) for n in sizes}
    curve = []
    with torch.no_grad():
        for k in range(calls):
            cp(inputs[sizes[(k // every) % lengths]])
            if (k + 1) % report == 0:
                gc.collect()
                curve.append((k + 1, _rss_mb(), len(cp.history)))
                print(f"{k + 1:>6} calls  RSS {curve[-1][1]:8.1f} MB  history "
                      f"{curve[-1][2]:>5} records", flush=True)
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--lengths", type=int, default=20)
    parser.add_argument("--report", type=int, default=500)
    ns = parser.parse_args()
    curve = run(ns.calls, ns.every, ns.lengths, ns.report)
    base = curve[0][1]
    print(f"growth from {curve[0][0]} to {curve[-1][0]} calls: {curve[-1][1] - base:+.1f} MB "
          f"(max {max(r for _, r, _ in curve) - base:+.1f} MB)")


if __name__ == "__main__":
    main()
