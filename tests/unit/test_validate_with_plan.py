"""``cp.with_plan(plan)`` is validated like ``tppc.compile`` (unless ``verify=False``). The
oracle: a program broken on purpose at a known node (the error must name it), and the eager
model (an unbroken plan passes)."""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, kernel_tolerance
from tests.unit.test_validate import _scale_module_output
from tppc import examples
from tppc.driver import emit

SEQ = 16


def _plan(cp: tppc.CompiledPipeline, seq: int = SEQ) -> tppc.Plan:
    names = [layer.name for layer in cp.context.layers]
    return tppc.manual_plan(names, seq, cuts=(0, 2, len(names)), boundaries=(0, 5, seq))


def test_a_plan_given_later_is_validated_and_exact() -> None:
    model, (ids,), _ = examples.gpt(seq_len=SEQ, n_layer=2)
    base = tppc.compile(model, (ids,), executor="local")
    cp = base.with_plan(_plan(base))
    assert cp.validation is not None and cp.validation.lengths[0] == SEQ
    with torch.no_grad():
        want = model(ids)
        assert cp.validation.max_diff < kernel_tolerance(want)
        assert_kernels_close(cp(ids), want)


def test_a_broken_program_for_a_plan_given_later_is_refused(monkeypatch) -> None:
    model, (ids,), _ = examples.gpt(seq_len=SEQ, n_layer=2)
    base = tppc.compile(model, (ids,), executor="local")
    monkeypatch.setattr(emit, "partition_stages", _scale_module_output("blocks.1.mlp.2", 1.5))
    with pytest.raises(tppc.SoundnessError) as info:
        base.with_plan(_plan(base))
    assert info.value.module == "blocks.1.mlp.2"


def test_a_plan_for_another_length_is_validated_at_its_length() -> None:
    model, (ids,), _ = examples.gpt(seq_len=SEQ, n_layer=2)
    base = tppc.compile(model, (ids,), executor="local")
    cp = base.with_plan(_plan(base, 24))
    assert cp.validation.lengths[0] == 24
    with torch.no_grad():
        assert cp.validation.max_diff < kernel_tolerance(model(ids))


@pytest.mark.parametrize("where", ["compile", "with_plan"])
def test_verify_false_skips_the_check_of_a_plan_given_later(monkeypatch, where) -> None:
    model, (ids,), _ = examples.gpt(seq_len=SEQ, n_layer=2)
    base = tppc.compile(model, (ids,), executor="local", verify=where != "compile")
    monkeypatch.setattr(emit, "partition_stages", _scale_module_output("blocks.1.mlp.2", 1.5))
    options = {"verify": False} if where == "with_plan" else {}
    cp = base.with_plan(_plan(base), **options)
    assert cp.validation is None
    with torch.no_grad():  # the unchecked pipeline is wrong: what the check is for
        assert (cp(ids) - model(ids)).abs().max() > 1e-2
