"""Dynamic balancing on the 2-core machine: one stage's core shared with a co-running load.

A 2-stage ``threads`` pipeline (one intra-op thread per stage; stage ``s``'s worker pinned to
core ``s`` with ``os.sched_setaffinity`` as it starts) prefills a Llama-shaped causal LM
(random weights, fp32, SDPA). Then a busy loop pinned with ``taskset -c 1`` shares stage 1's
core, and three programs are timed side by side, alternating repetitions so they see the same
noise:

    idle plan:   the plan made for the idle machine (``cp.with_plan(cp.plan)`` before the
                 load starts), run under the load;
    rebalanced:  ``cp.rebalance()`` under the load (traced calls → refitted device rates →
                 re-plan → swap);
    from scratch: the best of a manual search under the load: every cut of the layers
                 (blocks cut at their waist included) within ``--search`` cuts of the
                 balanced one, with the rebalanced plan's chunks, each screened on
                 ``--screen`` calls, the fastest kept.

Reported: tokens/s of each (median over ``--reps`` repetitions of the median of ``--calls``
calls), the idle machine's tokens/s with the idle plan, and the share of the throughput lost
to the load that the rebalance recovers: ``(rebalanced - idle plan) / (from scratch - idle
plan)``.

Run:  flock -x /tmp/tppc_cpu.lock .venv/bin/python benchmarks/rebalance.py [--seq 1024]
          [--layers 8] [--hidden 512] [--reps 5] [--calls 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tppc.cost_models.layer_costs import build_cost_table
from tppc.dispatch.compile import compile_pipeline
from tppc.planner.manual import manual_plan

STAGE_PREFIX = "tppc-stage-"
"""Name of the ``threads`` executor's worker of stage ``s`` (``tppc-stage-{s}``)."""


def pin_stage_threads() -> bool:
    """Pin every stage worker to core ``s`` as it starts (the workers are made per call).
    ``threading.setprofile`` runs a hook in each new thread; it pins, then removes itself."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return False
    cores = sorted(os.sched_getaffinity(0))

    def hook(*_: object) -> None:
        name = threading.current_thread().name
        if name.startswith(STAGE_PREFIX):
            stage = int(name[len(STAGE_PREFIX):])
            os.sched_setaffinity(0, {cores[stage % len(cores)]})  # 0: this thread
        sys.setprofile(None)

    threading.setprofile(hook)
    return True


def llama(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=8192, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def median_call(cp, ids: torch.Tensor, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        cp(ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sub_layers(cp, ids: torch.Tensor) -> list[str]:
    """Every layer, each block as its two parts (``.attn``, ``.mlp``) where it has a waist."""
    front, _ = cp.bind((ids,), {})
    ctx = front.ctx
    table = build_cost_table(front.chunk, ctx.layers, cp.options.cluster, ids.shape[1],
                             seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)
    return [p.name for lc in table.layers[0] for p in (lc.parts or (lc,))]


def search(cp, ids: torch.Tensor, names: list[str], boundaries: tuple[int, ...],
           around: int, width: int, screen: int) -> tuple[object, int, list]:
    """The fastest measured cut from 2 before the idle plan's (``around``) to ``width`` after
    it (stage 0 gets ``names[:cut]``; the load is on stage 1's core)."""
    tried = []
    for cut in range(max(1, around - 2), min(len(names) - 1, around + width) + 1):
        plan = manual_plan(names, ids.shape[1], cuts=(0, cut, len(names)),
                           boundaries=boundaries)
        other = cp.with_plan(plan, verify=False)
        other(ids)
        tried.append((median_call(other, ids, screen), cut, other))
    tried.sort(key=lambda t: t[0])
    return tried[0][2], tried[0][1], [(cut, round(t, 4)) for t, cut, _ in tried]


def busy_load() -> subprocess.Popen:
    """A Python busy loop pinned to core 1 (``taskset -c 1``; ``sched_setaffinity`` without
    taskset)."""
    loop = [sys.executable, "-c", "while True: pass"]
    if shutil.which("taskset"):
        return subprocess.Popen(["taskset", "-c", "1", *loop])
    return subprocess.Popen([*loop[:2], "import os; os.sched_setaffinity(0, {1})\n"
                             "while True: pass"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--screen", type=int, default=2)
    parser.add_argument("--search", type=int, default=8,
                        help="cuts tried after the idle plan's (2 are tried before it)")
    args = parser.parse_args()
    pinned = pin_stage_threads()
    torch.set_num_threads(1)
    model = llama(args)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    cp = compile_pipeline(model, (ids,), cluster="2xcpu", num_stages=2, executor="threads",
                          threads_per_stage=1, verify=False)
    print(f"compiled in {time.perf_counter() - t0:.1f} s; stage threads pinned: {pinned}; "
          f"load {os.getloadavg()[0]:.2f}")
    with torch.no_grad():
        expected = model(ids).logits
    idle_plan = cp.with_plan(cp.plan, verify=False)
    idle_plan(ids)
    idle = [median_call(idle_plan, ids, args.calls) for _ in range(args.reps)]
    print(f"idle machine, idle plan: {args.seq / statistics.median(idle):.0f} tokens/s")
    load = busy_load()
    try:
        time.sleep(1.0)
        report = cp.rebalance((ids,), calls=5)
        print(report.table())
        names = sub_layers(cp, ids)
        last = idle_plan.plan.stages[0].layer_names[-1]
        idle_cut = 1 + max(i for i, n in enumerate(names) if n == last or n.startswith(last))
        scratch, cut, tried = search(cp, ids, names, cp.plan.boundaries, idle_cut,
                                     args.search, args.screen)
        print(f"manual search (cut: seconds): {tried}; kept cut {cut} of {len(names)}")
        runs = {"idle plan": idle_plan, "rebalanced": cp, "from scratch": scratch}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.reps):
            for name, pipe in runs.items():
                times[name].append(median_call(pipe, ids, args.calls))
        for pipe in runs.values():
            torch.testing.assert_close(pipe(ids).logits, expected, atol=1e-4, rtol=1e-4)
    finally:
        load.kill()
        load.wait()
    tps = {k: args.seq / statistics.median(v) for k, v in times.items()}
    lost = tps["from scratch"] - tps["idle plan"]
    recovered = (tps["rebalanced"] - tps["idle plan"]) / lost if lost > 0 else float("nan")
    for k, v in tps.items():
        print(f"under load, {k:>12}: {v:7.0f} tokens/s  (median of {args.reps} reps: "
              f"{[round(t * 1e3, 1) for t in times[k]]} ms)")
    print(f"share of the lost throughput recovered: {100 * recovered:.0f} %")
    print(json.dumps({"machine": platform.processor() or platform.machine(),
                      "cores": os.cpu_count(), "seq": args.seq, "layers": args.layers,
                      "hidden": args.hidden, "idle_tps": args.seq / statistics.median(idle),
                      "loaded_tps": tps, "recovered": recovered,
                      "rates": report.rates_after, "swapped": report.swapped,
                      "load_after": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
