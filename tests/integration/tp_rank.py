"""One rank of ``test_distributed_tp.py``: a job of tensor-parallel stages (one rank per
worker), built on the meta device, each rank loading only its shard from a checkpoint.

Usage: ``python tp_rank.py OUT_DIR FACTORY STAGES DEGREE GENERATE`` with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; ``OUT_DIR`` holds
``FACTORY.safetensors`` and ``ids.pt``; rank 0 writes ``got.pt`` (the logits, and the
greedy ids when ``GENERATE`` > 0), every rank ``rank<r>.json`` (its stage, its bytes).

Every stage at ``tensor_parallel=DEGREE`` (``STAGES`` stages).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tppc import examples
from tppc.distributed.checkpoint import empty_model
from tppc.distributed.pipeline import compile_distributed


def main(out: Path, name: str, stages: int, degree: int, generate: int) -> None:
    model, args, kwargs, buffers = empty_model(getattr(examples, name))
    cp = compile_distributed(model, args, kwargs, checkpoint=str(out / f"{name}.safetensors"),
                             buffers=buffers, num_stages=stages, tensor_parallel=degree,
                             cluster=f"{stages * degree}xcpu",
                             chunks=2, verify=False, comm_timeout=120.0)
    ids = torch.load(out / "ids.pt")
    got = cp(ids)
    ids_out = cp.generate(ids[:, :8], max_new_tokens=generate) if generate else None
    stage = cp.program(ids.shape[1]).runners[cp.rank]
    (out / f"rank{cp.rank}.json").write_text(json.dumps(
        {"stage": stage.index, "weights_bytes": cp.weights.nbytes}))
    if cp.rank == 0:
        logits = got.logits if hasattr(got, "logits") else got
        torch.save({"logits": logits, "ids": ids_out}, out / "got.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
