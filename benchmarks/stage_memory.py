"""Predicted vs measured peak memory of every stage, one fresh process per length.

Model: a small ``LlamaForCausalLM`` (hidden 256, 3 layers, 4 heads / 2 K/V heads, MLP 1024,
vocab 2048, fp32, SDPA, random weights) compiled for ``3xcpu``: K/V buffers, rope tables,
logits and chunk activations all weigh next to the weights, so a missing term shows.

A stage's measured peak is what the runtime allocates for it while it runs its chunks:
its parameter tensors (``StageProgram.param_bytes``, held before the measurement starts)
plus the peak resident growth (``VmHWM`` reset through ``/proc/self/clear_refs``) while it
allocates its call state (K/V buffers, positional values), the last stage's full-length
outputs, and runs every chunk with the threaded runtime's queue window: the chunk it runs
and the ``queue_depth`` chunks after it are alive (copies of the previous stage's outputs,
computed before the measurement). Large allocations are ``mmap``-ed
(``MALLOC_MMAP_THRESHOLD_``) so freed memory leaves the resident set.

Run:  .venv/bin/python benchmarks/stage_memory.py [--lengths 4096,16384]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys

__all__ = ["measure_stages", "run_stage_measurement"]

_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmHWM:")).split()[1]) * 1024


def _reset_peak() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the RSS
        f.write("5")


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1 << 16, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def measure_stages(length: int, cluster: str = "3xcpu") -> list[dict]:
    """Predicted and measured peak bytes of every stage, in order (call it in a fresh process).

    Stage ``s``'s inputs are computed by stages ``0..s-1`` outside the measurement; the peak
    is reset before each measurement and everything the previous one allocated is freed
    (large blocks are ``mmap``-ed), so each row reads only what that stage allocates.
    """
    import gc

    import torch

    import tppc
    from tppc.backends.torch_local import run_stage
    from tppc.calls.call import new_outputs
    from tppc.program.state import Call, CallState

    torch.set_num_threads(1)
    model = _model()
    ids = torch.randint(0, 2048, (1, length))
    rows = []
    with torch.no_grad():
        model(ids[:, :16])  # warm the kernels (one-time allocations) at a negligible size
        cp = tppc.compile(model, (ids,), cluster=cluster, executor="local")
        front, bound = cp.bind((ids,), {})
        flat = tuple(bound.flat)
        program = cp.program(length, front)
        chunks = program.chunks
        received: list[tuple] = [() for _ in chunks]
        for index, stage in enumerate(program.stages):
            gc.collect()
            last = index == len(program.stages) - 1
            _reset_peak()
            base = _rss()
            outputs = new_outputs(stage, length, len(program.signature.output_axes)) if last else ()
            call = Call(flat, chunks, length, length, 1, outputs)
            state = CallState(length)
            window: dict[int, tuple] = {}
            for i, (a, b) in enumerate(chunks):
                for j in range(i, min(i + cp.options.queue_depth + 1, len(chunks))):  # queue + run
                    if j not in window:
                        window[j] = tuple(v.clone() if isinstance(v, torch.Tensor) else v
                                          for v in received[j])
                run_stage(stage, call, state, a, b, window.pop(i))
            measured = stage.param_bytes + _peak() - base
            st = cp.plan.stages[index]
            rows.append({"length": length, "stage": index, "predicted": st.memory_bytes,
                         "measured": measured, "param_bytes": stage.param_bytes,
                         "kv_bytes": state.nbytes(), "max_chunk": max(b - a for a, b in chunks),
                         "layers": list(stage.layers)})
            del call, state, outputs, window
            if not last:  # the next stage's inputs, computed outside the measurement
                scratch = CallState(length)
                call = Call(flat, chunks, length, length, 0)
                received = [run_stage(stage, call, scratch, a, b, received[i])
                            for i, (a, b) in enumerate(chunks)]
                del scratch, call
    return rows


def run_stage_measurement(length: int) -> list[dict]:
    """:func:`measure_stages` in a fresh process (the environment it needs set)."""
    env = {**os.environ, **_ENV}
    out = subprocess.run([sys.executable, __file__, "--one", str(length)],
                         capture_output=True, text=True, check=True, timeout=600, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.one:
        print(json.dumps(measure_stages(ns.one)))
        return
    print("| tokens | stage | layers | max chunk | predicted MB | measured MB | ratio |")
    print("|---|---|---|---|---|---|---|")
    for length in (int(x) for x in ns.lengths.split(",")):
        for r in run_stage_measurement(length):
            print(f"| {length} | {r['stage']} | {r['layers'][0]}..{r['layers'][-1]} | {r['max_chunk']} | "
                  f"{r['predicted'] / 2**20:.1f} | {r['measured'] / 2**20:.1f} | "
                  f"{r['predicted'] / r['measured']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
