"""Memory and latency of an exported artifact run as a 2-rank job vs one process loading it.

Model: the Llama-shaped model of ``benchmarks/distributed_speed.py`` (random weights, fp32),
compiled for 2 stages and exported once (``tppc.export``) to a temporary directory.

Measured in one run:
    single:  a subprocess runs ``tppc.load(DIR, threads_per_stage=1)`` (both stages, two
             threads) ``R`` times; its resident memory grown by loading (VmHWM after the
             load minus before it) and its call times.
    job:     ``tppc.launch(DIR, 2, threads=1, repeat=R)``: 2 processes x 1 thread (gloo),
             each verifying and loading only its stage; each rank's memory grown by loading
             and rank 0's call times (input broadcast and the logits' transfer included).

Run:  PYTHONPATH=. .venv/bin/python benchmarks/distributed_artifact.py [--layers 6]
          [--seq 256] [--chunks 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

_SINGLE = """
import json, sys, time, numpy as np
from pathlib import Path
def hwm():
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) / 1024
import onnxruntime, tppc.artifact.core.load, tppc.artifact.core.loaded
before = hwm()
runner = tppc.artifact.core.load.load(sys.argv[1], threads_per_stage=1)
loaded = hwm()
ids = np.load(sys.argv[2])['input_ids']
times = []
for _ in range(int(sys.argv[3])):
    t0 = time.perf_counter(); runner(ids); times.append(time.perf_counter() - t0)
print(json.dumps({'before': before, 'loaded': loaded, 'peak': hwm(), 'times': times}))
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    ns = p.parse_args()
    import tppc
    from benchmarks.distributed_speed import llama_shaped

    load_before = os.getloadavg()[0]
    model, args, kwargs = llama_shaped(seq=ns.seq, layers=ns.layers)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2, chunks=ns.chunks)
    work = Path(tempfile.mkdtemp(prefix="tppc-bench-artifact-"))
    tppc.export(cp, work / "art")
    del cp, model
    np.savez(work / "in.npz", input_ids=args[0].numpy())
    single = json.loads(subprocess.run(
        [sys.executable, "-c", _SINGLE, str(work / "art"), str(work / "in.npz"),
         str(ns.reps)], capture_output=True, text=True, check=True).stdout)
    job = tppc.launch(work / "art", 2, inputs={"input_ids": args[0].numpy()}, threads=1,
                      repeat=ns.reps, comm_timeout=120, timeout=1200)
    grown_single = single["loaded"] - single["before"]
    print(f"Llama-shaped, {ns.layers} layers, {weights / 2**20:.0f} MiB of fp32 weights, "
          f"{ns.seq} tokens, {ns.chunks} chunks; load average (1 min) {load_before:.2f} "
          f"before, {os.getloadavg()[0]:.2f} after")
    print(f"single process, tppc.load (2 stages x 1 thread): load grew RSS by "
          f"{grown_single:.0f} MiB (peak {single['peak']:.0f} MiB), call "
          f"{statistics.median(single['times']) * 1e3:.0f} ms (median of {ns.reps})")
    for r in job.reports:
        grown = r["rss_compiled_mib"] - r["rss_start_mib"]
        print(f"rank {r['rank']}: stage files {r['weights_bytes'] / 2**20:.0f} MiB, load grew "
              f"RSS by {grown:.0f} MiB ({grown / grown_single:.2f} of the single process), "
              f"peak {r['rss_peak_mib']:.0f} MiB")
    print(f"2-rank job (gloo, 1 thread each): call "
          f"{statistics.median(job.reports[0]['times']) * 1e3:.0f} ms (rank 0, median)")


if __name__ == "__main__":
    main()
