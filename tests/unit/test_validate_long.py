"""Validation of a long example: two short probe lengths with the compiled stages, not the
example's own length (a few forwards of the model: 7x the compile of a 200 M Llama at 2048
tokens). The oracles: the eager model, a program broken on purpose at a known node, and an
ALiBi-style bias tppc gets wrong (both must still be refused at the short lengths).
"""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, kernel_tolerance
from tests.unit.test_validate import _scale_module_output, _Toy
from tppc import examples
from tppc.driver import emit
from tppc.validation.validate import LONG_TOKENS, SHORT_TOKENS

LONG = LONG_TOKENS + 44


def test_a_long_example_is_checked_at_two_short_lengths_on_the_compiled_stages() -> None:
    model, (ids,), _ = examples.gpt(seq_len=LONG, n_layer=2)
    cp = tppc.compile(model, (ids,), executor="local", num_stages=2)
    v = cp.validation
    assert v.lengths == (SHORT_TOKENS, SHORT_TOKENS - SHORT_TOKENS // 4)
    compiled = tuple(st.layers for st in cp.stages)
    assert len(compiled) == 2
    for run in v.runs:  # the stages the example's program runs, in three chunks
        assert run.stages == compiled and len(run.chunks) == 3
    assert "long example" in v.summary()
    with torch.no_grad():
        want = model(ids)
        assert v.max_diff < kernel_tolerance(want)
        assert_kernels_close(cp(ids), want)


def test_verify_full_also_checks_the_example_length() -> None:
    model, (ids,), _ = examples.gpt(seq_len=LONG, n_layer=2)
    cp = tppc.compile(model, (ids,), executor="local", verify="full")
    assert cp.validation.lengths[0] == LONG
    assert any(r.label == "compiled program" for r in cp.validation.runs)


def test_a_program_broken_at_one_mlp_is_refused_on_a_long_example(monkeypatch) -> None:
    model, (ids,), _ = examples.gpt(seq_len=LONG, n_layer=2)
    monkeypatch.setattr(emit, "partition_stages", _scale_module_output("blocks.1.mlp.2", 1.5))
    with pytest.raises(tppc.SoundnessError) as info:
        tppc.compile(model, (ids,), executor="local")
    assert info.value.module == "blocks.1.mlp.2" and info.value.layer == "blocks.1"
    assert f"length {SHORT_TOKENS}" in str(info.value)


def test_an_alibi_bias_on_a_long_example_is_checked_short_and_exact() -> None:
    """ALiBi was refused here by the short probes before float biases were evaluated per chunk
    (tppc/passes/chunking/bias_rows.py); now the probes pass and the long call equals eager."""
    model = _Toy("alibi").eval()
    ids = torch.randint(0, 64, (1, LONG))
    cp = tppc.compile(model, (ids,), executor="local")
    assert max(cp.validation.lengths) < LONG
    with torch.no_grad():
        want = model(ids)
        assert cp.validation.max_diff < kernel_tolerance(want)
        assert_kernels_close(cp(ids), want)


def test_the_short_probe_is_longer_than_a_sliding_window() -> None:
    pytest.importorskip("transformers")
    model, (ids,), _ = examples.hf_mistral(seq_len=LONG, window=80)
    cp = tppc.compile(model, (ids,), executor="local")
    first, second = cp.validation.lengths
    assert first > 80 + 40 and second > 80 and first < LONG  # queries lose keys to the window
    with torch.no_grad():
        want = model(ids).logits
        assert cp.validation.max_diff < kernel_tolerance(want)
        assert_kernels_close(cp(ids).logits, want)


@pytest.mark.parametrize("verify", ["yes", 2, None])
def test_verify_is_true_false_or_full(verify) -> None:
    with pytest.raises(tppc.SpecError, match="verify="):
        tppc.CompileOptions(verify=verify)
