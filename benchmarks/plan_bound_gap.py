"""Issue 20's planner rows: each plan's latency / its lower bound, and the time to find it.

Rows (default settings: ``time_limit=10``, the default granularity):

- PixArt-α's transformer (diffusers' ``PixArtTransformer2DModel``, PixArt-XL-2-1024-MS's
  config, fp16 on the meta device, batch 2) at 1024 px on 4 and 8 A100s and at 4096 px on 8,
  ``Workload(kind="diffusion", steps=20, warmup_steps=1)``, planned on all the devices as
  ``benchmarks/gpu_fidelity.py`` plans it (``plan_any_length`` on the captured front end);
- transformers' ``LlamaForCausalLM`` with Llama-2-70B's shape (bf16, meta) at 524288 tokens
  on 8×H100 SXM, ``logits_to_keep=1``, through ``tppc.plan`` (the planner chooses the
  devices).

Each row is one planning call after a warm-up call in this process; "plan" is its time
after capture (costing + solving, what ``time_limit`` bounds).

    flock -x /tmp/tppc_cpu.lock .venv/bin/python benchmarks/plan_bound_gap.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import platform
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from plan_real_costs import LLAMA, build

import tppc
from tppc.cost_models.layer_costs import build_cost_table
from tppc.planner.grid import plan_any_length
from tppc.planner.workload import Workload

WORKLOAD = Workload(kind="diffusion", steps=20, warmup_steps=1)


def pixart_plan(pixels: int, cluster: str) -> tuple[float, object]:
    """``(seconds, plan)``: PixArt-α at ``pixels`` px planned as ``gpu_fidelity`` plans it
    (the front end captured once at 1024 px, batch 2, priced at the resolution's token
    count; granularity one patch row: what ``tppc.plan`` uses for a DiT), on every device."""
    from gpu_fidelity import pixart_front

    front = pixart_front()
    ctx = front.ctx
    tokens, per_row = (pixels // 16) ** 2, pixels // 16
    t0 = time.perf_counter()
    plan = plan_any_length(
        lambda n: build_cost_table(front.chunk, ctx.layers, cluster, n,
                                   seq_symbol=ctx.seq_symbol, token_count=ctx.token_count),
        tokens, granularity=per_row, num_stages=int(cluster.split("x")[0]), workload=WORKLOAD)
    return time.perf_counter() - t0, plan


def llama_plan(model, ids) -> tuple[float, object]:
    """``(seconds after capture, plan)`` of one verbose ``tppc.plan`` call (70B, 512k)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        plan = tppc.plan(model, ids, {"logits_to_keep": 1}, cluster="8xh100-sxm",
                         seq_len=524288, verbose=True)
    line = next(x for x in err.getvalue().splitlines() if x.startswith("[tppc plan]"))
    return float(re.search(r"costing\+solving ([0-9.]+) s", line).group(1)), plan


def rows():
    """``(name, run)`` of the issue's rows; ``run()`` gives ``(seconds, plan)``."""
    llama, ids = build(LLAMA["70b"])
    return [
        ("PixArt 1024 px, 4xa100-pcie", lambda: pixart_plan(1024, "4xa100-pcie")),
        ("PixArt 1024 px, 8xa100-pcie", lambda: pixart_plan(1024, "8xa100-pcie")),
        ("PixArt 1024 px, 8xa100-80gb", lambda: pixart_plan(1024, "8xa100-80gb")),
        ("PixArt 4096 px, 8xa100-pcie", lambda: pixart_plan(4096, "8xa100-pcie")),
        ("Llama-70B 524288 tokens, 8xh100-sxm", lambda: llama_plan(llama, ids)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="", help="substring of the row names to run")
    ns = ap.parse_args()
    print(f"# {platform.node()}, {platform.machine()}, Python {platform.python_version()}, "
          f"torch {torch.__version__}; median of {ns.repeat}")
    print("| row | latency | lower bound | ratio | stages | chunks | plan (after capture) "
          "| status |")
    print("|---|---|---|---|---|---|---|---|")
    for name, run in rows():
        if ns.only not in name:
            continue
        run()  # warm-up (imports, capture, caches)
        runs = [run() for _ in range(ns.repeat)]
        plan = runs[-1][1]
        print(f"| {name} | {plan.latency * 1e3:.2f} ms | {plan.lower_bound * 1e3:.2f} ms | "
              f"{plan.latency / plan.lower_bound:.3f} | {plan.num_stages} | "
              f"{len(plan.boundaries) - 1} | {statistics.median(r[0] for r in runs):.2f} s | "
              f"{plan.solver.status} |",
              flush=True)


if __name__ == "__main__":
    main()
