"""chunk_attention: the chunk-step graph of a causal model equals the model, chunk by chunk."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.dispatch.compile import compile_pipeline
from tppc.examples.models import GPT, GPTConfig
from tppc.frontend.annotate import annotate
from tppc.ir.records import CHUNK_INPUT, CHUNK_SIGNATURE
from tppc.passes.chunking.chunk_attention import chunk_attention_pass
from tppc.passes.runner import run_passes
from tppc.planner.manual import manual_plan


@pytest.fixture(scope="module")
def gpt_chunk():
    model, args, _ = examples.gpt(seq_len=16, n_layer=2)
    gm, ctx = annotate(model, args)
    return model, args[0], run_passes(gm, ctx, [chunk_attention_pass])


def _run_chunks(chunk, ids, bounds):
    sig = chunk.meta[CHUNK_SIGNATURE]
    length = ids.shape[1]
    positional = chunk.tppc_positional(torch.zeros_like(ids))
    buffers = {b.name: torch.zeros([length if s is None else s for s in b.spec.shape],
                                   dtype=b.spec.dtype) for b in sig.buffers}
    outs = []
    for a, b in itertools.pairwise(bounds):
        kwargs = {}
        for p in chunk.graph.find_nodes(op="placeholder"):
            spec = p.meta[CHUNK_INPUT]
            kwargs[p.name] = {
                "token": lambda s=spec, a=a, b=b: ids.narrow(s.axis, a, b - a),
                "chunk_start": lambda a=a: a,
                "chunk_size": lambda a=a, b=b: b - a,
                "seq_len": lambda: length,
                "positional": lambda s=spec, a=a, b=b: positional[s.index].narrow(s.axis, a, b - a),
                "key": lambda n=p.name: buffers[n],
                "value": lambda n=p.name: buffers[n],
            }[spec.kind]()
        outs.append(chunk(**kwargs)[0])
    return torch.cat(outs, dim=sig.output_axes[0])


def test_chunk_step_inputs_are_the_chunk_its_offset_and_the_kv_buffers(gpt_chunk):
    _, _, chunk = gpt_chunk
    kinds = [p.meta[CHUNK_INPUT].kind for p in chunk.graph.find_nodes(op="placeholder")]
    assert kinds[:4] == ["token", "chunk_start", "chunk_size", "seq_len"]
    assert kinds.count("key") == kinds.count("value") == 2  # one pair per attention node
    assert "positional" in kinds  # the learned position embedding, sliced per chunk


def test_causal_attention_becomes_the_chunk_op_without_any_mask(gpt_chunk):
    _, _, chunk = gpt_chunk
    ops = [n for n in chunk.graph.nodes if n.target == torch.ops.tppc.chunk_attention.default]
    assert len(ops) == 2
    assert all(n.args[4] is True for n in ops)  # causal
    assert not any(n.target in (torch.ops.aten.tril.default,
                                torch.ops.aten.scaled_dot_product_attention.default)
                   for n in chunk.graph.nodes)


def test_hf_full_length_mask_is_dropped_from_the_chunk_step():
    model, args, kwargs = examples.hf_llama(seq_len=16)
    gm, ctx = annotate(model, args, kwargs)
    chunk = run_passes(gm, ctx, [chunk_attention_pass])
    ops = [n for n in chunk.graph.nodes if n.target == torch.ops.tppc.chunk_attention.default]
    assert ops and all(n.args[4] is True and n.args[6] is True for n in ops)  # causal, GQA
    positional = chunk.meta[CHUNK_SIGNATURE].frontier
    vals = [n.meta["val"] for n in chunk.tppc_positional.graph.nodes if "val" in n.meta
            and isinstance(n.meta["val"], torch.Tensor)]
    symbolic = [v for v in vals if sum(not isinstance(s, int) for s in v.shape) >= 2]
    assert positional and not symbolic  # no (L, L) value is computed per call


@pytest.mark.parametrize("bounds", [(0, 16), (0, 1, 16), (0, 5, 6, 16), tuple(range(17))])
def test_chunked_run_equals_the_model(gpt_chunk, bounds):
    model, ids, chunk = gpt_chunk
    with torch.no_grad():
        assert_kernels_close(_run_chunks(chunk, ids, bounds), model(ids))


def test_kv_buffers_hold_the_models_keys_and_values(gpt_chunk):
    _, _, chunk = gpt_chunk
    sig = chunk.meta[CHUNK_SIGNATURE]
    cfg = GPTConfig(n_layer=2)
    head_dim = cfg.n_embd // cfg.n_head
    assert [b.spec.shape for b in sig.buffers] == [(1, cfg.n_head, None, head_dim)] * 4
    assert [b.spec.kind for b in sig.buffers] == ["key", "value"] * 2


class _Pooled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig(n_layer=2))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids).mean(dim=1)


def test_a_global_epilogue_runs_once_on_the_full_sequence():
    model = _Pooled().eval()
    ids = torch.randint(0, 256, (1, 8))
    plan = manual_plan(4, 8, cuts=(0, 2, 4), boundaries=(0, 3, 8))
    cp = compile_pipeline(model, (ids,), plan=plan, executor="local")
    assert cp.program(8).tail is not None
    with torch.no_grad():
        assert_kernels_close(cp(ids), model(ids))
