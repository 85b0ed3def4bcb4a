"""Exported artifacts with tensor-parallel stages: one ONNX graph per part of every worker's
shard, collectives in the runner (numpy, through THE interpreter).

The project's GPT and an HF Llama (GQA: 4 heads, 2 key/value heads) with random weights are
compiled, sharded (PP2xTP2 and TP2 alone), exported, loaded without torch in the runner and
run with ONNX Runtime; the result must equal the eager model within the kernel tolerance (a
row-parallel projection adds its partial sums in another order), and ``generate`` the eager
greedy decode. What the runner does not support is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, greedy_reference
from tppc.artifact.core.load import verify
from tppc.artifact.writer.export_check import check_export
from tppc.driver.emit import build_program
from tppc.errors import ArtifactError, RuntimeInputError
from tppc.examples import hf

pytest.importorskip("onnxruntime")


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _sharded(model, ids, degrees: tuple[int, ...]):
    cp = tppc.compile(model, (ids,), cluster=f"{len(degrees)}xcpu", num_stages=len(degrees),
                      chunks=2, verify=False)
    front = cp._front
    cp.programs.hold(front, build_program(front.chunk, front.ctx, cp.plan, degrees=degrees))
    return cp


@pytest.fixture(scope="module")
def llama_pp2_tp2(tmp_path_factory):
    model, (ids,), _ = hf.hf_llama(seq_len=32)
    cp = tppc.compile(model, (ids,), cluster="4xcpu", num_stages=2, tensor_parallel=2,
                      chunks=2, verify=False)
    assert [st.tensor_parallel for st in cp.plan.stages] == [2, 2]
    out = tmp_path_factory.mktemp("llama_tp") / "art"
    tppc.export(cp, out, verify=False)
    return model, ids, cp, out


def test_each_worker_part_is_its_own_onnx_graph(llama_pp2_tp2) -> None:
    _, _, cp, out = llama_pp2_tp2
    doc = json.loads((out / "plan.json").read_text())
    assert doc["schema"] == "tppc.export/2" and doc["stages"] == []
    assert [(w["stage"], w["rank"]) for w in doc["workers"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert doc["groups"] == [["tp0", [0, 1]], ["tp1", [2, 3]]]
    program = cp.program(cp.plan.seq_len)
    for w, worker in zip(doc["workers"], program.workers, strict=True):
        assert [e["file"] for e in w["parts"]] == [
            f"stage_{w['stage']}.tp{w['rank']}.part{p}.onnx" for p in range(len(w["parts"]))]
        assert [(kind, tuple(dims)) for kind, dims in w["joins"]] == list(worker.joins)
    whole = sum(p.numel() for p in llama_pp2_tp2[0].parameters())
    held = [sum(int(np.prod(t.dims)) for e in w["parts"]
                for t in onnx.load(str(out / e["file"])).graph.initializer)
            for w in doc["workers"]]
    # each file holds its shard: the ranks of a stage together hold less than it twice
    assert held[0] + held[2] < whole and sum(held) < 2 * whole, (held, whole)


def test_pp2_tp2_artifact_equals_eager(llama_pp2_tp2) -> None:
    model, ids, _, out = llama_pp2_tp2
    runner = tppc.load(out, threads_per_stage=1)
    with torch.no_grad():
        want = model(ids).logits
    got = runner(ids.numpy()).logits
    assert_kernels_close(torch.from_numpy(got), want)
    assert len(runner.stages) == 4 and runner.stage_of == (0, 0, 1, 1)


def test_pp2_tp2_artifact_generates_like_eager(llama_pp2_tp2) -> None:
    model, ids, _, out = llama_pp2_tp2
    runner = tppc.load(out, threads_per_stage=1)
    got = runner.generate(ids.numpy(), max_new_tokens=4, eos_token_id=None)
    want = greedy_reference(lambda x: model(x).logits, ids, 4)
    assert np.array_equal(got, want.numpy())


def test_export_check_runs_the_sharded_artifact(llama_pp2_tp2) -> None:
    _, ids, cp, out = llama_pp2_tp2
    checked = check_export(cp, out, (ids,))
    # the logits, at the example's length and at a second (one less)
    assert (checked.stage_outputs, checked.second) == (2, 31) and checked.max_diff < 1e-4


@pytest.mark.parametrize(("family", "degrees"), [("gpt", (2,)), ("gpt", (2, 2)),
                                                 ("llama", (2,)), ("gpt2", (2, 2))])
def test_artifact_equals_eager_and_generates(family: str, degrees: tuple[int, ...],
                                             tmp_path: Path) -> None:
    make = {"gpt": lambda: hf.gpt(seq_len=32, n_layer=2),
            "llama": lambda: hf.hf_llama(seq_len=32),
            "gpt2": lambda: hf.hf_gpt2(seq_len=32)}[family]  # gpt2: Conv1D, a row-parallel mm
    model, (ids,), _ = make()
    cp = tppc.compile(model, (ids,), cluster=f"{2 * len(degrees)}xcpu",
                      num_stages=len(degrees), tensor_parallel=2, chunks=2, verify=False)
    tppc.export(cp, tmp_path, verify=False)
    runner = tppc.load(tmp_path, threads_per_stage=1)
    assert len(runner.stages) == 2 * len(degrees)
    with torch.no_grad():
        want = _logits(model(ids))
    assert_kernels_close(torch.from_numpy(_logits(runner(ids.numpy()))), want)
    new = runner.generate(ids.numpy(), max_new_tokens=3, eos_token_id=None)
    assert np.array_equal(new, greedy_reference(lambda x: _logits(model(x)), ids, 3).numpy())


def test_a_stage_of_one_worker_beside_a_sharded_one(tmp_path: Path) -> None:
    model, (ids,), _ = hf.gpt(seq_len=16, n_layer=2)
    cp = _sharded(model, ids, (2, 1))
    tppc.export(cp, tmp_path, verify=False)
    runner = tppc.load(tmp_path, threads_per_stage=1)
    assert runner.stage_of == (0, 0, 1)
    with torch.no_grad():
        want = model(ids)
    assert_kernels_close(torch.from_numpy(runner(ids.numpy())), want)


def test_a_distributed_job_refuses_a_sharded_artifact(llama_pp2_tp2) -> None:
    with pytest.raises(ArtifactError, match="tensor-parallel stages"):
        verify(llama_pp2_tp2[3], stage=0)


def test_denoise_refuses_a_sharded_artifact(llama_pp2_tp2) -> None:
    runner = tppc.load(llama_pp2_tp2[3], threads_per_stage=1)
    with pytest.raises(RuntimeInputError, match="tensor-parallel"):
        runner.denoise(None, None, 1)


def test_reordered_ranks_are_refused(llama_pp2_tp2, tmp_path: Path) -> None:
    out = llama_pp2_tp2[3]
    for f in out.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    doc = json.loads((out / "plan.json").read_text())
    doc["workers"][0], doc["workers"][1] = doc["workers"][1], doc["workers"][0]
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="ranks"):
        tppc.load(tmp_path)


def test_an_artifact_of_schema_1_still_loads(tmp_path: Path) -> None:
    model, (ids,), _ = hf.gpt(seq_len=16, n_layer=2)
    cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, verify=False)
    tppc.export(cp, tmp_path, verify=False)
    doc = json.loads((tmp_path / "plan.json").read_text())
    doc["schema"] = "tppc.export/1"
    del doc["workers"], doc["groups"]
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    with torch.no_grad():
        want = model(ids)
    assert_kernels_close(torch.from_numpy(tppc.load(tmp_path)(ids.numpy())), want)


def test_the_cli_exports_and_runs_tensor_parallel_stages(tmp_path: Path) -> None:
    from tppc.cli import main

    out = tmp_path / "art"
    assert main(["export", "tppc.examples:gpt", "--cluster", "2xcpu", "--stages", "1",
                 "--tensor-parallel", "2", "--out", str(out)]) == 0
    assert (out / "stage_0.tp1.part0.onnx").is_file()
    model, (ids,), _ = hf.gpt()
    np.savez(tmp_path / "in.npz", input_ids=ids.numpy())
    assert main(["run", str(out), "--input", str(tmp_path / "in.npz"),
                 "--output", str(tmp_path / "out.npz")]) == 0
    with torch.no_grad():
        want = model(ids)
    assert_kernels_close(torch.from_numpy(np.load(tmp_path / "out.npz")["output"]), want)
