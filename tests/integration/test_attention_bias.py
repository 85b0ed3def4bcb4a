"""Additive float attention biases are positional values, evaluated per chunk, exactly.

An ALiBi slope times the distance, a T5-style table looked up by bucketed relative
position, a learned absolute table sliced ``[:L, :L]``: each is the rows of the bias for the
chunk's queries over the keys it sees (never the ``L × L`` bias of a call). The oracle is
the eager model (prefill logits to the kernel tolerance, greedy generation token for
token); a bias computed from hidden states is refused at annotation by name
(:class:`tppc.ActivationMaskError`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tppc
from tests.oracles import assert_kernels_close, greedy_reference

SEQ = 16
MAX_LEN = 4097
"""Rows of the absolute table: one more than the longest sequence a capture admits (4096 for
a short example), so that slicing it ``[:L]`` fixes no length."""
VOCAB = 50
_PLANS = [{"num_stages": 1, "chunks": 1}, {"num_stages": 2, "chunks": 4},
          {"num_stages": 2, "chunks": 3}, {"num_stages": 1, "chunks": 2}]


def _causal(t: int, device: torch.device) -> torch.Tensor:
    """True above the diagonal: the keys a causal query may not see."""
    i = torch.arange(t, device=device)
    return i[None, :] > i[:, None]


def t5_buckets(rel: torch.Tensor, buckets: int = 16, max_distance: int = 64) -> torch.Tensor:
    """T5's causal bucketing of ``key - query`` (exact buckets near, log-spaced far)."""
    n = (-rel).clamp(min=0)
    exact = buckets // 2
    far = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (buckets - exact)).long()
    return torch.where(n < exact, n, far.clamp(max=buckets - 1))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.norm1, self.norm2 = heads, nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.gate = nn.Linear(d, heads)  # (c): a bias from the hidden states

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None, kind: str) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(h).split(d, dim=-1))
        if kind == "activations":  # per key and head, from the hidden states
            bias = self.gate(h).transpose(1, 2)[:, :, None, :].masked_fill(
                _causal(t, x.device), float("-inf"))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class BiasLM(nn.Module):
    """A causal LM whose attention scores get an additive float bias of kind ``kind``:
    ``"relative"`` (a T5-style bucketed relative-position table, an ``nn.Embedding``
    shared by every layer), ``"absolute"`` (a learned ``max_len × max_len`` table sliced
    ``[:L, :L]``), ``"activations"`` (computed from the hidden states: refused)."""

    def __init__(self, kind: str, layers: int = 2, d: int = 32, heads: int = 4,
                 max_len: int = MAX_LEN) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, d)
        self.rel = nn.Embedding(16, heads)
        self.table = nn.Parameter(torch.empty(max_len if kind == "absolute" else 1, max_len))
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB, bias=False)
        for name, p in self.named_parameters():  # strong biases: varied greedy tokens
            if "norm" not in name:
                nn.init.normal_(p, std=3.0 if name in ("rel.weight", "table") else 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        bias = None
        if self.kind == "relative":
            i = torch.arange(t, device=ids.device)
            table = self.rel(t5_buckets(i[None, :] - i[:, None]))  # (t, t, heads)
            bias = table.permute(2, 0, 1)[None].masked_fill(_causal(t, ids.device),
                                                            float("-inf"))
        elif self.kind == "absolute":  # a learned table sliced to the length
            bias = self.table[:t, :t].masked_fill(_causal(t, ids.device), float("-inf"))
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, bias, self.kind)
        return self.head(x)


def _compile(model: nn.Module, ids: torch.Tensor, **options):
    return tppc.compile(model, (ids,), **{"cluster": "2xcpu", **options})


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_own_bias_models_are_exact_under_several_plans(kind) -> None:
    model = BiasLM(kind).eval()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
    for plan in _PLANS:
        cp = _compile(model, ids, **plan)
        assert len(cp.plan.boundaries) - 1 == plan["chunks"]
        assert len(cp.plan.stages) == plan["num_stages"]
        with torch.no_grad():
            assert_kernels_close(cp(ids), want)
    short = ids[:, :11]  # another length than the compiled example's
    with torch.no_grad():
        assert_kernels_close(cp(short), model(short))


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_own_bias_models_generate_the_eager_greedy_tokens(kind) -> None:
    model = BiasLM(kind).eval()
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    cp = _compile(model, ids, num_stages=2, chunks=3)
    want = greedy_reference(model, ids, 12)
    assert len(set(want[0, 10:].tolist())) > 2  # not one repeated token
    torch.testing.assert_close(cp.generate(ids, max_new_tokens=12, eos_token_id=None), want)


