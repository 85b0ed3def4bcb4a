"""RWKV's time mix: a loop over positions with row-shaped initial states and a token shift.

transformers' ``RwkvForCausalLM`` (its CPU path ``rwkv_linear_attention_cpu``: ``for
current_index in range(seq_length)``, three carried states started as ``zeros_like(key[:, 0])``,
the outputs written ``output[:, t] = ...``) and a model of our own in its form: a
numerically stabilised decayed sum (``num``, ``den`` and a running ``max``, whose decayed
copy ``max + decay`` is an op on the carry alone), its inputs mixed with the previous token's
row by a token shift ``pad(x, (0, 0, 1, -1))``. The row-shaped initial states are made from
their shape (no position read), the shift is a recurrent node carrying one row from chunk to
chunk (docs/annotation.md#recurrent-layers-carried-state), the loop a re-rolled node
(docs/capture.md#re-rolled-loops). A forward that writes a weight in place (RWKV's one-time
rescale on its first call) is refused naming the weights and the fix; a pad that moves rows
the other way is no shift and runs whole.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.oracles import assert_kernels_close, greedy_reference
from tppc.errors import AnnotationError, CaptureError
from tppc.planner.manual import manual_plan

D, VOCAB, LENGTH = 8, 48, 6
BOUNDS = (0, 1, 2, 4, LENGTH)  # chunks of one token and of two


class ShiftedWkv(nn.Module):
    """A WKV-like time mix of our own, stepped in Python as transformers' RWKV CPU path."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.rand(D))
        self.key, self.value, self.out = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.decay, self.first = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = F.pad(x, (0, 0, 1, -1))  # row t holds row t - 1
        mixed = x * self.mix + shifted * (1 - self.mix)
        key, value = self.key(mixed), self.value(mixed)
        num, den = torch.zeros_like(key[:, 0]), torch.zeros_like(key[:, 0])
        high = torch.zeros_like(key[:, 0]) - 1e38
        decay, out = -torch.exp(self.decay), torch.zeros_like(key)
        for t in range(key.shape[1]):
            k, v = key[:, t], value[:, t]
            top = torch.maximum(high, k + self.first)
            e1, e2 = torch.exp(high - top), torch.exp(k + self.first - top)
            out[:, t] = (e1 * num + e2 * v) / (e1 * den + e2)
            top = torch.maximum(high + decay, k)
            e1, e2 = torch.exp(high + decay - top), torch.exp(k - top)
            num, den, high = e1 * num + e2 * v, e1 * den + e2, top
        return x + self.out(out)


class WkvLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList(ShiftedWkv() for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _staged(cp: tppc.CompiledPipeline, length: int = LENGTH,
            bounds: tuple[int, ...] = BOUNDS) -> tppc.CompiledPipeline:
    n = len(cp.context.layers)
    return cp.with_plan(manual_plan(n, length, cuts=(0, n // 2, n), boundaries=bounds))


@pytest.fixture(scope="module")
def wkv() -> tuple[nn.Module, tppc.CompiledPipeline]:
    torch.manual_seed(0)
    model = WkvLM().eval()
    return model, tppc.compile(model, (torch.randint(0, VOCAB, (2, LENGTH)),),
                               cluster="2xcpu")


def test_own_wkv_loop_and_shift_are_recurrent_nodes_exact_in_chunks(wkv) -> None:
    model, cp = wkv
    nodes = cp._front.annotated.graph.nodes
    recurrent = sorted(type(n.target).__name__ if type(n.target).__name__ == "LoopScan"
                       else str(n.target) for n in nodes
                       if getattr(n.meta.get("tppc.token"), "attention", None) == "recurrent")
    assert recurrent == ["LoopScan", "LoopScan", "aten.pad.default", "aten.pad.default"]
    staged = _staged(cp)
    states = [b for st in staged.program(LENGTH).stages for b in st.buffers
              if b.kind == "state"]
    assert sorted({b.shape for b in states}) == [(2, 2, 1, D), (2, 2, D)]  # rows, carries
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    with torch.no_grad():
        assert_kernels_close(staged(ids), model(ids))
        for length in (3, 11):
            ids = torch.randint(0, VOCAB, (2, length))
            assert_kernels_close(cp(ids), model(ids))


def test_own_wkv_generate_and_export_equal_eager(wkv, tmp_path) -> None:
    model, cp = wkv
    prompt = torch.randint(0, VOCAB, (2, 5))
    assert torch.equal(cp.generate(prompt, max_new_tokens=4), greedy_reference(model, prompt, 4))
    tppc.export(_staged(cp), tmp_path)  # the shift's row and the loop's carries as states
    runner = tppc.load(tmp_path, threads_per_stage=1)
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    with torch.no_grad():
        assert_kernels_close(torch.from_numpy(runner(ids.numpy())), model(ids))


class Rescaled(nn.Module):
    """Halves its weight in place on its first call (RWKV's ``_rescale_layers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.proj = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))
        self.done = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.done:
            with torch.no_grad():
                self.proj.weight.div_(2)
            self.done = True
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.proj(x)


def test_forward_writing_a_weight_is_refused_until_called_once() -> None:
    model = Rescaled().eval()
    ids = torch.randint(0, VOCAB, (1, LENGTH))
    with pytest.raises(CaptureError, match=r"writes 1 parameter\(s\) in place .*proj\.weight"
                       r".*fix: run the model once before tppc\.compile"):
        tppc.compile(model, (ids,))
    with torch.no_grad():
        want = model(ids)  # the one-time write, done
        assert_kernels_close(tppc.compile(model, (ids,))(ids), want)


class LeftShift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.proj = nn.Embedding(VOCAB, D), nn.Linear(D, VOCAB)
        self.blocks = nn.ModuleList(nn.Linear(D, D) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(F.pad(x, (0, 0, -1, 1)))  # row t holds row t + 1: reads ahead
        return self.proj(x)


def test_pad_reading_the_next_row_is_no_shift_and_not_row_wise() -> None:
    with pytest.raises(AnnotationError, match=r"node 'pad.*needs the whole sequence"):
        tppc.compile(LeftShift().eval(), (torch.randint(0, VOCAB, (1, LENGTH)),))


def _rwkv(transformers) -> nn.Module:
    model = transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=VOCAB, hidden_size=D, attention_hidden_size=D, intermediate_size=2 * D,
        num_hidden_layers=2, context_length=64, use_cache=False)).eval()
    with torch.no_grad():
        model(torch.tensor([[3, 4]]))  # its one-time rescale (refused if left to the capture)
    return model


def test_hf_rwkv_is_exact_in_chunks_generate_and_exported(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _rwkv(transformers)
    cp = tppc.compile(model, (torch.randint(0, VOCAB, (1, LENGTH)),), {"use_cache": False},
                      num_stages=2)
    assert "modeling_rwkv.py" in cp.context.rerolled
    ids = torch.randint(0, VOCAB, (1, LENGTH))
    with torch.no_grad():
        assert_kernels_close(_staged(cp)(ids).logits, model(ids).logits)
        longer = torch.randint(0, VOCAB, (1, 2 * LENGTH + 1))
        assert_kernels_close(cp(longer).logits, model(longer).logits)
    prompt = torch.randint(0, VOCAB, (2, 5))
    want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                          do_sample=False, use_cache=False)
    assert torch.equal(cp.generate(prompt, max_new_tokens=4), want)
    tppc.export(_staged(cp), tmp_path)
    runner = tppc.load(tmp_path, threads_per_stage=1)
    with torch.no_grad():
        assert_kernels_close(torch.from_numpy(runner(ids.numpy())["logits"]), model(ids).logits)
    got = runner.generate(prompt[:1].repeat(1, 2)[:, :LENGTH].numpy(), max_new_tokens=3)
    want = greedy_reference(lambda x: model(x).logits, prompt[:1].repeat(1, 2)[:, :LENGTH], 3)
    assert torch.equal(torch.from_numpy(got), want)
