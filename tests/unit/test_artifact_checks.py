"""An artifact whose parts disagree is refused by name before any session; so are bad ids.

Each test damages a pristine export the way a user or an attacker could (edit plan.json and
its hashes, swap or rewrite a stage file) and expects :class:`ArtifactError` naming what
disagrees, with no ONNX Runtime session created. The oracle is the damage itself: the
pristine copy loads and runs, the damaged one must not.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

import tppc
import tppc.artifact.core.loaded as loaded_module
from tests.oracles import assert_kernels_close
from tppc.artifact.core.load import sha256_file
from tppc.errors import ArtifactError, RuntimeInputError, SpecError
from tppc.examples import gpt

VOCAB = 256  # tppc.examples.gpt's vocabulary


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Any]:
    """A 2-stage GPT (hidden 64) exported with external weights, and the eager model."""
    model, args, kwargs = gpt(seq_len=32, n_layer=2)
    with torch.no_grad():
        cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2, chunks=2)
    path = tmp_path_factory.mktemp("pristine")
    tppc.export(cp, path, external_data=True)
    return path, model


@pytest.fixture
def artifact(exported, tmp_path, monkeypatch) -> Path:
    """A fresh copy; creating an ORT stage fails the test (checks come before sessions)."""
    path = tmp_path / "artifact"
    shutil.copytree(exported[0], path)

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("a session was created before the check failed")
    monkeypatch.setattr(loaded_module, "OrtStage", refuse)
    return path


def _edit(path: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((path / "plan.json").read_text())
    fn(doc)
    (path / "plan.json").write_text(json.dumps(doc))


def _rewrite(path: Path, name: str, fn: Callable[[onnx.ModelProto], None]) -> None:
    """Change a stage graph and record its new hash, as a careful forger would."""
    model = onnx.load_model(str(path / name), load_external_data=False)
    fn(model)
    onnx.save_model(model, str(path / name))
    _edit(path, lambda d: d["files"].update(
        {name: {"sha256": sha256_file(path / name), "size": (path / name).stat().st_size}}))


def _graph_input(model: onnx.ModelProto, name: str) -> Any:
    return next(v for v in model.graph.input if v.name == name)


def test_the_pristine_artifact_loads_and_matches_eager(exported) -> None:
    path, model = exported
    ids = np.arange(32, dtype=np.int64).reshape(1, 32) % VOCAB
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).numpy()
    assert_kernels_close(tppc.load(path)(ids), want)


def test_a_removed_last_stage_is_refused(artifact) -> None:
    def drop(doc):
        doc["stages"].pop()
        doc["placement"].pop()
    _edit(artifact, drop)
    with pytest.raises(ArtifactError, match=r"stages\[0\] is the last stage but returns "
                                            r"boundary values \['add_2'\]"):
        tppc.load(artifact)


def test_tppc_run_of_an_artifact_missing_its_last_stage_exits_with_the_error(
        artifact, tmp_path, capsys) -> None:
    """The issue's probe: hidden states written as the output, exit 0. Now: exit 2, named."""
    from tppc.cli.main import main

    def drop(doc):
        doc["stages"].pop()
        doc["placement"].pop()
    _edit(artifact, drop)
    np.savez(tmp_path / "in.npz", input_ids=np.zeros((1, 32), np.int64))
    out = tmp_path / "out.npz"
    assert main(["run", str(artifact), "--input", str(tmp_path / "in.npz"), "--output",
                 str(out)]) == 2
    assert "is the last stage but returns boundary values" in capsys.readouterr().err
    assert not out.exists()


def test_a_removed_stage_with_placement_kept_is_refused(artifact) -> None:
    _edit(artifact, lambda d: d["stages"].pop())
    with pytest.raises(ArtifactError, match="placement lists 2 stages and stages 1"):
        tppc.load(artifact)


def test_reordered_stages_are_refused(artifact) -> None:
    def swap(doc):
        doc["stages"].reverse()
        for s, entry in enumerate(doc["stages"]):
            entry["index"] = s
    _edit(artifact, swap)
    with pytest.raises(ArtifactError, match=r"stages\[0\]\.boundary_in is \['add_2'\], but "
                                            "the first stage takes no boundary values"):
        tppc.load(artifact)


def test_swapped_stage_files_are_refused(artifact) -> None:
    def swap(doc):
        a, b = doc["stages"]
        for key in ("file", "files"):
            a[key], b[key] = b[key], a[key]
    _edit(artifact, swap)
    with pytest.raises(ArtifactError, match=r"stage 0 \(stage_1.onnx\) declares graph inputs "
                                            r"that do not match plan.json: missing"):
        tppc.load(artifact)