def test_a_bias_from_hidden_states_is_refused_at_annotation_by_name() -> None:
    model = BiasLM("activations").eval()
    ids = torch.randint(0, VOCAB, (1, SEQ))
    with pytest.raises(tppc.ActivationMaskError) as info:
        tppc.plan(model, (ids,), cluster="2xcpu")
    err = info.value
    assert isinstance(err, tppc.PassError) and isinstance(err, tppc.AnnotationError)
    assert err.module == "blocks.0" and err.node.startswith("scaled_dot_product_attention")
    assert "float attention bias computed from activations" in err.construct
    assert err.node in str(err) and "blocks.0" in str(err) and "annotate" in str(err)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_a_call_never_builds_the_bias_of_all_queries(kind) -> None:
    """Each chunk builds its rows (``c × L``); nothing has two axes of ``L`` positions (the
    eager model builds several, the check sees them)."""
    length = 48
    model = BiasLM(kind).eval()
    ids = torch.randint(0, VOCAB, (1, length))
    cp = _compile(model, ids, num_stages=2, chunks=4, executor="local")
    with torch.no_grad(), _Shapes() as seen:
        got = cp(ids)
    assert not [s for s in seen.shapes if s.count(length) >= 2]
    with torch.no_grad(), _Shapes() as eager:
        want = model(ids)
    assert [s for s in eager.shapes if s.count(length) >= 2]
    assert_kernels_close(got, want)


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_an_exported_bias_model_matches_torch_and_generates_the_same_tokens(kind, tmp_path):
    """The bias' rows are computed inside the ONNX stage graphs (compares, ``where``,
    ``clamp``, logs, lookups): ONNX Runtime gives the eager logits and greedy tokens."""
    model = BiasLM(kind).eval()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    cp = _compile(model, ids, num_stages=2, chunks=4)
    tppc.export(cp, tmp_path, lengths=[SEQ, 10])
    runner = tppc.load(tmp_path, threads_per_stage=1)
    for length in (SEQ, 10):
        x = ids[:, :length]
        with torch.no_grad():
            want = model(x).numpy()
        assert_kernels_close(runner(x.numpy()), want)
    got = runner.generate(ids[:, :10].numpy(), max_new_tokens=6)
    np.testing.assert_array_equal(got, greedy_reference(model, ids[:, :10], 6).numpy())


# -- transformers' ALiBi families ------------------------------------------------------------


def _falcon(**cfg):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = {"new_decoder_architecture": False, "multi_query": False, **cfg}
    cfg = {"alibi": True, **cfg}
    config = transformers.FalconConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **cfg)
    config._attn_implementation = "sdpa"
    return transformers.FalconForCausalLM(config).eval()


def test_falcon_alibi_prefill_is_exact_under_several_plans() -> None:
    model = _falcon()
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    for plan in _PLANS:
        cp = _compile(model, ids, **plan)
        assert (len(cp.plan.boundaries) - 1, len(cp.plan.stages)) == (plan["chunks"],
                                                                       plan["num_stages"])
        with torch.no_grad():
            assert_kernels_close(cp(ids).logits, want)


@pytest.mark.parametrize("cfg", [{"new_decoder_architecture": True, "num_kv_heads": 2},
                                 {"multi_query": True}], ids=["gqa", "multi-query"])
def test_falcon_alibi_with_fewer_kv_heads_is_exact(cfg) -> None:
    """K/V heads are repeated after the buffer read, so the per-head bias rows line up."""
    model = _falcon(**cfg)
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(0))
    cp = _compile(model, ids, num_stages=2, chunks=4)
    with torch.no_grad():
        assert_kernels_close(cp(ids).logits, model(ids).logits)


