"""Memory over many calls (issue 30): re-planning for new lengths keeps what it leaves behind
bounded. torch.fx keeps the source of every generated ``forward`` (``_loader.eval_cache``,
``linecache``) forever; tppc releases an emission's with its program
(:mod:`tppc.program.generated_code`), and ``ctx.history`` keeps the latest emissions'
records only. The curve over 10,000 calls: ``benchmarks/memory_over_calls.py``."""

from __future__ import annotations

import gc
import linecache

import torch
from torch.fx import graph_module

import tppc
from tppc import examples


def test_replanning_for_new_lengths_keeps_generated_code_and_history_bounded(
        monkeypatch) -> None:
    monkeypatch.setattr("tppc.passes.runner.EMISSION_RECORDS", 2)
    model, (ids,), _ = examples.gpt(seq_len=16, n_layer=2)
    cp = tppc.compile(model, (ids,), num_stages=2, executor="local", program_cache=1,
                      verify=False)

    def calls(lengths: range) -> tuple[int, int]:
        with torch.no_grad():
            for n in lengths:
                cp(torch.randint(0, 256, (1, n)))
        gc.collect()
        return len(graph_module._loader.eval_cache), len(linecache.cache)

    sources, lines = calls(range(8, 10))  # 2 lengths: re-planned, evicted (1 held)
    assert calls(range(10, 14)) <= (sources, lines)  # 4 more re-plans: nothing more held
    assert len(cp.history) == cp.context.captured_passes + 2
