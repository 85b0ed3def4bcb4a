"""``tppc.compile(..., backend="distributed")`` is validated: rank 0 checks the emitted program
against the captured graph before any rank loads its stage, and every rank obeys its verdict.

Two-rank gloo jobs in spawned processes. The oracle: a program broken on purpose at a known node
(every rank must refuse it, rank 0 naming the node) and the eager model (an unbroken job passes,
with the weights from the model itself or from a checkpoint).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest

WORLD = 2
SEQ = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compile(case: str, checkpoint: str | None, **options: Any) -> dict[str, Any]:
    """One compile on this rank: what it returned or raised."""
    import tppc
    from tppc import examples
    from tppc.distributed.checkpoint import empty_model

    if checkpoint is None:
        model, args, _ = examples.gpt(seq_len=SEQ, n_layer=2)
        buffers = None
    else:
        model, args, _, buffers = empty_model(lambda: examples.gpt(seq_len=SEQ, n_layer=2))
    try:
        cp = tppc.compile(model, args, backend="distributed", checkpoint=checkpoint,
                          buffers=buffers, comm_timeout=60.0, device="cpu", **options)
    except tppc.TppcError as err:
        return {"case": case, "error": type(err).__name__, "message": str(err),
                "module": getattr(err, "module", None)}
    v = cp.validation
    return {"case": case, "validation": None if v is None else
            {"lengths": v.lengths, "max_diff": v.max_diff,
             "staged": any(len(r.stages) >= 2 and len(r.chunks) >= 2 for r in v.runs)}}


def _worker(rank: int, port: int, checkpoint: str | None, results: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist

        from tests.unit.test_validate import _scale_module_output
        from tppc.driver import emit

        torch.set_num_threads(1)
        out = [_compile("good", checkpoint)]
        emit.partition_stages = _scale_module_output("blocks.1.mlp.2", 1.5)  # the fault
        out.append(_compile("broken, verify=False", checkpoint, verify=False))
        out.append(_compile("broken", checkpoint))
        dist.destroy_process_group()
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _job(checkpoint: str | None) -> dict[int, list[dict[str, Any]]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, checkpoint, results))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, out in got.items():
        assert isinstance(out, list), f"rank {rank} crashed:\n{out}"
    return got


@pytest.mark.parametrize("weights", ["model", "checkpoint"])
def test_rank_0_checks_the_program_and_every_rank_obeys(weights, tmp_path: Path) -> None:
    checkpoint = None
    if weights == "checkpoint":
        from tppc import examples
        from tppc.distributed.checkpoint import save_checkpoint

        checkpoint = str(save_checkpoint(examples.gpt(seq_len=SEQ, n_layer=2)[0],
                                         tmp_path / "gpt.safetensors"))
    got = _job(checkpoint)
    for rank in range(WORLD):
        good, unchecked, broken = got[rank]
        v = good["validation"]  # every rank holds rank 0's record
        assert v is not None and v["lengths"][0] == SEQ and v["staged"]
        assert v["max_diff"] < 1e-4
        assert unchecked.get("error") is None and unchecked["validation"] is None
        assert broken["error"] == "SoundnessError"
    assert got[0][2]["module"] == "blocks.1.mlp.2"  # rank 0 names the node
    assert "rank 0's translation validation" in got[1][2]["message"]
    assert "blocks.1.mlp.2" in got[1][2]["message"]