def test_a_boundary_with_another_hidden_size_is_refused(artifact) -> None:
    def narrow(model):
        _graph_input(model, "add_2").type.tensor_type.shape.dim[2].dim_value = 32
    _rewrite(artifact, "stage_1.onnx", narrow)
    with pytest.raises(ArtifactError, match=r"stage 1 \(stage_1.onnx\) input 'add_2' "
                                            r"\(boundary\) has size 32 on axis 2 .* stage 0's "
                                            r"output 'boundary.add_2' 64"):
        tppc.load(artifact)


def test_a_boundary_with_another_dtype_is_refused(artifact) -> None:
    def half(model):
        _graph_input(model, "add_2").type.tensor_type.elem_type = onnx.TensorProto.FLOAT16
    _rewrite(artifact, "stage_1.onnx", half)
    with pytest.raises(ArtifactError, match="input 'add_2' \\(boundary\\) is float16 in the "
                                            "graph, stage 0's output 'boundary.add_2' is float32"):
        tppc.load(artifact)


def test_a_buffer_spec_that_disagrees_with_the_graph_is_refused(artifact) -> None:
    _edit(artifact, lambda d: d["stages"][1]["buffers"][0].update(shape=[1, 8, None, 16]))
    with pytest.raises(ArtifactError, match=r"has size 4 on axis 1 .* buffers\['scaled_dot_"
                                            r"product_attention_1_key_buffer'\] 8"):
        tppc.load(artifact)


def test_a_signature_with_an_extra_output_is_refused(artifact) -> None:
    def extra(doc):
        doc["signature"]["outputs"].append({"axis": 1})
        doc["signature"]["out_spec"] = {"type": "tuple", "children": [{"type": "leaf"}] * 2}
    _edit(artifact, extra)
    with pytest.raises(ArtifactError, match=r"stages\[1\].outputs is \['output.0'\], expected "
                                            r"\['output.0', 'output.1'\]"):
        tppc.load(artifact)


def test_a_signature_input_of_another_dtype_is_refused(artifact) -> None:
    _edit(artifact, lambda d: d["signature"]["inputs"][0].update(dtype="int32"))
    with pytest.raises(ArtifactError, match="stage 0 .* input 'input_ids'.* is int64 in the "
                                            "graph, signature input 'input_ids' is int32"):
        tppc.load(artifact)


def test_a_weight_file_outside_the_stage_is_refused(artifact, tmp_path) -> None:
    (tmp_path / "secret.bin").write_bytes(b"x" * (1 << 20))

    def outside(model):
        for t in model.graph.initializer:
            for kv in t.external_data:
                if kv.key == "location":
                    kv.value = "../secret.bin"
    _rewrite(artifact, "stage_0.onnx", outside)
    with pytest.raises(ArtifactError, match=r"stored in '\.\./secret\.bin', which is not one of "
                                            "this stage's files"):
        tppc.load(artifact)


def test_a_stage_file_linking_out_of_the_directory_is_refused(artifact, tmp_path) -> None:
    outside = tmp_path / "elsewhere.onnx"
    shutil.copy(artifact / "stage_1.onnx", outside)
    (artifact / "stage_1.onnx").unlink()
    (artifact / "stage_1.onnx").symlink_to(outside)
    with pytest.raises(ArtifactError, match="escape"):
        tppc.load(artifact)


def test_a_plan_json_nested_past_the_parser_is_refused_by_name(artifact) -> None:
    (artifact / "plan.json").write_text("[" * 100_000 + "]" * 100_000)  # RecursionError
    with pytest.raises(ArtifactError, match="nests deeper than 64 levels"):
        tppc.load(artifact)


def test_an_output_tree_nested_too_deep_is_refused_by_name(artifact) -> None:
    _edit(artifact, lambda d: d["signature"].update(
        out_spec=json.loads('{"type": "tuple", "children": [' * 80 + "]}" * 80)))
    with pytest.raises(ArtifactError, match="nests deeper than 64 levels"):
        tppc.load(artifact)


def test_an_oversized_plan_json_is_refused(artifact, monkeypatch) -> None:
    monkeypatch.setattr("tppc.artifact.core.load.MAX_PLAN_BYTES", 1000)
    with pytest.raises(ArtifactError, match="more than the 1,000 tppc reads"):
        tppc.load(artifact)


