"""Planner speed and quality on the real cost model (tppc.cost_models), Llama-shaped models.

Run: .venv/bin/python benchmarks/plan_real_costs.py [--quick]

Models are transformers ``LlamaForCausalLM`` built on the meta device in bf16 (no weights),
vocab 32000. Each is captured once the way ``tppc.plan`` does it (two blocks exported, the
layer list re-expanded), priced once per (cluster, L) with ``build_cost_table``, and that one
``CostTable`` serves tppc and every baseline. All latencies are the planner's flow-shop
simulation of the priced table (``plan_for``), as ratios to the plan's lower bound.

Baselines, on an even layer placement (blocks split evenly; embedding on the first stage, the
LM head on the last):
    no split: one chunk (GPipe at batch 1);
    best uniform: every uniform chunk count on the grid, each simulated, the fastest kept;
    TeraPipe DP: TeraPipe's exact DP (``terapipe_dp``) on its own model (the slowest stage's
        time per chunk, no link cost), then simulated.
    SGLang dynamic: SGLang's equal-time chunk rule (see ``Stages.sglang``), first chunk tuned.
Scaling eff.: TTFT(1 device, one chunk) / (stages · TTFT(plan)), next to SGLang's published
76.9 % (8 stages, H20, 128k). ``--quick`` runs only the 70B at 32k (timings and quality row);
``--models 70b --lengths 131072`` a subset.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx
from transformers import LlamaConfig, LlamaForCausalLM

import tppc
from tppc.cost_models.layer_costs import build_cost_table
from tppc.cost_models.table import CostTable
from tppc.frontend.front_end import capture_front_end
from tppc.ir.context import CompileContext
from tppc.planner import plan_for, plan_from_costs, simulate, terapipe_dp
from tppc.planner.dp import chunk_matrix

GRAN = 128
LENGTHS = (4096, 16384, 32768)
HOMO = "8xh100-sxm"
HETERO = "4xh100-sxm+4xa100-80gb"
TIME_LIMIT = 10.0  # tppc.plan's default


@dataclass(frozen=True)
class Shape:
    """A Llama shape: hidden, FFN, blocks, heads, K/V heads (vocab 32000)."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int


LLAMA = {
    "7b": Shape(4096, 11008, 32, 32, 32),
    "13b": Shape(5120, 13824, 40, 40, 40),
    "70b": Shape(8192, 28672, 80, 64, 8),
}