def test_falcon_alibi_generates_the_eager_greedy_tokens() -> None:
    """The oracle is the model's own forward over the whole sequence at every step (the
    decode path reads the bias' row of the new token over the cached keys). transformers'
    ``generate`` is not used: at this initialisation it picks another token than the
    model's own forward from the second step on, with or without its cache."""
    model = _falcon(initializer_range=0.3)  # varied tokens, not one repeated
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    cp = _compile(model, ids, num_stages=2, chunks=3)
    want = greedy_reference(lambda x: model(x).logits, ids, 10)
    assert len(set(want[0, 12:].tolist())) > 2
    torch.testing.assert_close(cp.generate(ids, max_new_tokens=10, eos_token_id=None), want)


def test_falcon_alibi_from_a_padding_mask_is_exact_on_every_valid_row() -> None:
    """ALiBi from ``attention_mask``'s cumulative sum (left padding): the valid rows are
    exact with ``verify=False``. A padded query sees no key: there the model averages the
    values of every key, later ones included, which no causal chunk can; the default compile
    refuses it by name (translation validation), naming the float bias."""
    model = _falcon(initializer_range=0.3)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    kwargs = {"attention_mask": mask}
    cp = _compile(model, ids, num_stages=2, chunks=3, verify=False, kwargs=kwargs)
    with torch.no_grad():
        want, got = model(ids, **kwargs).logits, cp(ids, **kwargs).logits
    assert_kernels_close(got[mask.bool()], want[mask.bool()])
    greedy = cp.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    for row in range(2):  # each prompt alone, its padding dropped
        alone = ids[row:row + 1, mask[row].bool()]
        want = greedy_reference(lambda x: model(x).logits, alone, 6)
        torch.testing.assert_close(greedy[row:row + 1, -want.shape[1]:], want)
    with pytest.raises(tppc.SoundnessError) as info:
        _compile(model, ids, num_stages=2, chunks=3, kwargs=kwargs)
    assert "float attention bias" in info.value.construct


def test_falcon_alibi_export_equals_eager(tmp_path) -> None:
    """Falcon's K/V pass through a reshape to the same shape after the buffer read (read as
    the buffer itself), its mask is built in the graph (``diff``, ``cumsum``, indexing on
    the leading axes) and its ALiBi in bfloat16 (computed in float32 and rounded, as torch
    does): ONNX Runtime equals the eager model."""
    model = _falcon()
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(0))
    cp = _compile(model, ids, num_stages=2, chunks=4)
    tppc.export(cp, tmp_path, lengths=[SEQ])
    with torch.no_grad():
        want = model(ids).logits.numpy()
    got = tppc.load(tmp_path, threads_per_stage=1)(ids.numpy())
    assert_kernels_close(got["logits"], want)


def test_falcon_multi_query_rope_export_equals_eager(tmp_path) -> None:
    """Falcon-7B's form (one K/V head, rope, no ALiBi) through ONNX Runtime (issue 31)."""
    model = _falcon(multi_query=True, alibi=False)
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(0))
    tppc.export(_compile(model, ids, num_stages=2, chunks=4), tmp_path, lengths=[SEQ])
    with torch.no_grad():
        want = model(ids).logits.numpy()
    assert_kernels_close(tppc.load(tmp_path, threads_per_stage=1)(ids.numpy())["logits"], want)


def test_bloom_alibi_is_exact_or_refused_by_name() -> None:
    """transformers has no SDPA attention for Bloom: its eager attention is folded (issue 31;
    more plans, padding and generate in test_hf_eager_attention)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=64, hidden_size=64, n_layer=2, n_head=4)
    model = transformers.BloomForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, SEQ))
    try:
        cp = _compile(model, ids, num_stages=2, chunks=4)
    except tppc.AnnotationError as err:
        assert "eager attention" in str(err) and "transformer.h.0" in str(err)
        return
    with torch.no_grad():
        assert_kernels_close(cp(ids).logits, model(ids).logits)
