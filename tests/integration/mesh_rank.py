"""One rank of ``test_distributed_mesh.py``: a job whose stages run on a mesh of workers
(``cfg_parallel``, ``ulysses``, ``ring``; one rank per worker), tppc's DiT on the meta device,
each rank loading its worker's weights from a checkpoint.

Usage: ``python mesh_rank.py OUT_DIR STAGES CFG ULYSSES RING`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set; ``OUT_DIR`` holds ``dit.safetensors`` and
``inputs.pt`` (a guided batch of two); rank 0 writes ``got.pt``.

The plan is tppc's for ``STAGES`` stages with every stage's mesh set by hand (the degrees
the planner would be given).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

import tppc
from tppc.distributed.checkpoint import empty_model
from tppc.distributed.pipeline import compile_distributed
from tppc.examples.hf import dit


def guided_dit() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], dict]:
    """tppc's DiT (2 blocks, 8x8 latents) with a guided batch of two as its example."""
    model, _, _ = dit(size=8, depth=2)
    return model, (torch.zeros(2, 4, 8, 8), torch.tensor([10, 10]), torch.tensor([3, 0])), {}


def mesh_plan(plan: tppc.Plan, cfg: int, ulysses: int, ring: int) -> tppc.Plan:
    """``plan`` with every stage on a mesh of ``cfg x ring x ulysses`` devices."""
    n = cfg * ulysses * ring
    stages = tuple(dataclasses.replace(
        st, cfg_parallel=cfg, ulysses=ulysses, ring=ring, device_index=n * s,
        device_indices=tuple(range(n * s, n * s + n))) for s, st in enumerate(plan.stages))
    return dataclasses.replace(plan, stages=stages)


def main(out: Path, stages: int, cfg: int, ulysses: int, ring: int) -> None:
    model, args, kwargs, buffers = empty_model(guided_dit)
    world = stages * cfg * ulysses * ring
    plan = mesh_plan(tppc.plan(model, args, kwargs, cluster=f"{world}xcpu", num_stages=stages),
                     cfg, ulysses, ring)
    cp = compile_distributed(model, args, kwargs, checkpoint=str(out / "dit.safetensors"),
                             buffers=buffers, plan=plan, verify=False, comm_timeout=120.0)
    got = cp(*torch.load(out / "inputs.pt"))
    if cp.rank == 0:
        torch.save(got, out / "got.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:6]))
