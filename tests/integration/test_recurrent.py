"""Recurrent layers with carried state: a scan model of our own, exact through the pipeline.

Our own model in a new form: a gated linear recurrence ``h_t = a_t · h_{t−1} + b_t`` per
channel, computed in log space as minGRU's parallel form does (Heinsen's scan:
``a* = cumsum(log a)``, ``h = exp(a* + logcumsumexp(log b − a*))``), after a causal depthwise
short convolution (``conv1d(padding=k − 1)[..., :L]``, Mamba's), in blocks with an MLP; one
hybrid variant puts a causal SDPA block between them. Checked against eager at 2 stages with
several chunks (chunks of one token included), re-planned lengths, ``generate`` continuing
from the prefill's states, the state buffers' sizes (batch × channels, not the length) and
their price (a scan layer's time has no prefix term; its states count as held bytes).
A wrong initial state is caught by translation validation. The exported artifact carries the
states between its ONNX chunk sessions and equals eager (``tppc.load``, generate included).
transformers' Mamba (its CPU path loops over the positions in Python) is re-rolled
(tests/integration/test_rerolled_loops.py). A sequence padded
to blocks and scanned block by block (Mamba2's chunked SSD scan) is
``tests/integration/test_block_scan.py``'s.
"""

from __future__ import annotations

import pytest
import sympy
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close, greedy_reference
from tppc.cost_models.layer_costs import layer_expressions
from tppc.cost_models.node_costs import C, P
from tppc.cost_models.presets import DEVICE_PRESETS
from tppc.examples.models.scan import ScanBlock
from tppc.passes.annotation import recurrent
from tppc.planner.manual import manual_plan

D, K, VOCAB, LENGTH = 16, 4, 64, 24


class _ScanBlock(ScanBlock):
    def __init__(self) -> None:
        super().__init__(D, D, 2 * D, K)


class _AttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, n, D))


class _ScanLM(nn.Module):
    def __init__(self, kinds: tuple[type[nn.Module], ...] = (_ScanBlock,) * 3) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList(kind() for kind in kinds)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _compile(kinds: tuple[type[nn.Module], ...]) -> tuple[nn.Module, tppc.CompiledPipeline]:
    torch.manual_seed(0)
    model = _ScanLM(kinds).eval()
    return model, tppc.compile(model, (torch.randint(0, VOCAB, (2, LENGTH)),),
                               cluster="2xcpu")


@pytest.fixture(scope="module")
def scan() -> tuple[nn.Module, tppc.CompiledPipeline]:
    """Recurrent blocks only (no attention anywhere)."""
    return _compile((_ScanBlock,) * 3)


@pytest.fixture(scope="module")
def hybrid() -> tuple[nn.Module, tppc.CompiledPipeline]:
    """A causal SDPA block between two recurrent ones."""
    return _compile((_ScanBlock, _AttentionBlock, _ScanBlock))


@pytest.fixture(params=["scan", "hybrid"])
def compiled(request: pytest.FixtureRequest) -> tuple[nn.Module, tppc.CompiledPipeline]:
    return request.getfixturevalue(request.param)


def test_two_stages_several_chunks_equal_eager(compiled) -> None:
    model, cp = compiled
    n = len(cp.context.layers)
    bounds = (0, 1, 2, 9, 17, LENGTH)  # chunks of one token, and chunks shorter than the conv
    staged = cp.with_plan(manual_plan(n, LENGTH, cuts=(0, n // 2, n), boundaries=bounds))
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    with torch.no_grad():
        assert_kernels_close(staged(ids), model(ids))


def test_replanned_lengths_equal_eager(hybrid) -> None:
    model, cp = hybrid
    for length in (7, 40):
        ids = torch.randint(0, VOCAB, (2, length))
        with torch.no_grad():
            assert_kernels_close(cp(ids), model(ids))


def test_generate_continues_from_the_prefill_states(hybrid) -> None:
    model, cp = hybrid
    prompt = torch.randint(0, VOCAB, (2, 9))
    want = greedy_reference(model, prompt, 5)
    assert torch.equal(cp.generate(prompt, max_new_tokens=5), want)


def test_state_buffers_are_sized_by_batch_and_channels(scan) -> None:
    model, cp = scan
    states = {b.name: b for st in cp.program(40).stages for b in st.buffers
              if b.kind == "state"}
    shapes = sorted({(b.shape, b.dtype) for b in states.values()}, key=str)
    # per scan block: cumsum and logcumsumexp (one row, float64 for float32) and the conv
    assert shapes == sorted({((2, 2, 1, D), torch.float64), ((2, 2, D, K - 1), torch.float32)},
                            key=str)
    assert len(states) == 3 * sum(isinstance(b, _ScanBlock) for b in model.blocks)
    assert all(b.axis is None and b.nbytes(10**6) == b.nbytes(1) for b in states.values())


def test_wrong_initial_state_is_caught_by_validation(monkeypatch) -> None:
    # (a wrong cumsum start would cancel out of the log-space scan: exp(a* + 1 − 1))
    monkeypatch.setitem(recurrent.SCAN_INIT, torch.ops.aten.logcumsumexp.default, 0.0)
    model = _ScanLM((_ScanBlock,)).eval()
    with pytest.raises(tppc.SoundnessError, match="logcumsumexp"):
        tppc.compile(model, (torch.randint(0, VOCAB, (1, 8)),), cluster="2xcpu")


def test_scan_chunks_cost_their_rows_only_and_hold_their_states(hybrid) -> None:
    model, cp = hybrid
    front = cp._front  # the front end the pipeline prices
    exprs = layer_expressions(front.chunk, front.ctx.layers, DEVICE_PRESETS["h100-sxm"], 64,
                              seq_symbol=front.ctx.seq_symbol)
    scans = [e for e, block in zip(exprs[1:-1], model.blocks, strict=True)
             if isinstance(block, _ScanBlock)]
    for expr in scans:
        assert P not in expr.time.free_symbols  # no prefix term: linear in the chunk
        assert sympy.degree(sympy.expand(expr.vector_flops), C) == 1
        params = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        states = 2 * (2 * 2 * 1 * D * 8) + 2 * 2 * D * (K - 1) * 4  # two scans, one conv
        assert expr.weight_bytes == params + states and expr.kv_bytes_per_token == 0


def test_exported_states_equal_eager_in_chunks_and_generate(hybrid, tmp_path) -> None:
    """Each stage's state buffers carried between its ONNX chunk sessions (slot 1 written by
    the runner from the chunk's new-state output): 2 stages, chunks of one token, generate."""
    model, cp = hybrid
    n = len(cp.context.layers)
    staged = cp.with_plan(manual_plan(n, LENGTH, cuts=(0, n // 2, n),
                                      boundaries=(0, 1, 2, 9, 17, LENGTH)))
    tppc.export(staged, tmp_path)  # checked against torch and eager on the example
    runner = tppc.load(tmp_path, threads_per_stage=1)
    states = [b for st in runner.plan["stages"] for b in st["buffers"] if b["kind"] == "state"]
    assert len(states) == 6 and all(b["shape"][0] == 2 and b["axis"] is None for b in states)
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    with torch.no_grad():
        assert_kernels_close(torch.from_numpy(runner(ids.numpy())), model(ids))
    prompt = torch.randint(0, VOCAB, (2, LENGTH))
    want = greedy_reference(model, prompt, 4)
    assert torch.equal(torch.from_numpy(runner.generate(prompt.numpy(), max_new_tokens=4)),
                       want)