def test_a_single_stage_of_a_distributed_job_is_checked_alone(artifact) -> None:
    """A rank reads its own stage's graph (the others' files need not be there)."""
    from tppc.artifact.core.load import verify

    for name in ("stage_1.onnx", "stage_1.onnx.data"):
        (artifact / name).unlink(missing_ok=True)
    doc = verify(artifact, stage=0)
    assert doc["signature"]["inputs"][0]["ids_below"] == VOCAB


@pytest.mark.parametrize("bad", [-1, VOCAB, 10**6])
def test_token_ids_outside_the_vocabulary_are_refused(exported, bad) -> None:
    runner = tppc.load(exported[0])
    ids = np.arange(32, dtype=np.int64).reshape(1, 32) % VOCAB
    ids[0, 5] = bad
    with pytest.raises(RuntimeInputError, match=rf"input 'input_ids' holds token id {bad} at "
                                                rf"\(0, 5\); .* ids 0..255\. fix: pass ids in "
                                                r"\[0, 256\)"):
        runner(ids)
    with torch.no_grad(), pytest.raises(IndexError):  # what eager torch does with it
        exported[1](torch.from_numpy(ids))
    with pytest.raises(RuntimeInputError, match=f"token id {bad}"):
        runner.generate(ids, max_new_tokens=2)


def test_a_generation_past_the_host_memory_is_refused_before_it_allocates(exported) -> None:
    # runner.generate had no memory check: its ids and buffers of 10**11 tokens came first
    runner = tppc.load(exported[0])
    ids = np.arange(32, dtype=np.int64).reshape(1, 32) % VOCAB
    with pytest.raises(RuntimeInputError, match=r"^32 prompt tokens \+ max_new_tokens="
                       r"100000000000 = 100000000032 tokens need [\d,.]+ GiB on cpu \(K/V "
                       r"and state buffers .*fix: lower max_new_tokens to at most \d+"):
        runner.generate(ids, max_new_tokens=10**11)


def test_the_edge_ids_of_the_vocabulary_run(exported) -> None:
    path, model = exported
    ids = np.full((1, 32), VOCAB - 1, dtype=np.int64)
    ids[0, :16] = 0
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).numpy()
    assert_kernels_close(tppc.load(path)(ids), want)


def test_a_plan_json_claiming_a_wider_vocabulary_is_not_trusted(artifact, monkeypatch) -> None:
    _edit(artifact, lambda d: d["signature"]["inputs"][0].update(ids_below=10**9))
    monkeypatch.undo()  # sessions allowed: this artifact is valid
    runner = tppc.load(artifact)
    with pytest.raises(RuntimeInputError, match="ids 0..255"):
        runner(np.full((1, 32), VOCAB, dtype=np.int64))


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), "3"])
def test_an_invalid_timeout_is_refused(exported, timeout) -> None:
    runner = tppc.load(exported[0])
    with pytest.raises(SpecError, match=f"timeout={timeout!r} must be a positive"):
        runner.run((np.zeros((1, 32), np.int64),), timeout=timeout)


def test_an_older_export_without_output_sizes_still_loads_and_runs(artifact, exported,
                                                                   monkeypatch) -> None:
    """Exports before output sizes were declared: boundaries checked by type and rank."""
    def undeclare(model):
        for out in model.graph.output:
            for dim in out.type.tensor_type.shape.dim:
                dim.ClearField("dim_value")
                dim.ClearField("dim_param")
    for name in ("stage_0.onnx", "stage_1.onnx"):
        _rewrite(artifact, name, undeclare)
    monkeypatch.undo()
    ids = np.arange(32, dtype=np.int64).reshape(1, 32) % VOCAB
    with torch.no_grad():
        want = exported[1](torch.from_numpy(ids)).numpy()
    assert_kernels_close(tppc.load(artifact)(ids), want)


def test_a_boundary_output_of_another_rank_is_refused_in_an_older_export(artifact) -> None:
    def drop_axis(model):
        out = next(o for o in model.graph.output if o.name == "boundary.add_2")
        del out.type.tensor_type.shape.dim[2]
    _rewrite(artifact, "stage_0.onnx", drop_axis)
    with pytest.raises(ArtifactError, match=r"input 'add_2' \(boundary\) has shape \(1, chunk, "
                                            r"64\) \(rank 3\) in the graph, stage 0's output "
                                            r"'boundary.add_2' \(1, chunk\) \(rank 2\)"):
        tppc.load(artifact)
