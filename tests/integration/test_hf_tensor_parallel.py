"""Tensor-parallel stages on the LLM families tppc compiles, alone and under the token pipeline.

Each family is built from a tiny config with random weights; a sharded program (degree 2 or
4 per stage) runs on the local and thread executors and must equal the eager model within the
kernel tolerance (a row-parallel projection adds its partial sums in another order). What the
analysis leaves whole (a router, experts, an ALiBi-fused projection) is computed whole on
every worker: exact either way; the test also checks that the attention and MLP projections
of the plain families are cut, so a silently unsharded family cannot pass as sharded.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, greedy_reference
from tppc.driver.emit import build_program
from tppc.errors import SpecError
from tppc.examples import hf
from tppc.ir.records import SHARD

transformers = pytest.importorskip("transformers")


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _compile(model, ids, degrees: tuple[int, ...], executor: str):
    cp = tppc.compile(model, (ids,), cluster=f"{len(degrees)}xcpu", num_stages=len(degrees),
                      chunks=2, executor=executor, verify=False)
    front = cp._front
    cp.programs.hold(front, build_program(front.chunk, front.ctx, cp.plan, degrees=degrees))
    return cp


def _llama4kv():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval()


def _phi3():
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256,
                                  pad_token_id=0)
    return transformers.Phi3ForCausalLM(cfg).eval()


def _qwen2_moe():
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
        shared_expert_intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, experts_implementation="grouped_mm")
    return transformers.Qwen2MoeForCausalLM(cfg).eval()


def _falcon():
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, new_decoder_architecture=False,
                                    multi_query=True, alibi=False)
    cfg._attn_implementation = "sdpa"
    return transformers.FalconForCausalLM(cfg).eval()


def _eager_family(name: str) -> torch.nn.Module:
    from tests.integration.test_hf_eager_attention import _model

    return _model(name)


def _example(fn: Callable) -> Callable:
    return lambda: fn()[0]


FAMILIES: dict[str, tuple[Callable, int]] = {
    # name: (model factory, vocabulary)
    "gpt": (_example(hf.gpt), 256),
    "llama": (_example(hf.hf_llama), 128),
    "gpt2": (_example(hf.hf_gpt2), 128),
    "qwen3": (_example(hf.hf_qwen3), 128),
    "gemma3": (_example(hf.hf_gemma3), 128),
    "mistral": (_example(hf.hf_mistral), 128),
    "mixtral": (_example(hf.hf_mixtral), 128),
    "qwen2_moe": (_qwen2_moe, 128),
    "phi3": (_phi3, 128),
    "falcon_mqa": (_falcon, 64),
    # attention written out by hand (folded into attention by the annotation)
    "gemma2_softcap": (lambda: _eager_family("gemma2"), 128),
    "gpt_oss_sinks": (lambda: _eager_family("gpt_oss"), 128),
    "bloom_alibi": (lambda: _eager_family("bloom"), 128),
}


CASES = [(family, (2, 2), "threads") for family in sorted(FAMILIES)] + [
    (family, (2,), "local") for family in ("gpt2", "phi3", "falcon_mqa")]  # the fused forms


@pytest.mark.parametrize(("family", "degrees", "executor"), CASES)
def test_sharded_prefill_equals_eager(family: str, degrees: tuple[int, ...],
                                      executor: str) -> None:
    make, vocab = FAMILIES[family]
    model = make()
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _logits(model(ids))
    cp = _compile(model, ids, degrees, executor)
    assert_kernels_close(_logits(cp(ids)), want)
    kinds = {n.meta[SHARD].kind for n in cp._front.annotated.graph.nodes if SHARD in n.meta}
    assert {"column", "row"} <= kinds, f"{family}: nothing was cut"


@pytest.mark.parametrize("make", [_example(hf.gpt), _llama4kv], ids=["gpt", "llama_4kv"])
def test_degree_four_with_the_pipeline_equals_eager(make: Callable) -> None:
    model = make()
    vocab = model.config.vocab_size if hasattr(model, "config") else 256
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _logits(model(ids))
    assert_kernels_close(_logits(_compile(model, ids, (4, 2), "threads")(ids)), want)


@pytest.mark.parametrize("make", [lambda: hf.hf_mixtral(layers=1)[0], _qwen2_moe],
                         ids=["mixtral", "qwen2_moe"])
def test_moe_experts_are_cut_inside_every_expert(make: Callable) -> None:
    """Tensor-parallel experts: each expert's gate/up cut by columns, its down by rows (the
    router stays whole: a softmax over the experts)."""
    model = make()
    cp = tppc.compile(model, (torch.randint(0, 128, (1, 16)),), verify=False)
    roles = [n.meta[SHARD].kind for n in cp._front.annotated.graph.nodes
             if "grouped_mm" in str(n.target)]
    assert roles and roles == ["column", "row"] * (len(roles) // 2)
    notes = dict(cp._front.annotated.meta["tppc.shard_notes"])
    assert any("reduces over the cut axis" in why for why in notes.values())


def test_generate_with_key_value_caches_cut_by_heads_equals_greedy_eager() -> None:
    model, (ids,), _ = hf.hf_llama(seq_len=12)
    cp = _compile(model, ids, (2, 2), "threads")
    want = greedy_reference(lambda x: model(x).logits, ids, 8)
    assert cp.generate(ids, max_new_tokens=8).tolist() == want.tolist()
    assert {b.name.rsplit("@", 1)[1] for b in cp.program(12).buffer_specs()} == {"tp0", "tp1"}


def test_degree_the_key_value_heads_do_not_allow_is_refused() -> None:
    model, (ids,), _ = hf.hf_llama()
    with pytest.raises(SpecError, match=r"size 2 .*tensor_parallel=4.* fix"):
        _compile(model, ids, (4,), "local")


def test_the_logits_slices_are_written_in_place_and_gathered_without_a_copy(monkeypatch) -> None:
    """Each worker of the last stage writes its vocabulary slice into the call's output; the
    all-gather of the threads and local executors then returns the view over them (no cat)
    for every chunk, and the logits still equal eager's."""
    from tppc.backends import torch_local

    model, (ids,), _ = hf.hf_llama(seq_len=24)  # vocabulary 128: slices of 64
    cp = _compile(model, ids, (2,), "threads")
    slots = [w.parts[-2].out_slots for w in cp.program(24).workers]
    assert [s[0].piece for s in slots] == [(2, 0, 64), (2, 64, 64)]
    views: list = []
    side_by_side = torch_local._side_by_side
    monkeypatch.setattr(torch_local, "_side_by_side",
                        lambda a, axis: views.append(side_by_side(a, axis)) or views[-1])
    with torch.no_grad():
        want = model(ids).logits
    for executor in ("threads", "local"):  # the local executor's meeting too
        views.clear()
        got = _logits(cp(ids, executor=executor))
        assert len(views) == len(cp.plan.chunks) == 2 and all(v is not None for v in views)
        assert all(v.untyped_storage().data_ptr() == got.untyped_storage().data_ptr()
                   for v in views)
        assert_kernels_close(got, want)
