"""Memory is O(L): a call adds about what eager needs, and doubling L doubles it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "memory.py"


def _measure(mode: str, length: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, str(BENCH), "--one", mode, str(length)],
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_call_grows_linearly_and_stays_within_eager_plus_kv_buffers():
    small, large = 4096, 16384  # an L×L fp32 mask would be 64 MB at 4096, 1 GB at 16384
    call = {n: _measure("call-only", n) for n in (small, large)}
    eager = _measure("eager", large)
    assert call[large]["peak_mb"] < 6 * call[small]["peak_mb"]  # linear: 4×; quadratic: 16×
    assert call[large]["peak_mb"] <= 1.2 * (eager["peak_mb"] + call[large]["kv_mb"]) + 16
