"""Collectives over torch.distributed process groups (gloo): random action lists with
collectives run by 4 ranks through THE interpreter over the process-group transport equal
the independent reference (``tests/unit/collective_lists.py``), with tensors (the
distributed executor) and with numpy arrays (the distributed artifact runner)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.unit.collective_lists import random_lists, random_worker_lists, reference
from tppc.program.actions import COLLECTIVES

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4


def _cases(count: int) -> dict[str, dict]:
    """The first seeds of each generator whose lists need exactly 4 workers and run."""
    cases: dict[str, dict] = {}
    for seed in range(10_000):
        if len(cases) >= 2 * count:
            break
        lists, groups, stages = random_worker_lists(random.Random(seed))
        if len(lists) == WORLD and sum(k.startswith("w") for k in cases) < count:
            cases[f"w{seed}"] = reference(lists, groups, stages)
        lists, groups = random_lists(random.Random(seed))
        want = reference(lists, groups)
        if len(lists) == WORLD and want is not None \
                and sum(k.startswith("c") for k in cases) < count:
            cases[f"c{seed}"] = want
    return cases


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_cases_hold_every_collective_kind() -> None:
    """The ranks below run every kind (the ring shift's isend/irecv pair included)."""
    kinds = set()
    for key in _cases(4):
        make = random_worker_lists if key[0] == "w" else random_lists
        kinds |= {a.kind for row in make(random.Random(int(key[1:])))[0] for a in row
                  if a.collective}
    assert kinds == set(COLLECTIVES)


@pytest.mark.parametrize("mode", ["tensor", "numpy"])
def test_random_lists_with_collectives_on_process_groups_equal_the_reference(
        tmp_path: Path, mode: str) -> None:
    cases = _cases(4)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()),
           "WORLD_SIZE": str(WORLD), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests/integration/collective_rank.py"),
                               str(tmp_path), mode, *cases], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    got: dict[str, np.ndarray] = {}
    for r in range(WORLD):
        got.update(np.load(tmp_path / f"rank{r}.npz"))
    want = {f"{seed}/{worker}/{t}.{i}/{j}": array
            for seed, outputs in cases.items() for (worker, (t, i)), values in outputs.items()
            for j, array in enumerate(values)}
    assert got.keys() == want.keys()
    for key, array in want.items():
        np.testing.assert_array_equal(got[key], array, err_msg=key)
