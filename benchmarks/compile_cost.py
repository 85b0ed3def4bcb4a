"""Compile time with and without translation validation on the prefill benchmark's model.

Model: the Llama-shaped 200 M model of ``pipeline_speed.py`` (24 layers, hidden 768, fp32),
2048 tokens, ``cluster="2xcpu"``, 1 thread. Prints the compile seconds with ``verify=False``
and ``verify=True`` (and ``verify="full"`` with ``--full``: the example length checked too),
side by side in one process, and what ``cp.validation`` recorded.

Run:  .venv/bin/python benchmarks/compile_cost.py [--seq 2048] [--full]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_speed import llama

import tppc

__all__ = ["main"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--full", action="store_true", help="also verify='full'")
    ns = parser.parse_args()
    model = llama(argparse.Namespace(hidden=768, mlp=2048, layers=24, heads=12, kv_heads=4))
    ids = torch.randint(0, 32000, (1, ns.seq))
    torch.set_num_threads(1)
    base = None
    with torch.no_grad():
        for verify in (False, True, "full") if ns.full else (False, True):
            t0 = time.perf_counter()
            cp = tppc.compile(model, (ids,), cluster="2xcpu", verify=verify)
            seconds = time.perf_counter() - t0
            base = base or seconds
            v = cp.validation
            done = "not run" if v is None else (f"{v.seconds:.2f} s, {len(v.runs)} runs at "
                                                f"lengths {v.lengths}")
            print(f"verify={verify!r}: compile {seconds:.2f} s ({seconds / base:.2f}x), "
                  f"validation {done}")


if __name__ == "__main__":
    main()
