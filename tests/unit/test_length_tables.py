"""Length-dependent ropes: the stateless form of transformers' dynamic rope, which values are
tables of the whole length, and where transformers' generate drops its cache."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tppc
from tppc.frontend.length_ropes import length_rope_types, stateless_length_ropes
from tppc.passes.chunking.length_tables import length_reason
from tppc.pipeline.cache_resets import cache_reset_length

transformers = pytest.importorskip("transformers")

COMMON = {"vocab_size": 32, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "max_position_embeddings": 16}


def _llama(rope: dict | None) -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON,
                                                                  rope_scaling=rope)).eval()


def _phi3() -> nn.Module:
    factors = [1.0 + 0.1 * i for i in range(8)]
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **COMMON, original_max_position_embeddings=8, pad_token_id=0,
        rope_scaling={"rope_type": "longrope", "short_factor": factors,
                      "long_factor": factors})).eval()


def test_only_ropes_wrapped_by_dynamic_rope_update_with_a_length_type_are_found() -> None:
    assert length_rope_types(_llama({"rope_type": "dynamic", "factor": 2.0}).model.rotary_emb) \
        == {None: "dynamic"}
    assert length_rope_types(_llama(None).model.rotary_emb) == {}
    assert length_rope_types(_phi3().model.rotary_emb) == {None: "longrope"}
    assert length_rope_types(nn.Linear(2, 2)) == {}


@pytest.mark.parametrize("length", [8, 16, 17, 40])
def test_the_stateless_form_equals_a_fresh_dynamic_rope_bit_for_bit(length: int) -> None:
    rope = _llama({"rope_type": "dynamic", "factor": 4.0}).model.rotary_emb
    shadow = copy.deepcopy(rope)
    assert stateless_length_ropes(shadow) == ("",)
    x, positions = torch.randn(1, length, 32), torch.arange(length)[None]
    for got, want in zip(shadow(x, positions), copy.deepcopy(rope)(x, positions), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(shadow.inv_freq, rope.inv_freq)  # the stateless form keeps no state


def _graph(forward_body) -> tuple[torch.fx.GraphModule, object]:
    class Tables(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return forward_body(ids)

    return tppc.capture(Tables(), (torch.zeros(1, 12, dtype=torch.long),))


def _reason(forward_body) -> str | None:
    gm, ctx = _graph(forward_body)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    return length_reason(out, ctx.seq_symbol)


def _angles(ids: torch.Tensor, base: object) -> torch.Tensor:
    inv = 1.0 / base ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    return (torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * inv).cos()


def test_a_default_rope_table_is_row_local() -> None:
    assert _reason(lambda ids: _angles(ids, 100.0)) is None


def test_a_base_scaled_by_the_length_is_a_table_of_the_whole_length() -> None:
    reason = _reason(lambda ids: _angles(ids, 100.0 * (ids.shape[1] / 16) ** 2))
    assert reason is not None and "reads the length as the number" in reason


def test_frequencies_of_the_largest_position_are_a_table_of_the_whole_length() -> None:
    def body(ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1])
        return _angles(ids, 100.0 * (positions.max() + 1).float())

    reason = _reason(body)
    assert reason is not None and "removes the token axis" in reason


def test_transformers_phi3_generate_drops_its_cache_past_the_original_maximum() -> None:
    assert cache_reset_length(_phi3()) == 9  # original_max_position_embeddings + 1
    assert cache_reset_length(_llama({"rope_type": "dynamic", "factor": 2.0})) is None
    assert cache_reset_length(nn.Linear(2, 2)) is None


def test_the_captured_dynamic_rope_lifts_no_constant() -> None:
    """A rank that builds the model on ``meta`` has no value for a constant the capture made
    (transformers' ``torch.tensor(max_position_embeddings)``); none is left."""
    model = _llama({"rope_type": "dynamic", "factor": 2.0})
    gm, _ = tppc.capture(model, (torch.randint(0, 32, (1, 12)),))
    lifted = [n.target for n in gm.graph.nodes if n.op == "get_attr" and "lifted" in n.target]
    assert lifted == []


def test_a_job_refuses_a_generation_across_phi3s_cache_reset_naming_the_two_step_fix() -> None:
    from tppc.distributed.generate import refuse_cache_reset

    class Rank:
        model, model_name = _phi3(), "Phi3ForCausalLM"

    with pytest.raises(tppc.RuntimeInputError, match=r"passes 9 tokens.*fix: generate up to "
                                                     r"9 tokens \(max_new_tokens=5\)"):
        refuse_cache_reset(Rank(), 4, 12, per_step=True)
    refuse_cache_reset(Rank(), 4, 9, per_step=True)  # ends before the reset: runs
    refuse_cache_reset(Rank(), 10, 20, per_step=True)  # past it already: runs


def test_a_block_scans_generation_refuses_tables_of_the_whole_length_by_name() -> None:
    from tppc.pipeline.block_generate import refuse_length_tables

    with pytest.raises(tppc.RuntimeInputError, match=r"FalconH1ForCausalLM generates by whole "
                                                     r"blocks.*\['where'\].*fix: .*rope_scaling"):
        refuse_length_tables("FalconH1ForCausalLM", ("where",))
    refuse_length_tables("FalconH1ForCausalLM", ())  # no table: nothing to refuse
