"""An artifact pinned by the digest of its ``plan.json`` (issue 30): the per-file hashes
catch damage, not an edit; ``tppc.load(path, expected_sha256=...)`` refuses a stage swapped
for another valid model with ``plan.json`` hashed again. Two exports of a tiny GPT, the second
with other weights; the oracle is each eager model."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc.artifact.core.load import plan_digest, sha256_file
from tppc.errors import ArtifactError
from tppc.examples import gpt

IDS = np.arange(32, dtype=np.int64).reshape(1, 32) % 256


def _export(model: torch.nn.Module, args: Any, path: Path) -> list[str]:
    with torch.no_grad():
        cp = tppc.compile(model, args, cluster="2xcpu", num_stages=2, chunks=2, verify=False)
    lines: list[str] = []
    tppc.export(cp, path, progress=lines.append, verify=False)
    return lines


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> tuple[Path, Path, str, Any, Any]:
    """(the artifact, another model's artifact, the digest the export reported, models)."""
    model, args, _ = gpt(seq_len=32, n_layer=2)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05)
    mine, theirs = tmp_path_factory.mktemp("mine"), tmp_path_factory.mktemp("theirs")
    lines = _export(model, args, mine)
    _export(other, args, theirs)
    digest = next(line.split()[2] for line in lines if line.startswith("plan.json sha256 "))
    return mine, theirs, digest, model, other


def _forged(two: Any, tmp_path: Path) -> Path:
    """The artifact with stage 1 taken from the other export and plan.json hashed again."""
    mine, theirs = two[0], two[1]
    path = tmp_path / "forged"
    shutil.copytree(mine, path)
    doc = json.loads((path / "plan.json").read_text())
    for name in doc["stages"][1]["files"]:
        shutil.copy(theirs / name, path / name)
        doc["files"][name] = {"sha256": sha256_file(path / name),
                              "size": (path / name).stat().st_size}
    (path / "plan.json").write_text(json.dumps(doc))
    return path


def test_the_reported_digest_is_plan_jsons_and_the_artifact_loads_with_it(two) -> None:
    mine, _, digest, model, _ = two
    assert digest == plan_digest(mine) == sha256_file(mine / "plan.json")
    with torch.no_grad():
        want = model(torch.from_numpy(IDS)).numpy()
    assert_kernels_close(tppc.load(mine, expected_sha256=digest.upper())(IDS), want)


def test_a_stage_swapped_with_plan_json_rehashed_is_refused_by_the_digest(two, tmp_path):
    forged = _forged(two, tmp_path)
    model = two[3]
    with torch.no_grad():
        want = model(torch.from_numpy(IDS)).numpy()
    swapped = tppc.load(forged)(IDS)  # the per-file hashes pass: another model's numbers
    assert np.abs(swapped - want).max() > 1e-2
    with pytest.raises(ArtifactError, match=r"plan.json: sha256 [0-9a-f]{64} is not the "
                                            rf"expected {two[2]} \(this is not the artifact"):
        tppc.load(forged, expected_sha256=two[2])


def test_tppc_run_refuses_it_with_exit_2(two, tmp_path, capsys) -> None:
    from tppc.cli.main import main

    forged = _forged(two, tmp_path)
    np.savez(tmp_path / "in.npz", input_ids=IDS)
    out = tmp_path / "out.npz"
    assert main(["run", str(forged), "--input", str(tmp_path / "in.npz"), "--output",
                 str(out), "--expected-sha256", two[2]]) == 2
    assert "is not the expected" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("bad", ["abc", "g" * 64, 123])
def test_a_digest_that_is_not_sha256_hex_is_refused(two, bad) -> None:
    with pytest.raises(ArtifactError, match="is not a sha256 digest"):
        tppc.load(two[0], expected_sha256=bad)
