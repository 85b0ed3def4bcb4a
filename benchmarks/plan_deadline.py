"""``tppc.plan(time_limit=T)`` of a 70B Llama is a deadline: everything after capture in 2T.

Run: PYTHONPATH=. .venv/bin/python benchmarks/plan_deadline.py [--lengths 32768,524288]
[--limits 1,5]

The model is transformers' ``LlamaForCausalLM`` with Llama-2-70B's shape built on the meta
device in bf16 (``plan_real_costs.build``), planned on 8×H100 SXM at each length with the
default granularity. Each row is one ``tppc.plan`` call in this process (the first one also
pays the imports' warm-up, so a warm-up call runs first): its wall time, its capture, its
costing (building the cost table) and solving (the rest of planning), as ``verbose=True``
prints them, the status of the plan, and whether ``costing + solving <= 2 T``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_real_costs import HOMO, LLAMA, build

import tppc


def one_call(model, args, seq_len: int, limit: float) -> dict[str, float | str]:
    """Wall time and the phases of one ``tppc.plan`` call (from its verbose line)."""
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        plan = tppc.plan(model, args, cluster=HOMO, seq_len=seq_len, time_limit=limit,
                         verbose=True)
    wall = time.perf_counter() - t0
    line = next(x for x in err.getvalue().splitlines() if x.startswith("[tppc plan]"))
    numbers = dict(re.findall(r"(capture\+annotate|costing|solving) ([0-9.]+) s", line))
    return {"wall": wall, "capture": float(numbers["capture+annotate"]),
            "costing": float(numbers["costing"]), "solving": float(numbers["solving"]),
            "status": plan.solver.status, "stages": plan.num_stages,
            "latency_ms": plan.latency * 1e3}


def main() -> None:
    """Print one markdown row per (length, time limit)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32768,524288")
    ap.add_argument("--limits", default="1,5")
    ns = ap.parse_args()
    model, args = build(LLAMA["70b"])
    tppc.plan(model, args, cluster=HOMO, seq_len=4096, time_limit=1)  # warm-up
    print("| L | T | tppc.plan wall | capture | costing | solving | costing+solving ≤ 2T | "
          "status | stages | latency |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in map(int, ns.lengths.split(",")):
        for limit in map(float, ns.limits.split(",")):
            r = one_call(model, args, length, limit)
            after = r["costing"] + r["solving"]
            print(f"| {length} | {limit:g} s | {r['wall']:.2f} s | {r['capture']:.2f} s | "
                  f"{r['costing']:.2f} s | {r['solving']:.2f} s | {after:.2f} s "
                  f"{'yes' if after <= 2 * limit else 'NO'} | {r['status']} | {r['stages']} | "
                  f"{r['latency_ms']:.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
