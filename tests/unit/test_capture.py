"""tppc.capture: symbolic sequence length, automatic and explicit sequence axes, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.errors import CaptureError


def test_token_ids_get_a_symbolic_sequence_axis() -> None:
    model, args, _ = examples.gpt(seq_len=16)
    gm, ctx = tppc.capture(model, args)
    assert ctx.capture_mode == "dynamic"
    assert ctx.seq_inputs == {"input_ids": (1,)}
    assert ctx.example_seq == 16
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert ctx.seq_symbol in ph.meta["val"].shape[1].node.expr.free_symbols


def test_captured_graph_runs_at_other_lengths() -> None:
    model, _, _ = examples.gpt()
    gm, _ = tppc.capture(model, (torch.randint(0, 256, (1, 16)),))
    ids = torch.randint(0, 256, (1, 40))
    assert_kernels_close(gm(ids), model(ids))


def test_dit_latent_patch_rows_become_the_symbol() -> None:
    model, args, _ = examples.dit(size=8)
    gm, ctx = tppc.capture(model, args)
    assert ctx.seq_inputs == {"x": (2,)}
    assert ctx.example_seq == 4  # 8 rows / patch 2
    x = torch.randn(1, 4, 12, 8)
    assert_kernels_close(gm(x, *args[1:]), model(x, *args[1:]))


def test_explicit_seq_dims() -> None:
    model, args, _ = examples.gpt(seq_len=16)
    _, ctx = tppc.capture(model, args, seq_dims={"input_ids": 1})
    assert ctx.seq_inputs == {"input_ids": (1,)}


def test_seq_dims_naming_a_missing_input_is_refused() -> None:
    model, args, _ = examples.gpt(seq_len=16)
    with pytest.raises(CaptureError, match=r"'tokens'.*input_ids"):
        tppc.capture(model, args, seq_dims={"tokens": 1})


def test_seq_dims_naming_a_missing_axis_is_refused() -> None:
    model, args, _ = examples.gpt(seq_len=16)
    with pytest.raises(CaptureError, match=r"seq_dims\['input_ids'\] = 5.*rank 2"):
        tppc.capture(model, args, seq_dims={"input_ids": 5})


class _NoSeq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_model_without_sequence_axis_is_refused() -> None:
    with pytest.raises(CaptureError, match="no sequence axis found.*seq_dims"):
        tppc.capture(_NoSeq(), (torch.randn(4, 8),))


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        if x.sum() > 0:  # branch on tensor values
            return x * 2
        return x


def test_data_dependent_control_flow_is_named() -> None:
    with pytest.raises(CaptureError, match="(?s)data-dependent control flow.*test_capture.py.*fix"):
        tppc.capture(_DataDependent(), (torch.randint(0, 16, (1, 8)),))


def test_use_cache_true_is_refused() -> None:
    pytest.importorskip("transformers")
    model, args, _ = examples.hf_gpt2(seq_len=8)
    with pytest.raises(CaptureError, match="use_cache=True.*tppc manages"):
        tppc.capture(model, args, {"use_cache": True})


def test_one_token_example_is_refused() -> None:
    model, _, _ = examples.gpt()
    with pytest.raises(CaptureError, match="at least 2 tokens"):
        tppc.capture(model, (torch.randint(0, 256, (1, 1)),), seq_dims={"input_ids": 1})


class _Numpy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return x * float(x.detach().numpy().mean())  # numpy cannot run on fake tensors


def test_export_error_is_reported_in_full_under_the_diagnosis() -> None:
    with pytest.raises(CaptureError) as info:
        tppc.capture(_Numpy(), (torch.randint(0, 16, (1, 8)),))
    text = str(info.value)
    head, _, original = text.partition("torch.export's error, in full:\n")
    assert "could not capture _Numpy" in head and "test_capture.py" in head and "fix:" in head
    assert original.strip()
    assert isinstance(info.value.__cause__, Exception)
    assert str(info.value.__cause__).strip() in original
