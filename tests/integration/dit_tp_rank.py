"""One rank of ``test_dit_tensor_parallel.py``'s distributed job: a DiT's one stage at
``tensor_parallel=WORLD_SIZE`` (one gloo rank per worker), built on the meta device, each
rank loading only its shard from a checkpoint.

Usage: ``python dit_tp_rank.py OUT_DIR FACTORY`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set; ``OUT_DIR`` holds ``FACTORY.safetensors`` and
``inputs.pt`` (the call's args and kwargs); rank 0 writes ``got.pt`` (the model's output),
every rank ``rank<r>.json`` (its bytes of weights).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tppc import examples
from tppc.distributed.checkpoint import empty_model
from tppc.distributed.pipeline import compile_distributed


def main(out: Path, name: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    model, _, _, buffers = empty_model(getattr(examples, name))
    args, kwargs = torch.load(out / "inputs.pt")
    cp = compile_distributed(model, args, kwargs, checkpoint=str(out / f"{name}.safetensors"),
                             buffers=buffers, num_stages=1, tensor_parallel=world,
                             cluster=f"{world}xcpu", verify=False, comm_timeout=120.0)
    got = cp(*args, **kwargs)
    (out / f"rank{cp.rank}.json").write_text(json.dumps({"weights_bytes": cp.weights.nbytes}))
    if cp.rank == 0:
        torch.save(got[0] if isinstance(got, tuple | list) else got, out / "got.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
