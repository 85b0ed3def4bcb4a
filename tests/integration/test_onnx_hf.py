"""HF models exported to ONNX: outputs equal the torch backend's, generate equals HF greedy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc.cli.main import main
from tppc.examples import hf_gpt2, hf_llama

pytest.importorskip("transformers")


@pytest.mark.parametrize("factory", [hf_llama, hf_gpt2], ids=["llama", "gpt2"])
def test_exported_hf_model_equals_the_torch_backend(factory, tmp_path) -> None:
    model, args, kwargs = factory(seq_len=32, layers=3)
    cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2, chunks=4)
    tppc.export(cp, tmp_path, lengths=[32, 20])
    runner = tppc.load(tmp_path, threads_per_stage=1)
    for length in (32, 20):
        ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            eager = model(ids).logits.numpy()
        ours = runner(ids.numpy())
        assert_kernels_close(ours.logits, cp(ids).logits.numpy())
        assert_kernels_close(ours["logits"], eager)


def test_generate_equals_hf_greedy_generation_for_llama(tmp_path) -> None:
    model, args, kwargs = hf_llama(seq_len=12, layers=3)
    cp = tppc.compile(model, args, kwargs, cluster="2xcpu", num_stages=2, chunks=3)
    tppc.export(cp, tmp_path)
    runner = tppc.load(tmp_path, threads_per_stage=1)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    want = model.generate(ids, do_sample=False, max_new_tokens=10)
    np.testing.assert_array_equal(runner.generate(ids.numpy(), max_new_tokens=10),
                                  want.numpy())


def test_cli_export_then_run_writes_the_models_outputs(tmp_path, capsys) -> None:
    out = tmp_path / "artifact"
    assert main(["export", "tppc.examples:hf_gpt2", "--cluster", "2xcpu", "--out", str(out),
                 "--stages", "2", "--chunks", "2", "--lengths", "32,24"]) == 0
    assert "stage 1:" in capsys.readouterr().err
    ids = np.arange(24, dtype=np.int64).reshape(1, 24) % 128
    np.savez(tmp_path / "in.npz", input_ids=ids)
    assert main(["run", str(out), "--input", str(tmp_path / "in.npz"), "--output",
                 str(tmp_path / "out.npz"), "--threads", "1"]) == 0
    model, _, _ = hf_gpt2()
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    with np.load(tmp_path / "out.npz") as got:
        assert_kernels_close(got["logits"], want)


def test_cli_run_of_a_damaged_artifact_exits_with_an_error(tmp_path, capsys) -> None:
    (tmp_path / "plan.json").write_text('{"schema": "other/9"}')
    np.savez(tmp_path / "in.npz", input_ids=np.zeros((1, 4), np.int64))
    assert main(["run", str(tmp_path), "--input", str(tmp_path / "in.npz"), "--output",
                 str(tmp_path / "out.npz")]) == 2
    assert "schema 'other/9'" in capsys.readouterr().err
