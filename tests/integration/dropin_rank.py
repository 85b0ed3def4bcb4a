"""One rank of the drop-in through a job (``test_distributed_mesh.py``): an unchanged guided
``PixArtAlphaPipeline`` call whose transformer runs as ranks (``compile_pipeline(pipe,
backend="distributed", ...)``); every rank runs the pipeline, rank 0 writes the images.

Usage: ``python dropin_rank.py OUT_DIR OPTIONS_JSON`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set; ``OPTIONS_JSON`` holds ``compile_pipeline``'s
keywords (``warmup_steps``, ``patches``, the degrees); rank 0 writes ``got.pt`` (a call of 2 steps).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import tppc.diffusers
from tests.integration.test_diffusers_dropin import _call, pixart_pipe


def main(out: Path, options: dict) -> None:
    torch.set_num_threads(1)
    pipe, call = pixart_pipe()
    pipe.set_progress_bar_config(disable=True)
    tppc.diffusers.compile_pipeline(pipe, backend="distributed", comm_timeout=120.0,
                                    **options)
    images = _call(pipe, call, steps=2)
    if torch.distributed.get_rank() == 0:
        torch.save(images, out / "got.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
