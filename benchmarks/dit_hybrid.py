"""Issue 29's 2-core row: the PixArt-shaped pipeline with classifier-free guidance (a batch
of two, 1024 image tokens, 20 DPM-Solver steps, ``benchmarks/diffusers_dropin.py``'s setup),
eager against the drop-in's parallel forms, side by side in one process.

Rows: eager on 1 thread, eager on 2 intra-op threads, the drop-in's PipeFusion (2 stages x 1
thread, 1 warm-up step, the planned patches), CFG-parallel (``cfg_parallel=2``: the two
halves of the guided batch on two workers, every step warm), Ulysses-2 (``ulysses=2``, every
step warm), intra-op 2 (``intra_op=2``: one worker running both CPU devices' cores as its
intra-op threads, every step warm: tppc's counterpart of eager on 2 threads), and the
drop-in as a user calls it (no degrees given: the planner's choice, among them intra-op 2
where a 2-thread calibration prices it; its workers keep their plan's threads, never
``threads_per_stage=1``). Rows whose workers use every core (eager on 2 threads, intra-op 2,
the default) run the pipeline's own work (scheduler, VAE) on 2 threads, the others on 1.
Every run once per rep, alternating; the median of the reps and its ratio to eager on 1
thread. A row the installed tppc refuses prints its refusal instead of a time.

Usage (under the shared lock):
    flock -x /tmp/tppc_cpu.lock python benchmarks/dit_hybrid.py [REPS] [STEPS]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

import tppc.diffusers
from benchmarks.diffusers_dropin import _call, _pipe
from tppc.errors import TppcError

__all__: list[str] = []

_ONE = {"cfg_parallel": 1, "ulysses": 1, "ring": 1, "tensor_parallel": 1, "intra_op": 1}
FORMS: dict[str, dict[str, object]] = {
    "drop-in PipeFusion (2 stages x 1 thread, 1 warm-up)": {
        **_ONE, "num_stages": 2, "threads_per_stage": 1, "executor": "threads",
        "warmup_steps": 1},
    "CFG-parallel 2 (every step warm)": {
        **_ONE, "cfg_parallel": 2, "num_stages": 1, "threads_per_stage": 1,
        "executor": "threads", "warmup_steps": None},
    "Ulysses-2 (every step warm)": {
        **_ONE, "ulysses": 2, "num_stages": 1, "threads_per_stage": 1, "executor": "threads",
        "warmup_steps": None},
    "intra2: intra_op=2 (one worker of 2 threads, every step warm)": {
        **_ONE, "intra_op": 2, "num_stages": 1, "executor": "threads", "warmup_steps": None},
    "drop-in, no degrees given": {},
}
"""The drop-in's forms: ``compile_pipeline`` keywords."""


def _caller_threads(options: dict[str, object]) -> int:
    """The calling thread's intra-op threads for a form (module docstring): 2 where its
    workers take every core (no degrees given, or ``intra_op=2``), else 1."""
    return 2 if not options or options.get("intra_op", 1) != 1 else 1


def _runs(pipe: object, steps: int) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """The timed runs by name, and the refusals by name (compiled untimed first)."""
    eager = pipe.transformer
    runs: dict[str, Callable[[], object]] = {}
    refused: dict[str, str] = {}

    def eager_run(threads: int) -> Callable[[], object]:
        def run() -> object:
            pipe.transformer = eager
            torch.set_num_threads(threads)
            return _call(pipe, steps)
        return run

    runs["eager, 1 thread"] = eager_run(1)
    runs["eager, 2 intra-op threads"] = eager_run(2)
    for name, options in FORMS.items():
        pipe.transformer = eager
        try:
            tppc.diffusers.compile_pipeline(pipe, **options)
            adapter = pipe.transformer
            threads = _caller_threads(options)
            torch.set_num_threads(threads)
            _call(pipe, 2)  # compiles (untimed)
        except TppcError as exc:
            refused[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue

        def run(adapter: object = adapter, threads: int = threads) -> object:
            pipe.transformer = adapter
            torch.set_num_threads(threads)
            return _call(pipe, steps)
        runs[name] = run
    pipe.transformer = eager
    return runs, refused


def main(reps: int = 3, steps: int = 20) -> None:
    pipe = _pipe()
    runs, refused = _runs(pipe, steps)
    want = runs["eager, 1 thread"]()
    times: dict[str, list[float]] = {name: [] for name in runs}
    worst: dict[str, float] = {}
    load = os.getloadavg()[0]
    for _ in range(reps):  # side by side: every run once per rep
        for name, run in runs.items():
            t0 = time.perf_counter()
            got = run()
            times[name].append(time.perf_counter() - t0)
            worst[name] = max(worst.get(name, 0.0), float((got - want).abs().max()))
    base = statistics.median(times["eager, 1 thread"])
    print(f"PixArt-shaped pipeline (hidden 384, depth 8, 1024 image tokens, guidance: batch "
          f"2), {steps} DPM-Solver steps, output_type='latent', {reps} reps, load "
          f"{load:.2f} before / {os.getloadavg()[0]:.2f} after")
    print("| run | median (s) | min (s) | vs eager 1 thread (median) | max abs diff vs eager |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f} | "
              f"{base / statistics.median(ts):.2f}x | {worst[name]:.1e} |")
    for name, why in refused.items():
        print(f"| {name} | refused: {why} | | | |")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
