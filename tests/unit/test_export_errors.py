"""Bad artifacts and bad inputs fail with a clear error before anything runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tppc
import tppc.artifact.core.loaded as loaded_module
from tests.oracles import assert_kernels_close
from tppc.artifact.core.load import ArtifactError
from tppc.errors import RuntimeInputError
from tppc.examples import gpt


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    model, args, kwargs = gpt(seq_len=32, n_layer=2)
    cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2, chunks=2)
    path = tmp_path_factory.mktemp("pristine")
    tppc.export(cp, path)
    return path


@pytest.fixture
def artifact(pristine, tmp_path, monkeypatch) -> Path:
    """A fresh copy; creating an ORT stage fails the test unless it is expected."""
    path = tmp_path / "artifact"
    shutil.copytree(pristine, path)
    return path


def _edit(path: Path, fn) -> None:
    doc = json.loads((path / "plan.json").read_text())
    fn(doc)
    (path / "plan.json").write_text(json.dumps(doc))


def _no_sessions(monkeypatch) -> None:
    def refuse(*_, **__):
        raise AssertionError("a session was created before verification failed")
    monkeypatch.setattr(loaded_module, "OrtStage", refuse)


@pytest.mark.parametrize("damage,message", [
    (lambda p: (p / "stage_1.onnx").unlink(), "is missing"),
    (lambda p: (p / "stage_1.onnx").write_bytes((p / "stage_1.onnx").read_bytes()[:100]),
     "truncated"),
    (lambda p: (p / "stage_0.onnx").write_bytes(
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]))((p / "stage_0.onnx").read_bytes())),
     "sha256"),
    (lambda p: (p / "plan.json").unlink(), "no plan.json"),
    (lambda p: (p / "plan.json").write_text("{not json"), "not valid JSON"),
])
def test_damaged_files_are_refused_before_any_session(artifact, monkeypatch, damage,
                                                      message) -> None:
    damage(artifact)
    _no_sessions(monkeypatch)
    with pytest.raises(ArtifactError, match=message):
        tppc.load(artifact)


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(schema="tppc.export/9"), "schema 'tppc.export/9'"),
    (lambda d: d["stages"][0].update(index=5), r"stages\[0\].index"),
    (lambda d: d["stages"][1]["inputs"][0].update(kind="telepathy"), r"inputs\[0\]"),
    (lambda d: d["stages"][0]["buffers"][0].update(shape=[1, 4, 7, 16]), r"buffers\[0\]"),
    (lambda d: d["lengths"].update({"32": [[0, 10], [12, 32]]}), r"lengths\['32'\]"),
    (lambda d: d["signature"]["inputs"][0].update(dtype="complex"), "dtype"),
    (lambda d: d.pop("files"), "files is null"),
])
def test_malformed_plan_json_is_refused_naming_the_field(artifact, monkeypatch, edit,
                                                         message) -> None:
    _edit(artifact, edit)
    _no_sessions(monkeypatch)
    with pytest.raises(ArtifactError, match=message):
        tppc.load(artifact)


@pytest.mark.parametrize("name", ["../outside.onnx", "/etc/passwd", "sub/stage.onnx", ".."])
def test_a_path_escaping_the_directory_is_refused(artifact, monkeypatch, name) -> None:
    def escape(doc):
        doc["files"][name] = doc["files"].pop("stage_0.onnx")
        doc["stages"][0]["file"] = name
    _edit(artifact, escape)
    _no_sessions(monkeypatch)
    with pytest.raises(ArtifactError, match="escape"):
        tppc.load(artifact)


@pytest.mark.parametrize("inputs,message", [
    ({"ids": np.zeros((1, 32), np.int64)}, "unknown input 'ids'"),
    ({}, "input 'input_ids' is missing"),
    ({"input_ids": np.zeros((1, 32), np.int32)}, "int32 of rank 2, exported for int64"),
    ({"input_ids": np.zeros((32,), np.int64)}, "rank 1"),
    ({"input_ids": np.zeros((2, 32), np.int64)}, "size 2 on axis 0"),
    ({"input_ids": np.zeros((1, 31), np.int64)}, "exported for lengths"),
])
def test_inputs_that_do_not_match_the_signature_are_refused(pristine, inputs,
                                                            message) -> None:
    runner = tppc.load(pristine)
    with pytest.raises(RuntimeInputError, match=message):
        runner(**inputs)


def test_unknown_backend_and_format_are_refused(pristine) -> None:
    with pytest.raises(ArtifactError, match="backend='tensorrt'"):
        tppc.load(pristine, backend="tensorrt")
    with pytest.raises(tppc.TppcError, match="format='pt2'"):
        model, args, kwargs = gpt(seq_len=32, n_layer=2)
        tppc.export(tppc.compile(model, args, kwargs, num_stages=2), pristine, format="pt2")


_NO_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "diffusers", "onnx", "onnxscript"):
            raise ImportError("blocked in this test: " + name)
sys.meta_path.insert(0, Block())
import numpy as np
import tppc
runner = tppc.load(sys.argv[1], threads_per_stage=1)
out = runner(np.arange(32, dtype=np.int64).reshape(1, 32) % 256)
np.save(sys.argv[2], out)
np.savez(sys.argv[2] + ".in.npz", input_ids=np.zeros((1, 32), dtype=np.int64))
from tppc.cli.main import main
assert main(["run", sys.argv[1], "--input", sys.argv[2] + ".in.npz", "--output",
             sys.argv[2] + ".out.npz"]) == 0
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "onnx")))
"""


def test_load_run_and_cli_run_need_neither_torch_nor_transformers(pristine, tmp_path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(_NO_TORCH))
    out = tmp_path / "out.npy"
    done = subprocess.run([sys.executable, str(script), str(pristine), str(out)],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(tppc.__file__).parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    import torch

    model, _, _ = gpt(seq_len=32, n_layer=2)
    with torch.no_grad():
        want = model(torch.arange(32).reshape(1, 32) % 256).numpy()
    assert_kernels_close(np.load(out), want)


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_export_removes_what_it_wrote(tmp_path, monkeypatch, existing) -> None:
    """The second stage's translation fails after the first stage's file was written: the
    new files go (and the directories the export created), a file already there stays."""
    import tppc.artifact.writer.write as write_module

    model, args, kwargs = gpt(seq_len=32, n_layer=2)
    cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2, chunks=2)
    translate, seen = write_module.to_onnx, []

    def fail_second(gm, **kw):
        seen.append(kw["name"])
        if kw["name"] == "stage_1":
            assert (target / "stage_0.onnx").is_file()  # the first stage was written
            raise KeyboardInterrupt  # as Ctrl-C would
        return translate(gm, **kw)

    monkeypatch.setattr(write_module, "to_onnx", fail_second)
    target = tmp_path / "deep" / "out"
    if existing:
        target.mkdir(parents=True)
        (target / "notes.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt):
        tppc.export(cp, target)
    assert seen[0] == "stage_0" and seen[-1] == "stage_1"
    if existing:
        assert [p.name for p in target.iterdir()] == ["notes.txt"]
    else:
        assert list(tmp_path.iterdir()) == []
