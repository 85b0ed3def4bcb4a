"""``tppc.run DIR``: an exported artifact run as a torch.distributed job (gloo, one ORT stage
per rank), against the single-process ``tppc.load(DIR)`` runner and the eager model."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tppc
from tppc.artifact.core.load import ArtifactError, verify
from tppc.examples import gpt, hf_llama

pytestmark = pytest.mark.timeout(600)

FACTORIES = {"gpt": lambda: gpt(), "hf_llama": lambda: hf_llama(seq_len=32, layers=3)}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    out = {}
    for name, factory in FACTORIES.items():
        model, args, kwargs = factory()
        cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2, chunks=4)
        path = tmp_path_factory.mktemp(name)
        tppc.export(cp, path, lengths=[args[0].shape[1], 20])
        out[name] = (model, args, path)
    return out


def _logits(output: object) -> np.ndarray:
    value = output.logits if hasattr(output, "logits") else output  # type: ignore[attr-defined]
    return np.asarray(value)


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_outputs_equal_the_loaded_runner_and_eager(artifacts: dict, name: str) -> None:
    model, _, path = artifacts[name]
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(7))
    result = tppc.launch(path, 2, inputs={"args.0": ids.numpy()}, comm_timeout=20,
                         timeout=240)
    (got,) = result.outputs.values()
    with torch.no_grad():
        eager = _logits(model(ids))
    loaded = tppc.load(path, threads_per_stage=1)(ids.numpy())
    np.testing.assert_allclose(got.numpy(), _logits(loaded), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(got.numpy(), eager, atol=1e-4, rtol=1e-4)
    doc = verify(path)
    stage_bytes = [sum(doc["files"][f]["size"] for f in e["files"]) for e in doc["stages"]]
    assert [r["weights_bytes"] for r in result.reports] == stage_bytes  # each its own only
    assert max(stage_bytes) < 0.8 * sum(stage_bytes)


def test_generate_equals_hf_greedy(artifacts: dict) -> None:
    model, _, path = artifacts["hf_llama"]
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(5))
    result = tppc.launch(path, 2, inputs={"input_ids": ids}, generate=6, comm_timeout=20,
                         timeout=240)
    want = model.generate(ids, do_sample=False, max_new_tokens=6)
    assert torch.equal(result.outputs["ids"], want)


@pytest.mark.parametrize("action", ["raise", "kill"])
def test_a_failing_stage_stops_every_rank(artifacts: dict, action: str) -> None:
    _, args, path = artifacts["gpt"]
    with pytest.raises(tppc.StageFailed) as info:
        tppc.launch(path, 2, inputs={"input_ids": args[0]}, comm_timeout=10, timeout=120,
                    env={"TPPC_FAULT": f"{action}@1:1"})
    codes = info.value.returncodes
    lines = str(info.value).splitlines()[1:]
    if action == "raise":
        assert codes == (1, 1)
        assert all("stage 1 (rank 1) raised" in line for line in lines), str(info.value)
    else:
        assert codes[0] == 1 and codes[1] < 0, codes  # rank 0 left on its own
        assert "stage 1 (rank 1)" in lines[0], str(info.value)


def test_rank0_refuses_bad_inputs_on_every_rank(artifacts: dict) -> None:
    _, _, path = artifacts["gpt"]
    with pytest.raises(tppc.StageFailed) as info:
        tppc.launch(path, 2, inputs={"input_ids": np.zeros((1, 17), np.int64)},
                    comm_timeout=10, timeout=120)
    assert info.value.returncodes == (1, 1)
    assert all("17 tokens" in line for line in str(info.value).splitlines()[1:])


def test_a_rank_verifies_only_its_own_stage(artifacts: dict, tmp_path: Path) -> None:
    _, _, path = artifacts["gpt"]
    copy = tmp_path / "art"
    shutil.copytree(path, copy)
    (copy / "stage_1.onnx").unlink()
    assert verify(copy, stage=0)["stages"][0]["index"] == 0
    with pytest.raises(ArtifactError, match="stage_1.onnx is missing"):
        verify(copy, stage=1)
    with pytest.raises(ArtifactError, match="stage_1.onnx is missing"):
        verify(copy)


def test_a_call_timeout_raises_stage_timeout_naming_the_stage(artifacts: dict) -> None:
    """Stage 0 hangs at its second chunk: rank 1 gives up after the call's 3 s (well before
    the 60 s communication timeout) with StageTimeout naming stage 0; rank 0's watchdog
    ends it once the failure is recorded."""
    _, args, path = artifacts["gpt"]
    t0 = time.perf_counter()
    with pytest.raises(tppc.StageFailed) as info:
        tppc.launch(path, 2, inputs={"input_ids": args[0]}, comm_timeout=60, timeout=120,
                    env={"TPPC_FAULT": "hang@0:1"}, extra_args=["--call-timeout", "3"])
    assert time.perf_counter() - t0 < 50
    assert info.value.returncodes == (1, 1)
    rank1 = str(info.value).splitlines()[2]
    assert "StageTimeout" in rank1 and "stage 0 (rank 0)" in rank1, str(info.value)


def test_rank0s_wait_for_the_results_ends_at_the_call_timeout(artifacts: dict) -> None:
    """The last stage hangs on its last chunk: rank 0, waiting for the results, raises
    StageTimeout naming it after the call's 3 s, not after the 60 s communication timeout."""
    _, args, path = artifacts["gpt"]
    t0 = time.perf_counter()
    with pytest.raises(tppc.StageFailed) as info:
        tppc.launch(path, 2, inputs={"input_ids": args[0]}, comm_timeout=60, timeout=120,
                    env={"TPPC_FAULT": "hang@1:3"}, extra_args=["--call-timeout", "3"])
    assert time.perf_counter() - t0 < 50
    assert info.value.returncodes == (1, 1)
    rank0 = str(info.value).splitlines()[1]
    assert "StageTimeout" in rank0 and "stage 1 (rank 1)" in rank0, str(info.value)
