"""Issue 9: padded batches, sliding windows and mixture-of-experts against eager HF."""

from __future__ import annotations

import functools

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.errors import AnnotationError
from tppc.ir.records import TOKEN, MaskSpec

pytest.importorskip("transformers")


_TWO_STAGES = {"cluster": "2xcpu", "num_stages": 2}


def _padded(batch: int = 2, seq: int = 24, *, left: int = 5, right: int = 4
            ) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :left] = 0
    mask[-1, seq - right:] = 0
    return ids, mask


def _masks(cp: tppc.CompiledPipeline) -> list[MaskSpec | None]:
    return [n.meta[TOKEN].mask for n in cp._front.annotated.graph.nodes
            if n.meta[TOKEN].role == "mixing"]


def _check(model: torch.nn.Module, ids: torch.Tensor, kwargs: dict, chunks: int = 4,
           **options: object) -> tppc.CompiledPipeline:
    cp = tppc.compile(model, (ids,), kwargs, chunks=chunks, **options)
    got = cp(ids, **kwargs).logits
    want = model(ids, **kwargs).logits
    assert not want.isnan().any()
    assert_kernels_close(got, want)
    return cp


def test_llama_left_and_right_padded_batch_equals_eager() -> None:
    model, _, _ = examples.hf_llama()
    ids, mask = _padded()
    cp = _check(model, ids, {"attention_mask": mask})
    assert _masks(cp) == [MaskSpec(key_valid="attention_mask")] * 2


def test_padding_mask_is_never_materialised_in_the_chunk_step() -> None:
    model, _, _ = examples.hf_llama()
    ids, mask = _padded()
    cp = tppc.compile(model, (ids,), {"attention_mask": mask}, chunks=4)
    chunk = cp._front.chunk
    inputs = list(chunk.graph.find_nodes(op="placeholder"))
    assert "full" in [p.meta["tppc.chunk_input"].kind for p in inputs]
    for p in inputs:  # rope tables (L, d) only: no (L, L) mask is sliced per chunk
        symbolic = [s for s in getattr(p.meta.get("val"), "shape", ())
                    if isinstance(s, torch.SymInt)]
        assert len(symbolic) <= 1, p.name


def test_llama_generate_padded_prompts_equals_hf_token_for_token() -> None:
    model, _, _ = examples.hf_llama()
    model.generation_config.pad_token_id = 0
    ids, mask = _padded(3, 12, left=4, right=0)
    mask[1, :7] = 0
    ids = ids.masked_fill(mask == 0, 0)
    cp = tppc.compile(model, (ids,), {"attention_mask": mask}, chunks=3)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    eos = int(want[0, 14])  # row 0 stops there, the others go on
    model.generation_config.eos_token_id = eos
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                          eos_token_id=eos, pad_token_id=0)
    got = cp.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos,
                      pad_token_id=0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("padded", [False, True])
def test_mistral_window_shorter_than_sequence_equals_eager(padded: bool) -> None:
    model, _, _ = examples.hf_mistral(window=5)
    ids, mask = _padded()
    cp = _check(model, ids, {"attention_mask": mask} if padded else {})
    assert {m.window for m in _masks(cp)} == {5}


@functools.cache
def _gemma3() -> tuple[torch.nn.Module, tppc.CompiledPipeline]:
    """Gemma 3 (two local layers, one global) and its pipeline for a padded batch (2 stages)."""
    model, _, _ = examples.hf_gemma3(window=6)
    ids, mask = _padded()
    return model, _check(model, ids, {"attention_mask": mask}, **_TWO_STAGES)


def test_gemma3_local_and_global_layers_equal_eager() -> None:
    model, cp = _gemma3()
    ids, mask = _padded()
    assert_kernels_close(cp(ids, attention_mask=mask).logits,
                         model(ids, attention_mask=mask).logits)
    assert [m.window for m in _masks(cp)] == [6, 6, None]


def test_gemma3_export_equals_eager_on_a_padded_batch(tmp_path) -> None:
    """Issue 31: Gemma 3's ``type_as`` (its RMS norm) exports; windows and padding too."""
    _exported_equals_eager(*_gemma3(), tmp_path)


def _exported_equals_eager(model: torch.nn.Module, cp: tppc.CompiledPipeline, path) -> None:
    """``cp`` exported for 24 and 16 tokens equals ``model`` on the padded batch's rows that
    see a key (a padded query sees no key: 0 in both pipelines, eager averages)."""
    tppc.export(cp, path, lengths=[24, 16])
    runner = tppc.load(path, threads_per_stage=1)
    ids, mask = _padded()
    for n in (24, 16):
        with torch.no_grad():
            want = model(ids[:, :n], attention_mask=mask[:, :n]).logits.numpy()
        got = runner(ids[:, :n].numpy(), attention_mask=mask[:, :n].numpy())["logits"]
        seen = mask[:, :n].bool().numpy()
        assert_kernels_close(got[seen], want[seen])


