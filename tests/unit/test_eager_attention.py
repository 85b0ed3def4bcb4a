"""Hand-written attention of our own, in forms transformers does not use: folded and exact, or
refused by name with the op and the source line (``fold_eager_attention_pass``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tppc
from tests.oracles import assert_kernels_close, greedy_reference
from tppc.errors import AnnotationError
from tppc.ir.records import TOKEN
from tppc.ir.softmax_attention import softmax_attention_math

VOCAB = 40
_THIS = "test_eager_attention.py"


def _hand_attention(x: torch.Tensor, qkv: nn.Linear, heads: int, form: str) -> torch.Tensor:
    """Causal attention written out over ``(batch·heads, t, d)`` with ``bmm``, the scale on
    ``q``, the mask built inline; ``form`` picks a variant (see :class:`HandLM`)."""
    b, t, d = x.shape
    hd = d // heads
    q, k, v = (z.view(b, t, heads, hd).transpose(1, 2).reshape(b * heads, t, hd)
               for z in qkv(x).split(d, dim=-1))
    q = q * hd ** -0.5  # the scale applied to q before the matmul
    scores = torch.bmm(q, k.transpose(1, 2))
    if form == "softcap":  # soft-capping written as a product by the inverse
        scores = torch.tanh(scores * 0.5) * 2.0
    hidden = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
    if form == "scale_after_mask":
        scores = scores.masked_fill(hidden, float("-inf")) * 1.5
    else:
        scores = scores.masked_fill(hidden, float("-inf"))
    if form == "relu":
        scores = torch.relu(scores)
    probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
    out = torch.bmm(probs, v).view(b, heads, t, hd).transpose(1, 2).reshape(b, t, d)
    return (out, probs) if form == "weights" else out


class HandLM(nn.Module):
    """A causal LM whose attention is written out (see :func:`_hand_attention`): ``plain``,
    ``softcap`` (tanh soft-capping), and forms tppc refuses: ``scale_after_mask``, ``relu``
    (an op between the scores and the softmax), ``weights`` (returns the probabilities)."""

    def __init__(self, form: str = "plain", d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form, self.heads = form, heads
        self.emb = nn.Embedding(VOCAB, d)
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)
        for name, p in self.named_parameters():  # scores of several units: the soft-cap
            nn.init.normal_(p, std=0.5 if name.startswith("qkv") else 1.0)  # matters

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        extra = []
        for qkv, out in zip(self.qkv, self.out):
            a = _hand_attention(x, qkv, self.heads, self.form)
            if self.form == "weights":
                a, probs = a
                extra.append(probs)
            x = x + out(a)
        logits = self.head(x)
        return (logits, *extra) if extra else logits


def _ids(t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("form", ["plain", "softcap"])
def test_own_hand_written_attention_is_folded_and_exact(form: str) -> None:
    model = HandLM(form).eval()
    ids = _ids()
    with torch.no_grad():
        want = model(ids)
    for stages, chunks in ((1, 1), (2, 4), (2, 3)):
        cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=stages, chunks=chunks)
        with torch.no_grad():
            assert_kernels_close(cp(ids), want)
    kernel = "softmax_attention" if form == "softcap" else "scaled_dot_product_attention"
    mixing = [n for n in cp._front.annotated.graph.nodes if n.meta[TOKEN].role == "mixing"]
    assert [n.meta[TOKEN].attention for n in mixing] == ["causal", "causal"]
    assert all(kernel in str(n.target) for n in mixing)
    with torch.no_grad():
        assert_kernels_close(cp(ids[:, :9]), model(ids[:, :9]))


def test_own_hand_written_attention_generates_the_eager_greedy_tokens() -> None:
    model = HandLM("softcap").eval()
    ids = _ids(8, seed=0)
    cp = tppc.compile(model, (ids,), cluster="2xcpu", num_stages=2, chunks=3)
    want = greedy_reference(model, ids, 8)
    assert len(set(want[0, 8:].tolist())) > 2
    torch.testing.assert_close(cp.generate(ids, max_new_tokens=8, eos_token_id=None), want)


def test_without_the_soft_cap_the_own_model_differs() -> None:
    """So the exactness test above would fail if the fold dropped the cap."""
    ids = _ids()
    with torch.no_grad():
        assert (HandLM("softcap")(ids) - HandLM("plain")(ids)).abs().max() > 1e-2


@pytest.mark.parametrize(("form", "says"), [
    ("scale_after_mask", r"mul \(scale\) follows masked_fill \(mask\)"),
    ("relu", r"op relu between q·kᵀ and the softmax"),
    ("weights", r"attention probabilities are read by 2 ops"),
])
def test_other_forms_are_refused_by_name_with_the_line(form: str, says: str) -> None:
    with pytest.raises(AnnotationError, match=says) as info:
        tppc.annotate(HandLM(form).eval(), (_ids(),))
    assert f"{_THIS}:" in str(info.value)  # the model's source line


def test_softmax_attention_math_equals_its_definition() -> None:
    """Soft-cap, a boolean mask, sinks and grouped K/V heads against the formula by hand."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    sinks = torch.randn(1, 4, 1, 1)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    got = softmax_attention_math(q, k, v, mask, scale=0.3, enable_gqa=True, softcap=2.0,
                                 sinks=sinks)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = 2.0 * torch.tanh(q @ kk.transpose(-1, -2) * 0.3 / 2.0)
    e = torch.exp(s).masked_fill(~mask, 0.0)
    want = (e / (e.sum(-1, keepdim=True) + torch.exp(sinks))) @ vv
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    none = softmax_attention_math(q, kk, vv, torch.zeros(6, 6, dtype=torch.bool))
    assert not math.isnan(float(none.abs().sum())) and not none.any()  # no key seen: 0


def test_folded_attention_is_priced_as_attention_like_sdpa() -> None:
    """The soft-capped form's chunk op is priced as the plain form's (SDPA's): attention
    work over the visited keys, one node per layer."""
    from tppc.cost_models.layer_costs import layer_expressions
    from tppc.cost_models.presets import DEVICE_PRESETS
    from tppc.frontend.annotate import annotate, program_of

    def attention(form: str) -> list:
        gm, ctx = annotate(HandLM(form).eval(), (_ids(),))
        exprs = layer_expressions(program_of(gm, ctx), ctx.layers, DEVICE_PRESETS["a100-80gb"],
                                  16, seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)
        return [n for e in exprs for n in e.nodes if n.kind == "attention"]

    plain, capped = attention("plain"), attention("softcap")
    assert len(capped) == 2 and all(n.op == "chunk_attention" and n.causal_keys for n in capped)
    assert [n.matrix_flops for n in capped] == [n.matrix_flops for n in plain]
