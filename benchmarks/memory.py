"""Peak host memory of compile and of one call against eager, in separate processes.

Model: a small ``LlamaForCausalLM`` (hidden 256, 2 layers, 4 heads / 2 K/V heads, MLP 512,
vocab 1024, fp32, SDPA, random weights): small enough that activations, logits, masks and
K/V buffers, not the weights, dominate, so an ``L × L`` tensor anywhere shows at once.

Each measurement runs in a fresh process and reports the peak resident set size
(``VmHWM``) minus the resident size after building the model (the baseline):
    eager:    ``model(ids)`` under ``torch.no_grad``.
    compile:  ``tppc.compile(model, (ids,), cluster="2xcpu", executor="threads",
              tensor_parallel=1)``: two pipeline stages (a tensor-parallel call keeps a
              whole residual stream per worker: not measured here).
    call:     compile, then one call ``cp(ids)`` (the peak of both).
    call-only: compile, reset the peak, then one call: what a call adds over the compiled
              pipeline (the peak is reset through ``/proc/self/clear_refs``).
The goal (issue 8): tppc's call ≤ eager + its K/V buffers + 20 %, growing linearly in L.

Run:  .venv/bin/python benchmarks/memory.py [--lengths 4096,8192,16384,32768,65536]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys

__all__ = ["measure"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mb() -> float:
    with open("/proc/self/status") as f:  # VmHWM: the peak since the last reset
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # Linux: "5" resets VmHWM to the RSS
        f.write("5")


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1 << 17, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def measure(mode: str, length: int) -> dict[str, float]:
    """Run one measurement in this process (call it in a fresh one)."""
    import torch

    import tppc

    model = _model()
    ids = torch.randint(0, 1024, (1, length))
    with torch.no_grad():
        model(ids[:, :16])  # warm the kernels at a negligible size
    _reset_peak()
    base = _rss_mb()
    kv = 0.0
    with torch.no_grad():
        if mode == "eager":
            model(ids)
        else:
            cp = tppc.compile(model, (ids,), cluster="2xcpu", executor="threads",
                              tensor_parallel=1)
            if mode == "call-only":
                _reset_peak()
                base = _rss_mb()
            if mode != "compile":
                cp(ids)
            kv = sum(s.kv_bytes for s in cp.stages) / 2**20
    return {"mode": mode, "length": length, "peak_mb": _peak_mb() - base, "kv_mb": kv}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    parser.add_argument("--one", nargs=2, metavar=("MODE", "LENGTH"), help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.one:
        print(json.dumps(measure(ns.one[0], int(ns.one[1]))))
        return
    print(f"# {platform.processor() or platform.machine()}, {platform.python_version()}")
    print("| tokens | eager MB | tppc compile MB | tppc call MB | K/V MB | call / (eager + K/V) |")
    print("|---|---|---|---|---|---|")
    for length in (int(x) for x in ns.lengths.split(",")):
        row = {m: _run(m, length) for m in ("eager", "compile", "call")}
        kv = row["call"]["kv_mb"]
        ratio = row["call"]["peak_mb"] / (row["eager"]["peak_mb"] + kv)
        print(f"| {length} | {row['eager']['peak_mb']:.0f} | {row['compile']['peak_mb']:.0f} | "
              f"{row['call']['peak_mb']:.0f} | {kv:.0f} | {ratio:.2f} |", flush=True)


def _run(mode: str, length: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--one", mode, str(length)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
