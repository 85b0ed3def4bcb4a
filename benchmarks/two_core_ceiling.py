"""What two cores give one DiT step on this machine, without tppc: the ceiling of issue 29's
2-core row. The PixArt-shaped transformer of ``benchmarks/dit_hybrid.py`` (1024 tokens, the
guided batch of two), eager forwards only, side by side, alternating per rep:

- ``batch 2, 1 thread``: the reference;
- ``batch 2, 2 intra-op threads``: eager on both cores;
- ``batch 1, 1 thread, twice in turn``: what splitting the guided batch costs by itself;
- ``batch 1 x 2 threads at once``: CFG-parallel's ideal in one process (two Python threads,
  one intra-op thread each, no tppc);
- ``batch 1 x 2 processes at once``: the same with no shared interpreter lock.

Prints each row's median and min over the reps and its ratio to the reference (medians).

Usage (with every other job held off):
    flock -x /tmp/tppc_cpu.lock python benchmarks/two_core_ceiling.py [REPS] [FORWARDS]
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

from benchmarks.diffusers_dropin import _pipe

__all__: list[str] = []


def _forwards(batch: int, count: int, threads: int) -> None:
    """``count`` forwards of the transformer on the first ``batch`` rows, ``threads`` threads."""
    torch.set_num_threads(threads)
    with torch.inference_mode():
        for _ in range(count):
            _MODEL(_X[:batch], encoder_hidden_states=_ENC[:batch],
                   encoder_attention_mask=_MASK[:batch], timestep=_T[:batch],
                   added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                   return_dict=False)


def _in_threads(count: int) -> None:
    workers = [threading.Thread(target=_forwards, args=(1, count, 1)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _worker(start: mp.synchronize.Event, count: int) -> None:
    _forwards(1, 1, 1)
    start.wait()
    _forwards(1, count, 1)


def _in_processes(count: int) -> float:
    """Two forked processes, released together once both are warm: the wall time of both."""
    ctx = mp.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_worker, args=(start, count)) for _ in range(2)]
    for p in procs:
        p.start()
    time.sleep(3.0)
    began = time.perf_counter()
    start.set()
    for p in procs:
        p.join()
    return time.perf_counter() - began


def main(reps: int, count: int) -> None:
    runs: dict[str, Callable[[], object]] = {
        "batch 2, 1 thread": lambda: _forwards(2, count, 1),
        "batch 2, 2 intra-op threads": lambda: _forwards(2, count, 2),
        "batch 1, 1 thread, twice in turn": lambda: (_forwards(1, count, 1),
                                                     _forwards(1, count, 1)),
        "batch 1 x 2 threads at once": lambda: _in_threads(count),
    }
    times: dict[str, list[float]] = {name: [] for name in [*runs, "batch 1 x 2 processes at once"]}
    _forwards(2, 1, 1)
    for rep in range(reps):
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - began)
        times["batch 1 x 2 processes at once"].append(_in_processes(count))
        print(f"rep {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    ref = statistics.median(times["batch 2, 1 thread"])
    print(f"{count} forwards per run, {reps} reps")
    print("| run | median | min | vs batch 2, 1 thread |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.2f} s | {min(ts):.2f} s | {ref / med:.2f}x |")


_PIPE = _pipe()
_MODEL = _PIPE.transformer
_GEN = torch.Generator().manual_seed(0)
_X = torch.randn(2, 4, 64, 64, generator=_GEN)
_ENC = torch.randn(2, 16, 64, generator=_GEN)
_MASK = torch.ones(2, 16)
_T = torch.tensor([500, 500])

if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5, int(sys.argv[2]) if len(sys.argv) > 2 else 6)
