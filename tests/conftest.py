"""Shared fixtures: seeded small models, and a pinned CPU calibration.

Every plan the tests make prices the ``cpu`` device with the calibration in
``tests/data/cpu_calibration.json`` (measured once on an idle 2-core machine; its thread-group
``group_*`` fields later, on the loaded VM, best of 3), not with one measured now: a verdict
must not depend on this machine's speed or on what else it runs.
Tests of the calibration itself unset it (the ``real_calibration`` fixture).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

PINNED_CALIBRATION = Path(__file__).parent / "data" / "cpu_calibration.json"
os.environ.setdefault("TPPC_CALIBRATION", str(PINNED_CALIBRATION))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def real_calibration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measure the CPU for real in this test (no pinned calibration)."""
    monkeypatch.delenv("TPPC_CALIBRATION", raising=False)
