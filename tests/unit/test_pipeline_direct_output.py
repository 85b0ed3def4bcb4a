"""The last stage writes a bias-free LM head's logits straight into the full-length output."""

from __future__ import annotations

import pytest
import torch

from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.dispatch.compile import compile_pipeline
from tppc.passes.stages.direct_output import write_outputs_in_place
from tppc.planner.manual import manual_plan
from tppc.program.state import Call, next_epoch

pytest.importorskip("transformers")

SEQ = 16
LAYERS = 4  # prologue, 2 blocks, epilogue


@pytest.fixture(scope="module")
def llama():
    model, args, _ = examples.hf_llama(seq_len=SEQ, layers=2)
    plan = manual_plan(LAYERS, SEQ, cuts=(0, 2, LAYERS), boundaries=(0, 3, 8, SEQ))
    return model, args[0], compile_pipeline(model, args, plan=plan, executor="threads")


def test_the_lm_head_gets_an_out_slot_and_only_the_last_stage(llama):
    _, _, cp = llama
    first, last = cp.program(SEQ).stages
    assert first.out_slots == ()
    (slot,) = last.out_slots
    assert slot.index == 0 and slot.axis == 1 and slot.shape[1] is None
    assert slot.shape[2] == 128 and slot.dtype == torch.float32  # tiny Llama's vocabulary
    ops = [n.target for n in last.runnable.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.linear.out in ops
    assert torch.ops.aten.linear.out not in [n.target for n in last.module.graph.nodes]


@pytest.mark.parametrize("executor", ["local", "threads"])
def test_logits_written_in_place_equal_the_fresh_per_chunk_logits_bit_for_bit(llama, executor):
    model, ids, base = llama
    cp = base.with_plan(base.plan, executor=executor)  # same threads: same kernels' splits
    with torch.no_grad():
        got = cp(ids).logits
        front, bound = cp.bind((ids,), {})
        program = cp.program(SEQ, front)
        call = Call(tuple(bound.flat), program.chunks, SEQ, SEQ, next_epoch())  # no outputs
        state = cp.states.acquire(front, SEQ)
        fresh = torch.cat([values[0] for values in cp.execute(program, call, state,
                                                              executor=executor)], dim=1)
        expected = model(ids).logits
    assert torch.equal(got, fresh)
    assert_kernels_close(got, expected)


def test_a_linear_with_bias_is_left_as_it_is():
    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten.linear.default(x, self.proj.weight, self.proj.bias)

    gm = torch.fx.symbolic_trace(Head())
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["val"] = torch.empty(1, 5, 3)
    module, slots = write_outputs_in_place(gm, (1,))
    assert slots == {} and module is gm
