"""Issue 31: chunked (block-local) attention, each query seeing the keys of its own block.

Llama 4's ``attention_chunk_size`` and a model of our own whose mask is written another way
(block ids by floor division, a ``tril`` of ones) are both recognised as ``MaskSpec(block=b)``
and chunked without an ``L × L`` mask: a chunk reads its keys from its first row's block
start. The oracle is the eager model (several plans, another length, ``generate``, the
exported artifact through ONNX Runtime).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close
from tppc.ir.records import TOKEN
from tppc.planner.manual import manual_plan

BLOCK = 6
VOCAB = 64


class BlockLM(nn.Module):
    """A causal LM of our own whose attention sees only its block of ``BLOCK`` positions
    (learned absolute positions, so it exports)."""

    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.block = heads, BLOCK
        self.emb, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(256, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device)
        blocks = torch.div(positions, self.block, rounding_mode="floor")
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril() \
            & (blocks[:, None] == blocks[None, :])
        x = self.emb(ids) + self.pos(positions)
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                       for z in qkv(x).chunk(3, dim=-1))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + out(a.transpose(1, 2).reshape(b, t, -1))
        return self.head(x)


def _llama4() -> nn.Module:
    """Llama 4 (text), dense layers (``moe_layers=[]``: its experts are tested elsewhere)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, intermediate_size_mlp=128, num_key_value_heads=2, head_dim=16,
        attention_chunk_size=BLOCK, num_local_experts=2, moe_layers=[])
    return transformers.Llama4ForCausalLM(cfg).eval()


@functools.cache
def _own() -> tuple[nn.Module, tppc.CompiledPipeline]:
    model = BlockLM().eval()
    ids = torch.randint(1, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    return model, tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=4)


def _blocks(cp: tppc.CompiledPipeline) -> list[int | None]:
    return [n.meta[TOKEN].mask.block for n in cp._front.annotated.graph.nodes
            if n.meta[TOKEN].role == "mixing"]


def test_own_chunked_attention_is_exact_under_several_plans() -> None:
    model, cp = _own()
    assert _blocks(cp) == [BLOCK, BLOCK]
    ids = torch.randint(1, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    n = len(cp.context.layers)
    with torch.no_grad():
        want = model(ids)
        assert_kernels_close(cp(ids), want)
        for cuts, bounds in [((0, 1, n), (0, 7, 8, 13, 20)), ((0, n), (0, 5, 20))]:
            other = cp.with_plan(manual_plan(n, 20, cuts=cuts, boundaries=bounds),
                                 verify=False)  # the oracle is the eager model
            assert_kernels_close(other(ids), want)
        assert_kernels_close(cp(ids[:, :15]), model(ids[:, :15]))


def test_the_blocks_change_the_own_models_result() -> None:
    """The test above could not fail on blocks read as plain causal attention otherwise."""
    model = BlockLM().eval()
    ids = torch.randint(1, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
        model.block = 1000
        assert (model(ids) - want).abs().max() > 1e-2


def test_own_chunked_attention_exports_and_equals_eager(tmp_path) -> None:
    model, cp = _own()
    tppc.export(cp, tmp_path, lengths=[20, 9])
    runner = tppc.load(tmp_path, threads_per_stage=1)
    ids = torch.randint(1, VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    for n in (20, 9):
        with torch.no_grad():
            want = model(ids[:, :n]).numpy()
        assert_kernels_close(runner(ids[:, :n].numpy()), want)


def test_llama4_chunked_attention_equals_eager_and_generates_its_tokens(tmp_path) -> None:
    """10 tokens in 3 chunks over blocks of 6, then 4 tokens into the third block."""
    model = _llama4()
    ids = torch.randint(1, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=3,
                      verify=False)  # the oracle is the eager model
    assert _blocks(cp) == [BLOCK, BLOCK]
    with torch.no_grad():
        assert_kernels_close(cp(ids).logits, model(ids).logits)
    want = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(cp.generate(ids, max_new_tokens=4), want)
    with pytest.raises(tppc.ExportError, match="view_as_complex"):  # its complex rope
        tppc.export(cp, tmp_path / "out")
