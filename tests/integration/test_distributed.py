"""The distributed backend: one process per stage (gloo on CPU), against the eager model.

Each job is started with ``tppc.launch`` (local processes, 1 thread each); every rank
builds the model on the meta device and loads only its stage from a safetensors file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc.distributed.checkpoint import empty_model, save_checkpoint
from tppc.examples import gpt, hf_llama, hf_mamba2

pytestmark = pytest.mark.timeout(600)

FACTORIES = {"gpt": gpt, "hf_llama": hf_llama}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    out = {}
    for name, factory in FACTORIES.items():
        model, args, _ = factory()
        path = tmp_path_factory.mktemp("ckpt") / f"{name}.safetensors"
        save_checkpoint(model, path)
        out[name] = (model, args, path)
    return out


def _logits(output: object) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output  # type: ignore[attr-defined]


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_outputs_equal_eager(checkpoints: dict, name: str, nprocs: int) -> None:
    model, args, path = checkpoints[name]
    ids = torch.randint(0, 128, args[0].shape)  # not the factory's example inputs
    result = tppc.launch(f"tppc.examples:{name}", nprocs, checkpoint=path,
                         inputs={"args.0": ids}, chunks=4, timeout=300)
    with torch.no_grad():
        expected = _logits(model(ids))
    assert_kernels_close(result.outputs["out.0"], expected)
    assert [len(r["layers"]) > 0 for r in result.reports] == [True] * nprocs
    whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    per_rank = [r["weights_bytes"] for r in result.reports]
    assert max(per_rank) < 0.8 * whole, (per_rank, whole)  # each rank holds only its stage
    assert sum(per_rank) <= whole * 1.01 + 4096  # (+ non-persistent buffers)


def test_generate_equals_hf(checkpoints: dict) -> None:
    model, _, path = checkpoints["hf_llama"]
    ids = torch.randint(3, 128, (1, 20))
    result = tppc.launch("tppc.examples:hf_llama", 2, checkpoint=path, inputs={"args.0": ids},
                         generate=8, timeout=300)
    expected = model.generate(ids, do_sample=False, max_new_tokens=8)
    assert torch.equal(result.outputs["ids"], expected)


def test_one_rank_job_is_the_whole_model(checkpoints: dict) -> None:
    """(``timeout=None``: no limit on the job, once a crash adding None to a time.)"""
    model, args, path = checkpoints["gpt"]
    result = tppc.launch("tppc.examples:gpt", 1, checkpoint=path, inputs={"args.0": args[0]},
                         chunks=2, timeout=None)
    with torch.no_grad():
        assert_kernels_close(result.outputs["out.0"], model(args[0]))
    whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert result.reports[0]["weights_bytes"] == whole


def test_empty_model_holds_no_weights() -> None:
    model, _, _, buffers = empty_model(hf_llama)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert set(buffers) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}


def test_missing_tensor_names_the_checkpoint(tmp_path: Path) -> None:
    from tppc.distributed.checkpoint import StageWeights

    model, _, _, buffers = empty_model(gpt)
    empty = tmp_path / "empty.safetensors"
    from safetensors.torch import save_file

    save_file({"unrelated": torch.zeros(1)}, str(empty))
    weights = StageWeights(empty, model, buffers, torch.device("cpu"))
    with pytest.raises(tppc.SpecError, match=r"wte.weight.*empty.safetensors"):
        weights.tensor("wte.weight")


def test_distributed_backend_needs_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    model, args, _ = gpt()
    with pytest.raises(tppc.SpecError, match="torchrun"):
        tppc.compile(model, args, backend="distributed")


def test_bad_inputs_are_refused_on_rank_0_before_any_stage_runs(checkpoints: dict) -> None:
    _, args, path = checkpoints["gpt"]
    with pytest.raises(tppc.StageFailed) as info:
        tppc.launch("tppc.examples:gpt", 2, checkpoint=path,
                    inputs={"args.0": args[0].float()}, chunks=2, timeout=300)
    rank0, rank1 = str(info.value).splitlines()[1:]
    assert "RuntimeInputError: input 'input_ids' is torch.float32" in rank0
    assert "rank 0 refused the call inputs" in rank1
    assert info.value.returncodes == (1, 1)


@pytest.mark.parametrize("shared", ["1", "0"])
def test_shared_and_streamed_outputs_equal_eager(checkpoints: dict, shared: str) -> None:
    model, args, path = checkpoints["hf_llama"]
    ids = torch.randint(0, 128, args[0].shape)
    result = tppc.launch("tppc.examples:hf_llama", 2, checkpoint=path, inputs={"args.0": ids},
                         chunks=4, repeat=2, timeout=300, env={"TPPC_SHARED_OUTPUTS": shared})
    with torch.no_grad():
        assert_kernels_close(result.outputs["out.0"], model(ids).logits)
    left = [p for r in result.reports for p in Path("/dev/shm").glob(f"tppc-{r['pid']}-*")]
    assert left == []


def test_block_scan_generate_equals_hf(tmp_path: Path) -> None:
    # Mamba2 (blocks of 4 tokens): each rank re-runs the current block per decode step and
    # puts its own stage's carried states back until the block completes; a prompt of one
    # block and a tail (a prompt whose greedy tokens differ when the states are not put back)
    model, _, _ = hf_mamba2()
    path = tmp_path / "mamba2.safetensors"
    save_checkpoint(model, path)
    ids = torch.tensor([[41, 60, 11, 40, 29, 49]])
    result = tppc.launch("tppc.examples:hf_mamba2", 2, checkpoint=path, inputs={"args.0": ids},
                         generate=7, timeout=300)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=7)
    assert torch.equal(result.outputs["ids"], expected)
