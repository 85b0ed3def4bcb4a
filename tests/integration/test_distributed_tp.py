"""Tensor-parallel stages on the distributed backend: one rank per worker (gloo on CPU),
each rank holding only its shard, against the eager model.

A job of ``S`` stages at degree ``t`` has ``S·t`` ranks (``tp_rank.py``); rank 0 gets the
logits of the leader (the first shard of the last stage). Each 4-rank job takes about a
minute on the 2-core VM (four captures at once), so one job checks prefill, generation and
the bytes each rank loaded together.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc.distributed.checkpoint import StageWeights, empty_model, save_checkpoint
from tppc.distributed.pipeline import check_world
from tppc.driver.emit import build_program
from tppc.examples import gpt, hf_llama
from tppc.frontend.front_end import capture_front_end
from tppc.passes.sharding.shard_graph import PartOf

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = {"gpt": gpt, "hf_llama": hf_llama}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(out: Path, name: str, stages: int, degree: int, generate: int) -> None:
    world = stages * degree
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()),
           "WORLD_SIZE": str(world), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "tests/integration/tp_rank.py"), str(out), name,
         str(stages), str(degree), str(generate)],
        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)


@pytest.mark.parametrize(("name", "stages", "degree"), [("hf_llama", 1, 2), ("gpt", 2, 2)],
                         ids=["llama-pp1xtp2", "gpt-pp2xtp2"])  # 4 gloo ranks: ~1 min each
def test_sharded_job_equals_eager(tmp_path: Path, name: str, stages: int, degree: int) -> None:
    model, args, _ = FACTORIES[name]()
    save_checkpoint(model, tmp_path / f"{name}.safetensors")
    ids = torch.randint(3, 128, args[0].shape)  # not the factory's example inputs
    torch.save(ids, tmp_path / "ids.pt")
    generate = 4 if name == "hf_llama" else 0
    _job(tmp_path, name, stages, degree, generate)
    got = torch.load(tmp_path / "got.pt")
    with torch.no_grad():
        logits = model(ids)
    assert_kernels_close(got["logits"], getattr(logits, "logits", logits))
    if generate:
        want = model.generate(ids[:, :8], do_sample=False, max_new_tokens=generate)
        assert torch.equal(got["ids"], want)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text())
               for r in range(stages * degree)]
    assert [r["stage"] for r in reports] == [s for s in range(stages) for _ in range(degree)]
    whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    per_rank = [r["weights_bytes"] for r in reports]
    assert max(per_rank) < (0.7 if stages == 1 else 0.5) * whole, (per_rank, whole)


def _sharded_program(name: str, degrees: tuple[int, ...]) -> tuple:
    model, args, kwargs, _ = empty_model(FACTORIES[name])
    plan = tppc.plan(model, args, kwargs, cluster=f"{len(degrees)}xcpu",
                     num_stages=len(degrees))
    front = capture_front_end(model, args, kwargs, seq_dims=None)
    return build_program(front.chunk, front.ctx, plan, devices=("meta",) * len(degrees),
                         degrees=degrees), model


def test_a_job_of_another_size_is_refused_naming_both_numbers() -> None:
    program, _ = _sharded_program("gpt", (2, 2))
    check_world(program, 4)
    with pytest.raises(tppc.SpecError, match=r"needs 4 ranks \(2 stages at tensor-parallel "
                       r"degrees \[2, 2\].*the job has 3.*--nproc-per-node 4"):
        check_world(program, 3)


def test_a_shard_reads_only_its_part_of_each_checkpoint_tensor(tmp_path: Path) -> None:
    model, _, _ = hf_llama()
    path = save_checkpoint(model, tmp_path / "llama.safetensors")
    weights = StageWeights(path, model, {}, torch.device("cpu"))
    # a fused-looking cut: two segments (32 and 96 rows) of gate_proj, rank 1 of 2
    part = weights.tensor("tp_gate", PartOf("model.layers.0.mlp.gate_proj.weight", 0,
                                            (32, 96), 1, 2))
    full = model.model.layers[0].mlp.gate_proj.weight.detach()
    assert torch.equal(part, torch.cat([full[16:32], full[32 + 48:128]]))
    cols = weights.tensor("tp_down", PartOf("model.layers.0.mlp.down_proj.weight", 1,
                                            (128,), 0, 2))
    assert torch.equal(cols, model.model.layers[0].mlp.down_proj.weight.detach()[:, :64])
    assert weights.nbytes == (part.numel() + cols.numel()) * 4  # never the whole tensors
