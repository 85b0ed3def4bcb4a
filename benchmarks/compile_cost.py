"""Compile time with and without translation validation (``verify=True`` is the default).

Models (``--model``):
    llama200m: the Llama-shaped 200 M model of ``pipeline_speed.py`` (24 layers, hidden 768,
        fp32), ``--seq`` tokens (2048), 1 thread.
    readme: the front page's causal LLM (transformers Llama: 4 layers, hidden 128, 512 tokens).
    demo: the demo's own GPT (6 layers, hidden 256, 1024 tokens; ``tppc demo``).

Prints the compile seconds with ``verify=False`` and ``verify=True`` (and ``verify="full"``
with ``--full``: the example length checked too), side by side in one process after one
unmeasured compile (imports, first capture), the median of ``--reps`` compiles each (wall
and CPU seconds of the process: the CPU time is less sensitive to other jobs on the cores),
and what ``cp.validation`` recorded.

Run:  .venv/bin/python benchmarks/compile_cost.py [--model llama200m] [--seq 2048] [--full]
      [--reps 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_speed import llama

import tppc

__all__ = ["main"]


def example(name: str, seq: int) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The model and its example inputs (see the module docstring)."""
    if name == "llama200m":
        torch.set_num_threads(1)
        model = llama(argparse.Namespace(hidden=768, mlp=2048, layers=24, heads=12, kv_heads=4))
        return model, (torch.randint(0, 32000, (1, seq)),)
    if name == "readme":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
        return LlamaForCausalLM(config).eval(), (torch.randint(0, 1000, (1, 512)),)
    from tppc.examples.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=2048, n_layer=6, n_head=8, n_embd=256, max_seq=2048)
    return GPT(cfg).eval(), (torch.randint(0, 2048, (1, 1024)),)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("llama200m", "readme", "demo"), default="llama200m")
    parser.add_argument("--seq", type=int, default=2048, help="tokens (llama200m only)")
    parser.add_argument("--full", action="store_true", help="also verify='full'")
    parser.add_argument("--reps", type=int, default=1, help="compiles per setting (median)")
    ns = parser.parse_args()
    model, args = example(ns.model, ns.seq)
    settings = (False, True, "full") if ns.full else (False, True)
    seconds: dict[Any, list[float]] = {v: [] for v in settings}
    cpu: dict[Any, list[float]] = {v: [] for v in settings}
    done: dict[Any, str] = {}
    with torch.no_grad():
        if ns.reps > 1:
            tppc.compile(model, args, cluster="2xcpu", verify=False)  # imports, first capture
        for _ in range(ns.reps):
            for verify in settings:
                t0, c0 = time.perf_counter(), time.process_time()
                cp = tppc.compile(model, args, cluster="2xcpu", verify=verify)
                seconds[verify].append(time.perf_counter() - t0)
                cpu[verify].append(time.process_time() - c0)
                v = cp.validation
                done[verify] = "not run" if v is None else (
                    f"{v.seconds:.2f} s, {len(v.runs)} runs at lengths {v.lengths}")
    base = statistics.median(seconds[False])
    for verify in settings:
        median = statistics.median(seconds[verify])
        runs = " ".join(f"{s:.2f}" for s in seconds[verify])
        print(f"{ns.model} verify={verify!r}: compile {median:.2f} s median ({median / base:.2f}x;"
              f" runs {runs}; CPU {statistics.median(cpu[verify]):.2f} s), "
              f"validation {done[verify]}")


if __name__ == "__main__":
    main()
