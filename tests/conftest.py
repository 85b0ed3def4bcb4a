"""Shared fixtures: seeded small models, and a pinned CPU calibration.

Every plan the tests make prices the ``cpu`` device with the calibration in
``tests/data/cpu_calibration.json`` (measured once on an idle 2-core machine; its thread-group
``group_*`` fields later, on the loaded VM, best of 3), not with one measured now: a verdict
must not depend on this machine's speed or on what else it runs.
Tests of the calibration itself unset it (the ``real_calibration`` fixture). The tests listed
in ``ci_skips.txt`` are marked ``slow``: CI (``scripts/test.sh``) deselects them, ``--all`` runs them.
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


CI_TIER_SKIPS = Path(__file__).parent / "ci_skips.txt"


def listed_skips(path: Path = CI_TIER_SKIPS) -> set[str]:
    """Node ids in ``ci_skips.txt`` (a function name without ``[...]`` covers all its cases)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests listed in ``ci_skips.txt`` slow: ``scripts/test.sh`` (CI) deselects them."""
    skips = listed_skips()
    ids = {item.nodeid for item in items}
    bases = {nodeid.split("[", 1)[0] for nodeid in ids}
    stale = sorted(s for s in skips if "[" in s and s.split("[", 1)[0] in bases and s not in ids)
    if stale:  # a renamed case would silently run in CI again
        raise pytest.UsageError(f"{CI_TIER_SKIPS.name} names cases that do not exist: {stale}")
    for item in items:
        if item.nodeid in skips or item.nodeid.split("[", 1)[0] in skips:
            item.add_marker(pytest.mark.slow)