def test_qwen3_padded_batch_equals_eager() -> None:
    model, _, _ = examples.hf_qwen3()
    ids, mask = _padded()
    _check(model, ids, {"attention_mask": mask})


@functools.cache
def _mixtral(experts: str) -> tuple[torch.nn.Module, tppc.CompiledPipeline]:
    """Mixtral with ``experts`` and its pipeline for a padded batch at 2 stages (checked once)."""
    model, _, _ = examples.hf_mixtral(experts=experts)
    ids, mask = _padded()
    return model, _check(model, ids, {"attention_mask": mask}, chunks=3, **_TWO_STAGES)


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm"])
def test_mixtral_expert_implementations_pipeline_exactly(experts: str) -> None:
    model, cp = _mixtral(experts)
    ids, mask = _padded()
    assert_kernels_close(cp(ids, attention_mask=mask).logits,
                         model(ids, attention_mask=mask).logits)


def test_mixtral_export_equals_eager_on_a_padded_batch(tmp_path) -> None:
    """Issue 31: K/V heads repeated after the buffer read (``repeat_kv``: read as grouped
    heads), the router (``topk``, ``sort``, ``histc``, ``cumsum``) and the experts
    (``grouped_mm``: an ONNX ``Loop`` over the experts) through ONNX Runtime, at two
    lengths (``batched_mm`` exports too: measured, not a test)."""
    _exported_equals_eager(*_mixtral("grouped_mm"), tmp_path)


@functools.cache
def _qwen3_moe() -> tuple[torch.nn.Module, tppc.CompiledPipeline]:
    """Qwen3-MoE (``grouped_mm`` experts) and its pipeline for 16 tokens (2 stages, 4 chunks)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    config._attn_implementation = "sdpa"
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    return model, tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=4)


def test_qwen3_moe_export_equals_eager(tmp_path) -> None:
    """Qwen3-MoE (grouped K/V heads repeated after the buffer read, ``grouped_mm`` experts)
    at 2 stages and 4 chunks through ONNX Runtime (issue 31)."""
    model, cp = _qwen3_moe()
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    tppc.export(cp, tmp_path, lengths=[16])
    with torch.no_grad():
        want = model(ids).logits.numpy()
    assert_kernels_close(tppc.load(tmp_path, threads_per_stage=1)(ids.numpy())["logits"], want)


def _generates_as_hf(model: torch.nn.Module, cp: tppc.CompiledPipeline, vocab: int = 128,
                     batch: int = 2) -> None:
    """Greedy ``cp.generate`` equals transformers' ``model.generate(do_sample=False)`` token
    for token: prompts of 12 tokens (the first row left-padded by 4 when ``batch`` > 1), 8
    new tokens, no end-of-sequence stop (every step compared)."""
    ids = torch.randint(1, vocab, (batch, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(batch, 12, dtype=torch.long)
    if batch > 1:
        mask[0, :4] = 0
    ids = ids.masked_fill(mask == 0, 0)
    stop = {"eos_token_id": None, "pad_token_id": 0}
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **stop)
    got = cp.generate(ids, attention_mask=mask, max_new_tokens=8, **stop)
    assert len(cp.plan.stages) == 2 and want.shape == (batch, 20)
    assert torch.equal(got, want)


def test_mixtral_generate_padded_prompts_equals_hf_token_for_token() -> None:
    """Issue 31: Mixtral's experts (``grouped_mm``) routed per decode step at 2 stages."""
    _generates_as_hf(*_mixtral("grouped_mm"))


def test_gemma3_generate_padded_prompts_equals_hf_token_for_token() -> None:
    """Issue 31: Gemma 3's window of 6 keys (shorter than the prompt) while decoding."""
    _generates_as_hf(*_gemma3())


def test_qwen3_moe_generate_equals_hf_token_for_token() -> None:
    """Issue 31: Qwen3-MoE (q/k norms, ``grouped_mm`` experts) at 2 stages."""
    _generates_as_hf(*_qwen3_moe(), vocab=64, batch=1)


def test_mixtral_eager_experts_are_refused_by_capture() -> None:
    model, ids, _ = examples.hf_mixtral(experts="eager")
    with pytest.raises(tppc.errors.CaptureError):
        tppc.compile(model, ids, chunks=2)


def test_region_that_truly_mixes_tokens_stays_refused() -> None:
    class CumMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x).sort(dim=1).values

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.mlp = CumMLP()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.emb(ids))

    with pytest.raises(AnnotationError, match="sort"):
        tppc.compile(Model().eval(), (torch.randint(0, 16, (1, 12)),), chunks=2)