def build(shape: Shape) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """The model on the meta device (bf16) and an example input."""
    cfg = LlamaConfig(vocab_size=32000, hidden_size=shape.hidden,
                      intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model, (torch.randint(0, 1000, (1, 256), device="meta"),)


def capture(model: torch.nn.Module, args: tuple) -> tuple[fx.GraphModule, CompileContext]:
    """Capture as ``tppc.plan`` does: its front end, two blocks exported, the layer list
    re-expanded; the chunk-step graph (what runs, and what is priced) and its context."""
    front = capture_front_end(model, args, {}, seq_dims=None, plan_only=True)
    assert front.truncated is not None, "expected the blocks to be captured once"
    return front.chunk, front.ctx


def price(gm: fx.GraphModule, ctx: CompileContext, cluster: str, seq_len: int) -> CostTable:
    """The cost table, exactly as ``tppc.plan`` builds it."""
    return build_cost_table(gm, ctx.layers, cluster, seq_len, seq_symbol=ctx.seq_symbol,
                            token_count=ctx.token_count)


def even_cuts(table: CostTable) -> tuple[int, ...]:
    """Blocks split evenly over the devices; prologue on the first, epilogue on the last."""
    names = [lc.name for lc in table.layers[0]]
    pro, epi = int(names[0] == "prologue"), int(names[-1] == "epilogue")
    blocks, S = table.num_layers - pro - epi, table.num_devices
    return (0, *(pro + round(i * blocks / S) for i in range(1, S)), table.num_layers)


class Stages:
    """Per-stage chunk-time matrices of one placement on the grid (for fast baselines)."""

    def __init__(self, table: CostTable, cuts: tuple[int, ...], g: int) -> None:
        n = table.seq_len // g
        cache: dict[tuple[int, int], np.ndarray] = {}

        def mat(d: int, layer: int) -> np.ndarray:
            fn = table.layers[d][layer].time
            if (d, id(fn)) not in cache:
                cache[(d, id(fn))] = chunk_matrix(fn, n, g)
            return cache[(d, id(fn))]

        self.g = g
        self.t = [sum(mat(s, j) for j in range(lo, hi))
                  for s, (lo, hi) in enumerate(itertools.pairwise(cuts))]
        sizes = np.maximum(np.arange(n + 1)[None, :] - np.arange(n + 1)[:, None], 0) * g
        self.link = [table.links[s].time(table.layers[s][cuts[s + 1] - 1].act_bytes_per_token
                                         * sizes) for s in range(len(cuts) - 2)]

    def latency(self, bounds: tuple[int, ...]) -> float:
        """Simulated makespan of grid ``bounds``."""
        a, b = np.array(bounds[:-1]), np.array(bounds[1:])
        times = np.stack([t[a, b] for t in self.t])
        links = np.stack([lk[a, b] for lk in self.link]) if self.link else None
        return simulate(times, links).makespan

    def best_uniform(self) -> tuple[int, ...]:
        """Grid bounds of the fastest split into k near-equal chunks, over every k."""
        n = self.t[0].shape[0] - 1
        grids = [tuple(sorted({round(i * n / k) for i in range(k + 1)})) for k in range(1, n + 1)]
        return min(grids, key=self.latency)

    def sglang(self) -> tuple[int, ...]:
        """SGLang's equal-time dynamic chunking (``ChunkSizePredictor``), first chunk tuned.

        Fit the cumulative latency ``f(l) = a·l² + b·l + c`` (here: the slowest stage's time
        for one chunk of ``l`` tokens); each next chunk ``x`` solves ``f(L + x) - f(L) =
        f(base) - f(0)``, is smoothed ``x ← base + 0.75·(x - base)``, floored at ``base / 4``
        and rounded down to a multiple of 64 (here: of the grid step). The first chunk
        ``base`` is tuned over the grid by simulation.
        """
        m = np.max(self.t, axis=0)
        n = m.shape[0] - 1
        ls = np.arange(1, n + 1)
        a, b, c = np.polyfit(ls * float(self.g), m[0, 1:], 2)

        def f(x: float) -> float:
            return a * x * x + b * x + c

        def split(base: int) -> tuple[int, ...]:
            bounds, at, g = [0], 0, self.g
            target = f(base * g) - f(0.0)
            while at < n:
                pos = at * g
                if abs(a) > 0:
                    bb = 2 * a * pos + b
                    x = (-bb + math.sqrt(max(bb * bb + 4 * a * target, 0.0))) / (2 * a)
                else:
                    x = target / b
                x = base * g + 0.75 * (x - base * g) if at else base * g
                x = max(x, base * g / 4)
                step = max(1, int(x // g))
                at = min(n, at + step)
                bounds.append(at)
            return tuple(bounds)

        cands = sorted({max(1, round(n * frac)) for frac in np.geomspace(1 / n, 1, 24)})
        return min((split(k) for k in cands), key=self.latency)

    def terapipe(self) -> tuple[int, ...]:
        """TeraPipe's DP on its own model: slowest stage per chunk, links ignored."""
        m = np.max(self.t, axis=0)
        return terapipe_dp(m, num_stages=len(self.t)).bounds

    def exact_split(self) -> tuple[int, ...]:
        """tppc's split objective for this placement (links in the max term)."""
        m = np.max(self.t, axis=0)
        f = np.max([t + (self.link[s] if s < len(self.link) else 0.0)
                    for s, t in enumerate(self.t)], axis=0)
        return terapipe_dp(m, f, num_stages=len(self.t)).bounds


def tokens(bounds: tuple[int, ...], g: int) -> tuple[int, ...]:
    """Grid bounds to token offsets."""
    return tuple(b * g for b in bounds)


def quality(table: CostTable, g: int) -> dict[str, float]:
    """Latency / lower bound of no split, best uniform, TeraPipe DP and tppc; tppc's timing."""
    L, cuts = table.seq_len, even_cuts(table)
    st = Stages(table, cuts, g)
    t0 = time.perf_counter()
    plan = plan_from_costs(table, granularity=g, time_limit=TIME_LIMIT)
    solve_s = time.perf_counter() - t0
    lb = plan.lower_bound
    nosplit = plan_for(table, cuts, (0, L), granularity=g).latency
    uniform = st.best_uniform()
    uni = plan_for(table, cuts, tokens(uniform, g), granularity=g).latency
    tera = st.terapipe()
    tp = plan_for(table, cuts, tokens(tera, g), granularity=g).latency
    sg = st.sglang()
    sgl = plan_for(table, cuts, tokens(sg, g), granularity=g).latency
    one = sum(float(lc.time(np.array([float(L)]), np.zeros(1))[0]) for lc in table.layers[0])
    assert math.isclose(uni, st.latency(uniform), rel_tol=1e-9)
    return {"nosplit": nosplit / lb, "uniform": uni / lb, "uniform_k": len(uniform) - 1,
            "terapipe": tp / lb, "terapipe_k": len(tera) - 1, "tppc": plan.ratio_to_bound,
            "sglang": sgl / lb, "sglang_k": len(sg) - 1,
            "eff": one / (plan.num_stages * plan.latency), "stages": plan.num_stages,
            "tppc_k": len(plan.boundaries) - 1, "tppc_ms": plan.latency * 1e3,
            "lb_ms": lb * 1e3, "solve_s": solve_s, "status": plan.solver.status,
            "even": cuts == tuple([0, *itertools.accumulate(s.num_layers for s in plan.stages)])}


def whole_call(model: torch.nn.Module, args: tuple, seq_len: int) -> tuple[float, str]:
    """Wall time of one ``tppc.plan`` call and its own phase line (verbose)."""
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        tppc.plan(model, args, cluster=HOMO, seq_len=seq_len, granularity=GRAN, verbose=True)
    dt = time.perf_counter() - t0
    line = next((x for x in err.getvalue().splitlines() if x.startswith("[tppc plan]")), "")
    return dt, line.removeprefix("[tppc plan] ")


def main() -> None:
    """Run the measurements and print markdown tables."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only the 70B at 32k")
    ap.add_argument("--models", default=None, help="comma-separated subset of " + ",".join(LLAMA))
    ap.add_argument("--lengths", default=None, help="comma-separated sequence lengths")
    ns = ap.parse_args()
    quick = ns.quick
    t_start = time.perf_counter()
    model70, args70 = build(LLAMA["70b"])
    dt, phases = whole_call(model70, args70, 32768)  # first: a cold process, like a user's
    print(f"tppc.plan, llama-70b, {HOMO}, L=32768, g={GRAN} (first call in the process): "
          f"{dt:.1f} s ({phases})\n")
    lengths_arg = tuple(int(x) for x in ns.lengths.split(",")) if ns.lengths else LENGTHS
    keys = ns.models.split(",") if ns.models else list(LLAMA)
    runs = [("70b", (32768,))] if quick else [(k, lengths_arg) for k in keys]
    print(f"{HOMO}, g={GRAN}: latency / lower bound; baselines on an even layer placement\n")
    print("| model | L | capture+annotate | costing | solving | no split (GPipe, batch 1) "
          "| best uniform (chunks) | SGLang dynamic (chunks) | TeraPipe DP (chunks) "
          "| tppc (chunks) | tppc latency | lower bound | scaling eff. |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    uneven = False
    for key, lengths in runs:
        model, args = (model70, args70) if key == "70b" else build(LLAMA[key])
        t0 = time.perf_counter()
        gm, ctx = capture(model, args)
        cap = time.perf_counter() - t0
        for L in lengths:
            t0 = time.perf_counter()
            table = price(gm, ctx, HOMO, L)
            cost = time.perf_counter() - t0
            r = quality(table, GRAN)
            mark = "" if r["even"] else " †"
            uneven |= not r["even"]
            hit = " (time limit)" if r["status"] == "time_limit" else ""
            print(f"| {key} | {L} | {cap:.1f} s | {cost:.2f} s | {r['solve_s']:.2f} s{hit} "
                  f"| {r['nosplit']:.3f} | {r['uniform']:.3f} ({r['uniform_k']}) "
                  f"| {r['sglang']:.3f} ({r['sglang_k']}) "
                  f"| {r['terapipe']:.3f} ({r['terapipe_k']}) "
                  f"| {r['tppc']:.3f} ({r['tppc_k']}){mark} | {r['tppc_ms']:.2f} ms "
                  f"| {r['lb_ms']:.2f} ms | {100 * r['eff']:.1f}% ({r['stages']} st.) |")
    if uneven:
        print("\n† tppc chose an uneven placement.")
    if not quick and ns.models is None and ns.lengths is None:
        hetero(gm, ctx)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


def hetero(gm: fx.GraphModule, ctx: CompileContext) -> None:
    """tppc's placement vs an even layer split (best split each), 70B on H100s + A100s."""
    print(f"\n{HETERO}, llama-70b: tppc vs an even layer split (even: the better of its "
          "exact split and its best uniform split, simulated)\n")
    print("| L | even | tppc | speed-up | tppc layers per stage | costing | solving |")
    print("|---|---|---|---|---|---|---|")
    for L in LENGTHS:
        t0 = time.perf_counter()
        table = price(gm, ctx, HETERO, L)
        t1 = time.perf_counter()
        plan = plan_from_costs(table, granularity=GRAN, time_limit=TIME_LIMIT)
        t2 = time.perf_counter()
        cuts = even_cuts(table)
        st = Stages(table, cuts, GRAN)
        even = min(plan_for(table, cuts, tokens(b, GRAN), granularity=GRAN).latency
                   for b in (st.exact_split(), st.best_uniform()))
        layers = ",".join(str(s.num_layers) for s in plan.stages)
        hit = " (time limit)" if plan.solver.status == "time_limit" else ""
        print(f"| {L} | {even * 1e3:.2f} ms | {plan.latency * 1e3:.2f} ms "
              f"| {even / plan.latency:.2f}× | {layers} | {t1 - t0:.2f} s "
              f"| {t2 - t1:.2f} s{hit} |")


if __name__ == "__main__":
    main()
