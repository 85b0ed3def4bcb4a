"""Stages on a mesh of workers on the distributed backend: one rank per worker (gloo on CPU),
against the eager model (``mesh_rank.py`` runs each rank)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.oracles import assert_kernels_close
from tppc.distributed.checkpoint import save_checkpoint
from tppc.examples.hf import dit

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(out: Path, stages: int, cfg: int, ulysses: int, ring: int) -> None:
    world = stages * cfg * ulysses * ring
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()),
           "WORLD_SIZE": str(world), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "tests/integration/mesh_rank.py"), str(out),
         *map(str, (stages, cfg, ulysses, ring))],
        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=500)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)


# one 2-rank job (~45 s on the 2-core VM); (1, 1, 2, 1) and (1, 1, 1, 2) pass too (Ulysses'
# all-to-all, Ring attention's ring shifts over gloo), left out of the suite for time
@pytest.mark.parametrize(("stages", "cfg", "ulysses", "ring"), [(1, 2, 1, 1)], ids=["cfg2"])
def test_a_mesh_job_equals_eager(tmp_path: Path, stages: int, cfg: int, ulysses: int,
                                 ring: int) -> None:
    model, _, _ = dit(size=8, depth=2)
    save_checkpoint(model, tmp_path / "dit.safetensors")
    torch.manual_seed(1)
    inputs = (torch.randn(2, 4, 8, 8), torch.tensor([10, 10]), torch.tensor([3, 0]))
    torch.save(inputs, tmp_path / "inputs.pt")
    _job(tmp_path, stages, cfg, ulysses, ring)
    with torch.no_grad():
        want = model(*inputs)
    assert_kernels_close(torch.load(tmp_path / "got.pt"), want)
